"""What a person sees of a fan-out: prefixed output lines and the per-worker summary."""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TextIO

from tpupod import settings
from tpupod.pod import Worker
from tpupod.transport import OutputLine, Stream

if TYPE_CHECKING:
    from tpupod.fanout import FanoutResult

# Bright and normal ANSI colors, skipping black/white/grey which vanish on some themes.
PALETTE = (36, 33, 35, 32, 34, 31, 96, 93, 95, 92, 94, 91)
RESET = "\x1b[0m"
LAST_LINE_WIDTH = 60


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
        workers: Sequence[Worker],
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
    def _prefix(worker: Worker, width: int, color: bool) -> str:
        text = f"[{worker.label}]".ljust(width)
        return f"\x1b[{worker_color(worker.id)}m{text}{RESET}" if color else text

    def __call__(self, worker: Worker, line: OutputLine) -> None:
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
    result: FanoutResult, file: TextIO, title: str, color: bool | None = None
) -> None:
    """The per-worker table (worker, host, result, duration, last line), then the first failure."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    use_color = settings.color_wanted(file.isatty()) if color is None else color
    console = Console(file=file, no_color=not use_color, highlight=False, soft_wrap=False)
    ok = len(result.workers) - result.failed_count
    table = Table(
        title=f"{title}: {ok}/{len(result.workers)} ok in {format_duration(result.elapsed)}",
        title_justify="left",
        box=None,
        header_style="bold",
        pad_edge=False,
    )
    rows = [
        (
            Text(r.worker.label, style=f"color({worker_color(r.worker.id)})"),
            Text(r.worker.hostname),
            Text(r.outcome_text(), style="green" if r.ok else "red"),
            Text(format_duration(r.duration)),
            Text(r.last_line),
        )
        for r in result.workers
    ]
    # The first four columns never shrink; the last line gets what is left of the width.
    for i, name in enumerate(("worker", "host", "result", "time")):
        table.add_column(
            name, no_wrap=True, min_width=max([len(name)] + [len(row[i]) for row in rows])
        )
    fixed = sum(col.min_width or 0 for col in table.columns) + 2 * len(table.columns)
    table.add_column(
        "last line",
        no_wrap=True,
        overflow="ellipsis",
        max_width=max(16, min(LAST_LINE_WIDTH, console.width - fixed)),
    )
    for row in rows:
        table.add_row(*row)
    console.print(table)
    first = result.first_failure
    if result.interrupt_signal is not None:
        name = signal.Signals(result.interrupt_signal).name
        console.print(
            Text(
                f"stopped by {name}: {result.failed_count} workers did not finish", style="bold red"
            )
        )
    elif first is not None:
        why = f": {first.error}" if first.error else ""
        console.print(
            Text(
                f"first failure: {first.worker.label} ({first.worker.hostname}) "
                f"{first.outcome_text()}{why} after {format_duration(first.duration)}",
                style="bold red",
            ),
            soft_wrap=True,  # one line, whatever the width: people grep for it
        )
