"""What a person sees of a fan-out: prefixed output lines and the per-worker summary."""

from __future__ import annotations

import errno
import sys

from tpupod import settings
from tpupod.base.plain import TYPE_CHECKING
from tpupod.errors import TpupodError
from tpupod.extras import for_missing_module
from tpupod.fanout.results import Outcome, RunState, place, slice_of
from tpupod.transport import OutputLine, Stream

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import TextIO

    from tpupod.fanout.results import FanoutResult, WorkerLike, WorkerResult

# Bright and normal ANSI colors, skipping black/white/grey which vanish on some themes.
PALETTE = (36, 33, 35, 32, 34, 31, 96, 93, 95, 92, 94, 91)
RESET = "\x1b[0m"
LAST_LINE_WIDTH = 60
GROUPED_ABOVE = 16  # workers; a larger fan-out's summary groups identical results


def worker_color(worker_id: int) -> int:
    return PALETTE[worker_id % len(PALETTE)]


class LinePrinter:
    """Writes each output line with its worker's prefix (``[w3]``) as soon as it arrives.

    stdout lines go to ``out`` and stderr lines to ``err``, so a pipe gets the
    workers' output and not tpupod's. Prefixes are padded to one width and
    colored per worker in a terminal. ``on_broken_pipe`` is called once if the
    reader of our output goes away (``tpupod exec ... | head``).
    """

    def __init__(
        self,
        workers: Sequence[WorkerLike],
        out: TextIO,
        err: TextIO,
        color: bool | None = None,
        on_broken_pipe: Callable[[], None] | None = None,
    ) -> None:
        self.out, self.err = out, err
        width = max((len(w.label) for w in workers), default=2) + 2
        use_color = settings.color_wanted(out.isatty()) if color is None else color
        self.prefixes = {w.id: self._prefix(w, width, use_color) for w in workers}
        self.on_broken_pipe = on_broken_pipe
        self.broken = False

    @staticmethod
    def _prefix(worker: WorkerLike, width: int, color: bool) -> str:
        text = f"[{worker.label}]".ljust(width)
        return f"\x1b[{worker_color(worker.id)}m{text}{RESET}" if color else text

    def __call__(self, worker: WorkerLike, line: OutputLine) -> None:
        if self.broken:
            return
        stream = self.out if line.stream is Stream.STDOUT else self.err
        try:
            stream.write(f"{self.prefixes[worker.id]} {line.text}\n")
            stream.flush()
        except BrokenPipeError:
            self.broken = True
            if self.on_broken_pipe is not None:
                self.on_broken_pipe()


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def print_summary(
    result: FanoutResult,
    file: TextIO,
    title: str,
    color: bool | None = None,
    verbose: bool = False,
) -> None:
    """How a fan-out ended: its headline, the workers, then the first failure.

    The workers are a table (worker, host, result, time, last line) on a small
    pod, or with ``verbose``. A success with no output is the headline alone;
    beyond ``GROUPED_ABOVE`` workers, identical results are grouped
    ("3 failed: w17, w90, w201 (exit 2)"): 256 rows are read by nobody; on a pod of
    slices, a line per slice (``slice 2  w32-w47  15 ok, 1 failed (w40: exit 1)``).
    Plain aligned text with ANSI colors in a terminal: no table library on the
    path every command takes (it costs more to import than the table takes to print).
    """
    paint = _painter(settings.color_wanted(file.isatty()) if color is None else color)
    ok = len(result.workers) - result.failed_count
    lines = [f"{title}: {ok}/{len(result.workers)} ok in {format_duration(result.elapsed)}"]
    silent = result.failed_count == 0 and not any(r.last_line for r in result.workers)
    if verbose or not (silent or len(result.workers) > GROUPED_ABOVE):
        lines.extend(_table(result, file, paint))
    elif not silent and _sliced(result):
        lines.extend(_slices(result, paint))
    else:
        lines.extend(_groups(result, paint))
    lines.extend(_verdict(result, paint))
    file.write("\n".join(lines) + "\n")
    file.flush()


def _groups(result: FanoutResult, paint: Callable[[str, str], str]) -> list[str]:
    """One line per distinct failed result, naming its workers; nothing for the ones that passed."""
    by_outcome: dict[str, list[WorkerResult]] = {}
    for r in result.workers:
        if not r.ok:
            by_outcome.setdefault(r.outcome_text(), []).append(r)
    return [
        paint("31", f"{len(group)} failed: {worker_names(group)} ({outcome})")
        for outcome, group in sorted(by_outcome.items(), key=lambda item: -len(item[1]))
    ]


def _sliced(result: FanoutResult) -> bool:
    return any(slice_of(r.worker) is not None for r in result.workers)


# a slice's outcomes in the order its line names them: ok, then the workers' own failures,
# then the workers stopped or interrupted because of another's
OUTCOME_ORDER = (
    Outcome.OK,
    Outcome.FAILED,
    Outcome.TIMED_OUT,
    Outcome.UNREACHABLE,
    Outcome.INTERRUPTED,
    Outcome.STOPPED,
)
OWN_FAILURES = (Outcome.FAILED, Outcome.TIMED_OUT, Outcome.UNREACHABLE)


