"""What a person sees of a fan-out: prefixed output lines and the per-worker summary."""

from __future__ import annotations

import errno
import sys

from tpupod import settings
from tpupod.base.plain import TYPE_CHECKING
from tpupod.errors import TpupodError
from tpupod.extras import for_missing_module
from tpupod.fanout.results import RunState, place, slice_of
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
    ("3 failed: w17, w90, w201 (exit 2)"): 256 rows are read by nobody.
    Plain aligned text with ANSI colors in a terminal: no table library on the
    path every command takes (it costs more to import than the table takes to print).
    """
    paint = _painter(settings.color_wanted(file.isatty()) if color is None else color)
    ok = len(result.workers) - result.failed_count
    lines = [f"{title}: {ok}/{len(result.workers)} ok in {format_duration(result.elapsed)}"]
    silent = result.failed_count == 0 and not any(r.last_line for r in result.workers)
    if verbose or not (silent or len(result.workers) > GROUPED_ABOVE):
        lines.extend(_table(result, file, paint))
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


def worker_names(results: Sequence[WorkerResult]) -> str:
    """Workers' labels, runs of consecutive ids shortened: ``w0-w3, w7, w9-w10``."""
    parts: list[str] = []
    run: list[WorkerResult] = []
    for r in sorted(results, key=lambda r: r.worker.id):
        if run and r.worker.id != run[-1].worker.id + 1:
            parts.append(_span(run))
            run = []
        run.append(r)
    if run:
        parts.append(_span(run))
    return ", ".join(parts)


def _span(run: list[WorkerResult]) -> str:
    first, last = run[0].worker.label, run[-1].worker.label
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
    if ending.state in (RunState.STOPPED, RunState.TIMED_OUT):
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


def debug_requested() -> bool:
    """``--debug`` among the options before ``--``, or ``TPUPOD_DEBUG=1``."""
    argv = sys.argv[1:]
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "--debug" in options or settings.debug()


def notice(text: str) -> None:
    """A line from tpupod itself (not from a worker), on stderr: ``tpupod: ...``."""
    print(f"tpupod: {text}", file=sys.stderr, flush=True)
