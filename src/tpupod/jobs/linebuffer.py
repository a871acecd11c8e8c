"""The lines a running attempt printed that the store does not have yet, oldest first.

While the database is up this holds a flush interval's lines. While it is down it holds
everything the job prints: in memory up to about ``memory_bytes`` (characters, plus a
little per line), then in a spill file on the runner's disk (an unnamed temporary file:
gone when the runner is), up to ``disk_bytes``.
Past that, lines are counted, not kept, and one marker line takes their place, saying how
many were dropped and when: the log shows the gap where it is.

The writer reads with ``peek`` and removes with ``consume`` only once the store has the
lines, so a failed write loses nothing and the next one starts from the same line.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from typing import IO

MEMORY_BYTES = 16 << 20
DISK_BYTES = 1 << 30

Line = tuple[int, str]  # (worker, text)


class LineBuffer:
    def __init__(self, memory_bytes: int = MEMORY_BYTES, disk_bytes: int = DISK_BYTES) -> None:
        self.memory_bytes, self.disk_bytes = memory_bytes, disk_bytes
        self._head: deque[Line] = deque()  # the oldest lines, in memory
        self._head_bytes = 0
        self._spill: IO[bytes] | None = None  # the lines after the head, in order
        self._read_at = self._write_at = 0
        self._peeked_ends: list[int] = []  # where each line the last peek read from disk ends
        self._dropped = 0
        self._dropped_from = 0.0
        self._dropped_worker = 0
        self.spilled_total = 0  # lines that went through the spill file
        self.dropped_total = 0

    def __len__(self) -> int:
        """Nonzero while anything (lines or a drop to report) waits to be written."""
        return len(self._head) + (self._write_at > self._read_at) + (self._dropped > 0)

    def add(self, worker: int, text: str) -> None:
        size = len(text) + 16
        if not self._fits_memory(size) and self._spill_size() + size > self.disk_bytes:
            if not self._dropped:
                self._dropped_from, self._dropped_worker = time.time(), worker
            self._dropped += 1
            self.dropped_total += 1
            return
        self._note_drops()
        self._store((worker, text), size)

    def peek(self, limit: int) -> list[Line]:
        """Up to ``limit`` of the oldest lines (a drop marker among them where it belongs);
        lines on disk are read, not moved: they stay there until ``consume``."""
        if not self._head and self._write_at == self._read_at:
            self._note_drops()  # nothing after the gap yet: the marker ends the buffer
        lines = [self._head[i] for i in range(min(limit, len(self._head)))]
        self._peeked_ends = []
        if len(lines) < limit and self._spill is not None and self._write_at > self._read_at:
            self._spill.seek(self._read_at)
            while len(lines) < limit and self._spill.tell() < self._write_at:
                worker, text = json.loads(self._spill.readline())
                lines.append((worker, text))
                self._peeked_ends.append(self._spill.tell())
        return lines

    def consume(self, count: int) -> None:
        """The oldest ``count`` lines (of the last ``peek``) are in the store now."""
        from_head = min(count, len(self._head))
        for _ in range(from_head):
            self._head_bytes -= len(self._head.popleft()[1]) + 16
        if count > from_head:
            self._read_at = self._peeked_ends[count - from_head - 1]
            if self._read_at >= self._write_at:  # all written: the file starts over
                assert self._spill is not None
                self._spill.truncate(0)
                self._read_at = self._write_at = 0

    def snapshot(self, batch: int) -> Iterator[list[Line]]:
        """Every line waiting (a drop marker where it belongs), in batches, oldest first,
        without removing any: what an ended attempt's journal keeps. Nothing may be added
        meanwhile (the attempt has ended)."""
        self._note_drops()
        head = list(self._head)
        for start in range(0, len(head), batch):
            yield head[start : start + batch]
        if self._spill is None or self._write_at == self._read_at:
            return
        at = self._read_at
        while at < self._write_at:
            self._spill.seek(at)
            lines: list[Line] = []
            while len(lines) < batch and self._spill.tell() < self._write_at:
                worker, text = json.loads(self._spill.readline())
                lines.append((worker, text))
            at = self._spill.tell()
            yield lines

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None

    def _spill_size(self) -> int:
        return self._write_at - self._read_at

    def _fits_memory(self, size: int) -> bool:
        """Only while nothing waits on disk: the order of lines is memory, then disk."""
        return self._write_at == self._read_at and self._head_bytes + size <= self.memory_bytes

    def _store(self, line: Line, size: int) -> None:
        if self._fits_memory(size):
            self._head.append(line)
            self._head_bytes += size
            return
        if self._spill is None:
            # kept open for the attempt's life; ``close`` (or the runner's exit) removes it
            self._spill = tempfile.TemporaryFile(prefix="tpupod-job-lines-")  # noqa: SIM115
        self._spill.seek(self._write_at)
        self._write_at += self._spill.write(json.dumps(line).encode() + b"\n")
        self.spilled_total += 1

    def _note_drops(self) -> None:
        if not self._dropped:
            return
        since = time.strftime("%H:%M:%S", time.gmtime(self._dropped_from))
        until = time.strftime("%H:%M:%S", time.gmtime())
        marker = (
            f"[tpupod] {self._dropped} line{'s' if self._dropped != 1 else ''} dropped here "
            f"({since} to {until} UTC): the job "
            f"store was away and the runner's buffer ({_size(self.memory_bytes)} in memory, "
            f"{_size(self.disk_bytes)} on disk) was full"
        )
        self._dropped = 0
        self._store((self._dropped_worker, marker), len(marker) + 16)


def _size(count: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):g} {unit}"
    return f"{count} bytes"
