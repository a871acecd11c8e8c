"""Worker selections such as ``0,2-3`` or ``s1`` (no heavy imports: the CLI parses them on
every call)."""

from __future__ import annotations

from collections.abc import Sequence

from tpupod.errors import UsageError

HINT = "write worker ids and ranges like 0,2-3, slices like s1 or s0-1, or 'all'"


def select_ids(selection: str | None, count: int, slices: Sequence[int | None] = ()) -> list[int]:
    """The worker ids a selection names (``None`` or ``"all"``: every worker); ``slices``
    is each worker's slice, for ``sK`` (every worker of slice K) and ``sK-M``.

    An empty selection is an error, not "all": ``-w "$IDS"`` with IDS unset must
    not quietly run on every worker.
    """
    if selection is None or selection.strip() == "all":
        return list(range(count))
    if not selection.strip():
        raise UsageError("empty worker selection", hint=HINT)
    return parse_worker_selection(selection, count, slices)


def parse_worker_selection(
    selection: str, count: int, slices: Sequence[int | None] = ()
) -> list[int]:
    """Parse ``"0,2-3"`` (and ``"s1"``) into sorted unique worker ids, each checked against
    ``count`` (slices against the pod's)."""
    ids: set[int] = set()
    for token in (t.strip() for t in selection.split(",")):
        if token.startswith("s"):
            ids.update(_slice_workers(selection, token, slices, count))
            continue
        lo, hi = _range(selection, token)
        if lo < 0 or hi >= count:
            bad = lo if lo < 0 or lo >= count else hi
            raise UsageError(
                f"worker {bad} does not exist: the pod has workers 0-{count - 1}",
                hint="'tpupod hosts' lists the workers",
            )
        ids.update(range(lo, hi + 1))
    return sorted(ids)


def _slice_workers(
    selection: str, token: str, slices: Sequence[int | None], count: int
) -> list[int]:
    """The workers of the slices ``sK`` or ``sK-M`` names."""
    known = sorted({s for s in slices if s is not None})
    lo, hi = _range(selection, token[1:], token)
    if not known:  # a pod of one slice is slice 0: a script for pods of slices runs here too
        if hi > 0:
            raise UsageError(
                f"slice {hi} does not exist: the pod is one slice, s0",
                hint="'tpupod up --slices S' makes a pod of slices",
            )
        return list(range(count))
    if lo < 0 or hi > known[-1]:
        bad = lo if lo < 0 or lo > known[-1] else hi
        raise UsageError(
            f"slice {bad} does not exist: the pod has slices 0-{known[-1]}",
            hint="'tpupod hosts' lists each worker's slice",
        )
    return [i for i, s in enumerate(slices) if s is not None and lo <= s <= hi]


def _range(selection: str, text: str, token: str | None = None) -> tuple[int, int]:
    """``"2"`` or ``"2-3"`` as (low, high), checked to run forwards (``token``: as written,
    ``s2-3`` for a slice range)."""
    token = token or text
    prefix = token[: len(token) - len(text)]
    lo_text, sep, hi_text = text.partition("-")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
    except ValueError:
        raise UsageError(
            f"bad worker selection {selection!r}: {token!r} is not a number or a range", hint=HINT
        ) from None
    if lo > hi:
        raise UsageError(
            f"bad worker selection {selection!r}: range {token!r} runs backwards",
            hint=f"write it as {prefix}{hi}-{lo}",
        )
    return lo, hi
