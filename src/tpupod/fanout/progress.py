"""Progress of a job that runs on every worker: marker lines out, one live view in.

Each worker prints a marker line now and then (``tpupod-progress {"done": 3,
"total": 8, "unit": "samples", "doing": "..."}``), through the output that
``tpupod run`` already carries from every worker, so nothing else has to reach
the launcher. The launcher's ``PodProgress`` takes those lines out of the
output and shows them:

- on a terminal, a rich live table redrawn in place: every host's done/total,
  rate and ETA, what it does now, and the whole pod's line on top (other output
  lines scroll above it);
- otherwise (a pipe, a log, a test), one plain line per marker, prefixed with
  its worker as any output line, so a reader of the log sees the same counts.

Rate and ETA are measured on the launcher's clock, from each host's first
marker to its latest, so a worker need not keep time for it, and a finished
host's rate stays what it was.

Deferred imports: rich is imported when a live view opens: workers import this module for
``marker``, and a view to a pipe prints plain lines.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO, cast

from tpupod.fanout.report import LinePrinter
from tpupod.transport import OutputLine, Stream

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live

    from tpupod.fanout.results import WorkerLike

MARKER = "tpupod-progress "
Forward = Callable[[Any, OutputLine], None]


def marker(done: int, total: int, unit: str, doing: str = "") -> str:
    """The line a worker prints to report its progress."""
    fields = {"done": done, "total": total, "unit": unit, "doing": doing}
    return MARKER + json.dumps(fields, separators=(",", ":"))


def parse(text: str) -> dict[str, Any] | None:
    """A marker line's fields, or None for any other line (or a garbled marker)."""
    if not text.startswith(MARKER):
        return None
    try:
        fields = json.loads(text[len(MARKER) :])
    except ValueError:
        return None
    if not isinstance(fields, dict) or not isinstance(fields.get("done"), int):
        return None
    if not isinstance(fields.get("total"), int):
        return None
    return fields


@dataclass
class HostProgress:
    label: str
    done: int = 0
    total: int = 0
    unit: str = ""
    doing: str = ""
    first_done: int = 0
    first_at: float = 0.0
    seen: bool = False
    updated: float = field(default=0.0)

    def take(self, fields: dict[str, Any], now: float) -> None:
        if not self.seen:
            self.seen, self.first_done, self.first_at = True, int(fields["done"]), now
        self.done, self.total = int(fields["done"]), int(fields["total"])
        self.unit, self.doing = str(fields.get("unit", "")), str(fields.get("doing", ""))
        self.updated = now

    def rate(self, now: float) -> float | None:
        """Units per second from this host's first marker to its latest (None before two)."""
        elapsed = self.updated - self.first_at
        if not self.seen or elapsed <= 0 or self.done <= self.first_done:
            return None
        return (self.done - self.first_done) / elapsed

    def eta(self, now: float) -> float | None:
        """What is left at that rate, less the time since the latest marker."""
        if self.seen and self.done >= self.total:
            return 0.0
        rate = self.rate(now)
        if rate is None:
            return None
        return max(0.0, (self.total - self.done) / rate - (now - self.updated))


def seconds_text(value: float | None) -> str:
    """A time left or taken as progress lines say it: 45s, 1m45s, 2h05m (? unknown)."""
    if value is None:
        return "?"
    if value < 60:
        return f"{value:.0f}s"
    minutes, secs = divmod(int(value), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


class PodProgress:
    """A LineHandler that takes workers' progress markers out of their output and shows them
    (``with PodProgress(...) as view: ... on_line=view``); other lines go on to ``forward``."""

    def __init__(
        self,
        title: str,
        workers: Sequence[WorkerLike],
        forward: Forward | None,
        *,
        tty: bool | None = None,
        console: Console | None = None,
        hide: Callable[[str], bool] | None = None,
        out: TextIO | None = None,
    ) -> None:
        self.title = title
        self.forward = forward
        self.stream = out if out is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.console = console
        # lines the view says already (a worker's own progress line beside its markers):
        # not shown, on a terminal or in a log (a log had each count twice, in two formats)
        self.hide = hide
        self.hosts = {w.id: HostProgress(w.label) for w in workers}
        self.workers = list(workers)
        self.started = time.monotonic()
        self._live: Live | None = None
        self._printer: Forward | None = None

    def __enter__(self) -> PodProgress:
        if self.tty:
            from rich.console import Console
            from rich.live import Live

            console = self.console or Console(file=self.stream)
            self._live = Live(
                get_renderable=self.render,
                console=console,
                refresh_per_second=4,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start()
            # output lines print above the live view, through its console
            above = cast(TextIO, _Above(console))
            self._printer = LinePrinter(self.workers, above, above)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.refresh()
            self._live.stop()
            self._live = None

    def __call__(self, worker: Any, line: OutputLine) -> None:
        fields = parse(line.text)
        if fields is None:
            if self.hide is not None and self.hide(line.text):
                return
            if self._live is not None:
                if self._printer is not None:
                    self._printer(worker, line)
            elif self.forward is not None:
                self.forward(worker, line)
            return
        now = time.monotonic()
        host = self.hosts.setdefault(worker.id, HostProgress(worker.label))
        host.take(fields, now)
        if self._live is None and self.forward is not None:
            self.forward(worker, OutputLine(Stream.STDOUT, self.plain(host, now)))

    def plain(self, host: HostProgress, now: float) -> str:
        """One host's progress as the line a log gets."""
        rate = host.rate(now)
        speed = "" if rate is None else f", {rate:.2f} {host.unit}/s"
        doing = f" | {host.doing}" if host.doing else ""
        return (
            f"progress: {host.done}/{host.total} {host.unit}{speed}, "
            f"ETA {seconds_text(host.eta(now))}{doing}"
        )

    def summary(self, now: float | None = None) -> str:
        """The pod in one line: done of total over every host, elapsed, the slowest ETA."""
        now = time.monotonic() if now is None else now
        seen = [h for h in self.hosts.values() if h.seen]
        done, total = sum(h.done for h in seen), sum(h.total for h in seen)
        etas = [h.eta(now) for h in seen]
        eta = None if not seen or None in etas else max(e for e in etas if e is not None)
        unit = seen[0].unit if seen else ""
        waiting = len(self.hosts) - len(seen)
        starting = f", {waiting} starting" if waiting else ""
        return (
            f"{self.title}: {done}/{total} {unit}{starting}, "
            f"{seconds_text(now - self.started)} elapsed, ETA {seconds_text(eta)}"
        )

    def render(self) -> Any:
        from rich.table import Table

        now = time.monotonic()
        table = Table(title=self.summary(now), title_justify="left", expand=False)
        for column in ("host", "done", "rate", "ETA"):
            table.add_column(column, justify="left" if column == "host" else "right")
        table.add_column("now", overflow="ellipsis", no_wrap=True, max_width=70)
        for _, host in sorted(self.hosts.items()):
            if not host.seen:
                table.add_row(host.label, "-", "", "", "starting")
                continue
            rate = host.rate(now)
            table.add_row(
                host.label,
                f"{host.done}/{host.total} {host.unit}",
                "" if rate is None else f"{rate:.2f}/s",
                seconds_text(host.eta(now)),
                host.doing,
            )
        return table


class _Above:
    """A text stream whose lines a rich console prints above its live view."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def write(self, text: str) -> int:
        from rich.text import Text

        for line in text.rstrip("\n").split("\n"):
            self.console.print(Text.from_ansi(line), soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.console.is_terminal
