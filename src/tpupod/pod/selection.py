"""Worker selections such as ``0,2-3`` (no heavy imports: the CLI parses them on every call)."""

from __future__ import annotations

from tpupod.errors import UsageError


def select_ids(selection: str | None, count: int) -> list[int]:
    """The worker ids a selection names (``None`` or ``"all"``: every worker).

    An empty selection is an error, not "all": ``-w "$IDS"`` with IDS unset must
    not quietly run on every worker.
    """
    if selection is None or selection.strip() == "all":
        return list(range(count))
    if not selection.strip():
        raise UsageError(
            "empty worker selection", hint="write worker ids and ranges like 0,2-3, or 'all'"
        )
    return parse_worker_selection(selection, count)


def parse_worker_selection(selection: str, count: int) -> list[int]:
    """Parse ``"0,2-3"`` into sorted unique worker ids, each checked against ``count``."""
    ids: set[int] = set()
    for token in (t.strip() for t in selection.split(",")):
        lo_text, sep, hi_text = token.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if sep else lo
        except ValueError:
            raise UsageError(
                f"bad worker selection {selection!r}: {token!r} is not a number or a range",
                hint="write worker ids and ranges like 0,2-3, or 'all'",
            ) from None
        if lo > hi:
            raise UsageError(
                f"bad worker selection {selection!r}: range {token!r} runs backwards",
                hint=f"write it as {hi}-{lo}",
            )
        if lo < 0 or hi >= count:
            bad = lo if lo < 0 or lo >= count else hi
            raise UsageError(
                f"worker {bad} does not exist: the pod has workers 0-{count - 1}",
                hint="'tpupod hosts' lists the workers",
            )
        ids.update(range(lo, hi + 1))
    return sorted(ids)
