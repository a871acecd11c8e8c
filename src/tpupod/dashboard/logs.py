"""A run's logs for its page: each worker's tail first, read back from the end of its file,
then what is written, a batch per pass; a batch's id (every worker's offset) lets a
reconnecting browser go on where it was.

A page used to get every line from the start, one event each: a run of 4 workers x 100,000
lines (21 MB) was incomplete after 120 s and cost the dashboard 57 s of CPU per viewer,
though the page keeps 500 lines a worker. ``tpupod logs`` and the download have them all.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tpupod.launch.records import EndWatch, RunRecord

TAIL_LINES = 500  # what a page keeps of each worker's log
TAIL_TOTAL = 50_000  # and of all of them: 256 workers get 195 lines each
TAIL_BYTES = 1 << 20  # read back at most this much of a log for its tail
CATCH_UP_BYTES = 1 << 20  # a browser further behind than this starts again at the tail
# a followed run's logs are read again this often: a pass over 256 workers' logs costs
# about 5 ms of CPU, so 0.1 s took 5 % of a core per open run page; a line still shows
# within a second
POLL_S = 0.25


@dataclass
class Batch:
    """What one pass found: (worker, line) pairs in order; the workers whose pane starts
    over (the browser was too far behind: their tail follows); the id to resume after."""

    lines: list[tuple[int, str]] = field(default_factory=list)
    reset: list[int] = field(default_factory=list)
    cursor: str = ""


def tail_lines(workers: int) -> int:
    return max(1, min(TAIL_LINES, TAIL_TOTAL // max(1, workers)))


def tail_start(path: Path, lines: int) -> int:
    """The offset of the first of the last ``lines`` whole lines of ``path`` (read back
    from its end, ``TAIL_BYTES`` at most: a line cut there is left out)."""
    try:
        with path.open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            start = max(0, size - TAIL_BYTES)
            file.seek(start)
            data = file.read(size - start)
    except FileNotFoundError:
        return 0
    end = data.rfind(b"\n") + 1  # the last whole line's end (a line being written waits)
    cut = end - 1  # the newline before the tail's first line, found from the end
    for _ in range(lines):
        cut = data.rfind(b"\n", 0, cut)
        if cut < 0:
            break
    if cut < 0:  # fewer lines than asked: all of them, but for one cut by TAIL_BYTES
        return start if start == 0 else start + data.find(b"\n") + 1
    return start + cut + 1


def encode(offsets: dict[int, int]) -> str:
    return ".".join(str(offsets[w]) for w in sorted(offsets))


def decode(cursor: str | None, workers: list[int]) -> dict[int, int] | None:
    """A batch's id back into offsets; None for none, or one not of this run."""
    if not cursor:
        return None
    parts = cursor.split(".")
    if len(parts) != len(workers) or not all(p.isdigit() for p in parts):
        return None
    return dict(zip(workers, map(int, parts), strict=True))


class RunLogs:
    """Every worker's log of a run from its tail (or from ``cursor``), until the run has
    ended and all is read, or ``stop`` is set (the viewer left)."""

    def __init__(self, record: RunRecord, cursor: str | None = None) -> None:
        self.record = record
        self.workers = [w.id for w in record.workers]
        self.paths = {w: record.log_file(w) for w in self.workers}
        self.keep = tail_lines(len(self.workers))
        resumed = decode(cursor, self.workers)
        self.offsets = resumed or {w: tail_start(p, self.keep) for w, p in self.paths.items()}
        self.resumed = resumed is not None

    def batches(self, stop: threading.Event, poll_s: float = POLL_S) -> Iterator[Batch]:
        ended = EndWatch(self.record)
        first = True
        while True:
            last = ended()  # ended before this pass: it reads all there is, and it is the last
            batch = self._pass(last=last, first=first)
            if batch.lines or batch.reset or first:
                yield batch
            first = False
            if last or stop.wait(poll_s):
                return

    def _pass(self, *, last: bool, first: bool) -> Batch:
        batch = Batch()
        for worker, path in self.paths.items():
            size = _size(path)
            offset = self.offsets[worker]
            if size is None or (size == offset and not last):
                continue
            if size < offset or size - offset > CATCH_UP_BYTES:  # replaced, or far behind
                offset = tail_start(path, self.keep)
                if self.resumed or not first:
                    batch.reset.append(worker)
            lines, self.offsets[worker] = _read(path, offset, last)
            batch.lines += ((worker, line) for line in lines)
        batch.cursor = encode(self.offsets)
        return batch


def _size(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def _read(path: Path, offset: int, last: bool) -> tuple[list[str], int]:
    """Whole lines from ``offset`` (and, on the ``last`` pass, a final partial one); the
    offset after them."""
    with path.open("rb") as file:
        file.seek(offset)
        data = file.read(CATCH_UP_BYTES + TAIL_BYTES)
    end = len(data) if last else data.rfind(b"\n") + 1
    return data[:end].decode("utf-8", errors="replace").splitlines(), offset + end