def _slices(result: FanoutResult, paint: Callable[[str, str], str]) -> list[str]:
    """One line per slice, its workers counted by outcome: the slice that failed first,
    then any other with a failure of its own, then those only stopped, then the ok ones."""
    by_slice: dict[int, list[WorkerResult]] = {}
    for r in result.workers:
        by_slice.setdefault(slice_of(r.worker) or 0, []).append(r)
    first = result.first_failure
    first_slice = None if first is None else slice_of(first.worker)

    def rank(item: tuple[int, list[WorkerResult]]) -> tuple[int, int]:
        found, group = item
        outcomes = {r.outcome for r in group}
        if found == first_slice:
            return 0, found
        if outcomes & set(OWN_FAILURES):
            return 1, found
        return (2 if outcomes != {Outcome.OK} else 3), found

    ordered = sorted(by_slice.items(), key=rank)
    rows = [(f"slice {found}", worker_names(group)) for found, group in ordered]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = []
    for row, (_, group) in zip(rows, ordered, strict=True):
        counted = _counts(group)
        ok = all(r.ok for r in group)
        lines.append(f"{_join(row, widths)}  {paint('32' if ok else '31', counted)}")
    return lines


def _counts(group: Sequence[WorkerResult]) -> str:
    """``15 ok, 1 failed (w40: exit 1)``: a slice's workers by outcome, those that did not
    succeed named with how they ended."""
    parts = []
    for outcome in OUTCOME_ORDER:
        ended = [r for r in group if r.outcome is outcome]
        if not ended:
            continue
        said = f"{len(ended)} {outcome.value}"
        if outcome is not Outcome.OK:
            said += f" ({_ways(ended, outcome, whole=len(ended) == len(group) > 1)})"
        parts.append(said)
    return ", ".join(parts)


def _ways(ended: Sequence[WorkerResult], outcome: Outcome, whole: bool) -> str:
    """Workers of one outcome named by how each ended: ``w40: exit 1; w41, w42: exit 2``
    (the outcome's own word left out: ``stopped after w40 failed`` reads ``after w40 failed``;
    the names too where all of a slice ended one way: its line names its workers)."""
    by_way: dict[str, list[WorkerResult]] = {}
    for r in ended:
        by_way.setdefault(_way(r, outcome), []).append(r)
    if whole and len(by_way) == 1:
        return next(iter(by_way)) or worker_names(ended)
    return "; ".join(
        f"{worker_names(rs)}: {way}" if way else worker_names(rs) for way, rs in by_way.items()
    )


def _way(r: WorkerResult, outcome: Outcome) -> str:
    text = r.outcome_text()
    if text == outcome.value:
        return ""
    rest = text.removeprefix(f"{outcome.value} ")
    if rest != text and rest.startswith("(") and rest.endswith(")") and rest.count("(") == 1:
        rest = rest[1:-1]
    return rest


def worker_names(results: Sequence[WorkerResult]) -> str:
    """Workers' labels, runs of consecutive ids shortened: ``w0-w3, w7, w9-w10``."""
    return worker_list([r.worker.id for r in results])


def worker_list(ids: Sequence[int]) -> str:
    """Worker ids as labels, runs of consecutive ids shortened: ``w0-w3, w7, w9, w10``."""
    parts: list[str] = []
    run: list[int] = []
    for worker in sorted(ids):
        if run and worker != run[-1] + 1:
            parts.append(_span(run))
            run = []
        run.append(worker)
    if run:
        parts.append(_span(run))
    return ", ".join(parts)


def _span(run: list[int]) -> str:
    first, last = f"w{run[0]}", f"w{run[-1]}"
    return first if len(run) == 1 else f"{first}{'-' if len(run) > 2 else ', '}{last}"


