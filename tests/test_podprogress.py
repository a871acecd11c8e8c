"""The launcher's progress view: workers' marker lines to a live table, or to plain lines."""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
from rich.console import Console

from tpupod.fanout.progress import PodProgress, marker, parse
from tpupod.transport import OutputLine, Stream


@dataclass(frozen=True)
class W:
    id: int
    hostname: str = "vm"

    @property
    def label(self) -> str:
        return f"w{self.id}"


def out(text: str) -> OutputLine:
    return OutputLine(Stream.STDOUT, text)


def test_markers_become_plain_lines_off_a_terminal() -> None:
    seen: list[tuple[int, str]] = []
    view = PodProgress("bench s", [W(0), W(1)], lambda w, line: seen.append((w.id, line.text)))
    with view:
        view(W(1), out(marker(0, 4, "runs", "1/2 a repeat 1/2")))
        view(W(1), out("an ordinary line"))
        view(W(1), out("tpupod-progress {not json"))  # garbled: an ordinary line
        view(W(1), out(marker(4, 4, "runs", "b: done")))
    assert seen == [
        (1, "progress: 0/4 runs, ETA ? | 1/2 a repeat 1/2"),
        (1, "an ordinary line"),
        (1, "tpupod-progress {not json"),
        (1, seen[3][1]),
    ]
    assert seen[3][1].startswith("progress: 4/4 runs, ") and "ETA 0s | b: done" in seen[3][1]
    assert view.summary().startswith("bench s: 4/4 runs, 1 starting, ")  # w0 sent nothing


def test_a_terminal_gets_a_live_table_and_lines_above_it() -> None:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=150, color_system=None)
    forwarded: list[str] = []
    view = PodProgress(
        "extract",
        [W(0), W(1)],
        lambda w, line: forwarded.append(line.text),
        tty=True,
        console=console,
        hide=lambda text: text.startswith("noise"),
    )
    with view:
        view(W(0), out(marker(0, 10, "samples", "first batch")))
        view(W(1), out(marker(0, 12, "samples")))
        view(W(0), out(marker(10, 10, "samples", "all written")))
        view(W(1), out("hello from w1"))
        view(W(0), out("noise that the table says better"))
    text = screen.getvalue()
    assert forwarded == []  # on a terminal the view prints, not the plain printer
    assert "[w1] hello from w1" in text and "noise" not in text
    last = text[text.rindex("extract: ") :]  # the final redraw
    assert "extract: 10/22 samples" in last
    assert "10/10 samples" in last and "all written" in last and "0/12 samples" in last
    assert "tpupod-progress" not in text


def test_parse_takes_only_whole_markers() -> None:
    assert parse(marker(1, 2, "runs")) == {"done": 1, "total": 2, "unit": "runs", "doing": ""}
    assert parse('tpupod-progress {"done": "x", "total": 2}') is None
    assert parse("progress 1/2") is None


def test_rate_and_eta_on_the_launchers_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("tpupod.fanout.progress.time.monotonic", lambda: clock[0])
    view = PodProgress("x", [W(0)], None, tty=False)
    view(W(0), out(marker(0, 10, "samples")))
    clock[0] = 102.0
    view(W(0), out(marker(4, 10, "samples")))
    host = view.hosts[0]
    assert host.rate(102.0) == 2.0 and host.eta(102.0) == 3.0
    assert host.eta(103.0) == 2.0  # no marker since: the time passed counts
    clock[0] = 105.0
    view(W(0), out(marker(10, 10, "samples")))
    assert host.rate(500.0) == 2.0 and host.eta(500.0) == 0.0  # done: its rate stays
    assert view.summary(105.0) == "x: 10/10 samples, 5s elapsed, ETA 0s"


def test_an_extraction_host_marks_each_count_once_the_last_after_its_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CI: a log had '[w0] progress: 304/304 samples' twice, the step's tick at the last
    sample and the end's line (with the bytes written since): the end says the last count."""
    from tpupod.extract.progress import Progress

    monkeypatch.setenv("TPUPOD_PROGRESS_S", "0")  # a marker at every step
    marks: list[str] = []
    progress = Progress(0, 6, None, marks.append)
    for _ in range(3):
        progress.step(2, 10)
    progress.written(4_000_000)
    progress.finish()
    counts = [fields["done"] for fields in map(parse, marks) if fields is not None]
    assert counts == [0, 2, 4, 6], marks
    assert "4.0 MB written" in marks[-1], marks[-1]