def _table(result: FanoutResult, file: TextIO, paint: Callable[[str, str], str]) -> list[str]:
    """The per-worker rows, under their header (with each worker's slice on a pod of slices)."""
    sliced = any(slice_of(r.worker) is not None for r in result.workers)
    header = ("worker", *(("slice",) if sliced else ()), "host", "result", "time")
    rows = [
        (
            r.worker.label,
            *((str(slice_of(r.worker)),) if sliced else ()),
            r.worker.hostname,
            r.outcome_text(),
            format_duration(r.duration),
        )
        for r in result.workers
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    room = max(16, min(LAST_LINE_WIDTH, _width(file) - sum(widths) - 2 * len(widths)))
    lines = [paint("1", _join(header, widths) + "  last line")]
    outcome_at = header.index("result")
    for r, row in zip(result.workers, rows, strict=True):
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        cells[0] = paint(str(worker_color(r.worker.id)), cells[0])
        cells[outcome_at] = paint("32" if r.ok else "31", cells[outcome_at])
        lines.append(f"{'  '.join(cells)}  {_clip(r.last_line, room)}".rstrip())
    return lines


def print_verdict(result: FanoutResult, file: TextIO, color: bool | None = None) -> None:
    """Only how a failed fan-out ended (``run -q``): its first failure, timeout or signal;
    nothing when every worker succeeded."""
    paint = _painter(settings.color_wanted(file.isatty()) if color is None else color)
    lines = _verdict(result, paint)
    if lines:
        file.write("\n".join(lines) + "\n")
        file.flush()


def _verdict(result: FanoutResult, paint: Callable[[str, str], str]) -> list[str]:
    """The summary's closing lines: why the fan-out did not succeed (none when it did)."""
    first = result.first_failure
    ending = result.ending()
    lines: list[str] = []
    if ending.state in (RunState.STOPPED, RunState.TIMED_OUT, RunState.HUNG):
        # a timeout stopped every worker still running at once: none of them failed first
        lines.append(paint("1;31", ending.why))
    elif first is not None:
        why = f": {first.error}" if first.error else ""
        lines.append(
            paint(
                "1;31",
                (
                    f"first failure: {first.worker.label} ({place(first.worker)}) "
                    f"{first.outcome_text()}{why} after {format_duration(first.duration)}"
                ),
            )
        )
        if first.hint:
            lines.append(f"hint: {first.hint}")
    return lines


def columns(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as plain aligned text, two spaces apart (the first row is the header):
    the one plain table of every command that prints one."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(_join(row, widths).rstrip() for row in rows)


def print_columns(rows: Sequence[Sequence[str]], file: TextIO) -> None:
    """``columns(rows)``, printed."""
    file.write(columns(rows) + "\n")
    file.flush()


def _painter(color: bool) -> Callable[[str, str], str]:
    if not color:
        return lambda code, text: text
    return lambda code, text: f"\x1b[{code}m{text}{RESET}"


def _join(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True))


def _clip(text: str, width: int) -> str:
    """``text`` in a table cell: control characters (a tab, a colour's escape) out, which
    would move what follows; cut to ``width`` with an ellipsis."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else " " if c == "\t" else "" for c in text)
    return text if len(text) <= width else text[: width - 1] + "…"


def _width(file: TextIO) -> int:
    if file.isatty():
        import shutil  # here: not on the path of a summary printed to a pipe

        return shutil.get_terminal_size().columns
    return 100


def print_error(message: str, hint: str | None, file: TextIO) -> None:
    """How every command reports a TpupodError: an ``error:`` line and a ``hint:`` line."""
    file.write(f"{message}\n" + (f"hint: {hint}\n" if hint else ""))
    file.flush()


DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
DISK_FULL_HINT = "free space on that disk ('df -h' names it), or point TPUPOD_HOME elsewhere"


def report_failure(exc: Exception, subject: str = "this command") -> int:
    """A command's exception the tpupod way, on stderr; its exit code.

    A TpupodError is its ``error:`` and ``hint:`` lines, and so is an import of an extra's
    package that is not installed (the extra ``subject`` needs, named); anything else is a
    bug: one ``internal error:`` line. The traceback is shown only with ``--debug``.
    """
    if debug_requested():
        # --debug only: every command's start imports this module
        import traceback

        traceback.print_exception(exc)
    exc = for_missing_module(exc, subject) or exc
    if isinstance(exc, BrokenPipeError):
        return 141  # as a process killed by SIGPIPE
    if _from_ctrl_c(exc):
        return 130  # as a Ctrl-C elsewhere: the shell's 128 + SIGINT, nothing said
    if isinstance(exc, TpupodError):
        print_error(f"error: {exc.message}", exc.hint, sys.stderr)
        return exc.exit_code
    if isinstance(exc, OSError) and exc.errno in DISK_FULL:  # the machine's state, not a bug
        where = f": {exc.filename}" if exc.filename else ""
        print_error(f"error: {exc.strerror}{where}", DISK_FULL_HINT, sys.stderr)
        return 1
    print_error(
        f"internal error: {type(exc).__name__}: {exc}",
        "rerun with --debug for the traceback, and please report it",
        sys.stderr,
    )
    return 70


def _from_ctrl_c(exc: BaseException) -> bool:
    """Whether a Ctrl-C is what raised ``exc``: Python wraps what a class's ``__set_name__``
    raises in a RuntimeError, a KeyboardInterrupt during an import (pydantic's models) too."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:  # a chain may loop back on itself
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return any(isinstance(link, KeyboardInterrupt) for link in chain)


def debug_requested() -> bool:
    """``--debug`` among the options before ``--``, or ``TPUPOD_DEBUG=1``."""
    argv = sys.argv[1:]
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "--debug" in options or settings.debug()


def notice(text: str) -> None:
    """A line from tpupod itself (not from a worker), on stderr: ``tpupod: ...``."""
    print(f"tpupod: {text}", file=sys.stderr, flush=True)
