"""Split a byte stream into text lines, the same way for every transport."""

from __future__ import annotations

import time

from tpupod.base.plain import TYPE_CHECKING
from tpupod.transport.base import OutputLine, Stream

if TYPE_CHECKING:  # typing is not imported at run time: the local fast path imports this
    from collections.abc import AsyncIterator, Callable
    from typing import Protocol

    class ByteReader(Protocol):
        async def read(self, n: int = -1) -> bytes: ...


MAX_LINE_BYTES = 64 * 1024
READ_CHUNK = 64 * 1024
QUEUE_LINES = 1024
PROGRESS_EVERY_S = 1.0  # a progress bar's state shown at most this often per stream


class LineSplitter:
    """Feed bytes, get complete lines back (without the newline).

    Bytes are decoded as UTF-8 with replacement and ``\r\n`` ends a line as
    ``\n`` does. A line longer than ``MAX_LINE_BYTES`` is cut into pieces (at a
    character's edge) rather than held forever.

    A bare ``\r`` is how progress bars redraw their line (tqdm, pip, downloads):
    the text after it is what a terminal shows now. That state is a line too, at
    most every ``PROGRESS_EVERY_S`` (the first at once; states between are
    skipped, a repeat is not shown twice), so a bar streams back as it moves
    instead of arriving whole when its newline comes, as one line of every state.
    A state held back by the interval gives way to the next one; one that stands
    (the bar stopped moving) is shown by :meth:`due` once its interval is up, so a
    reader that calls it when :meth:`due_in` says shows where a stuck bar stands.
    """

    def __init__(
        self,
        max_line: int = MAX_LINE_BYTES,
        progress_every: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._buffer = bytearray()
        self._max_line = max_line
        self._every = progress_every
        self._clock = clock or time.monotonic
        self._redrawn = False  # the buffer's text came after a bare \r: a bar's state
        self._state: bytes | None = None  # the latest complete state not yet shown
        self._shown: bytes | None = None  # the state shown last (not again)
        self._shown_at = float("-inf")

    def feed(self, data: bytes) -> list[str]:
        self._buffer += data
        lines: list[str] = []
        buffer = self._buffer
        start = 0
        newline = buffer.find(b"\n")
        while True:
            if 0 <= newline < start:  # found once per line, not once per redraw
                newline = buffer.find(b"\n", start)
            limit = newline if newline >= 0 else len(buffer)
            cr = buffer.find(b"\r", start, limit)
            if cr >= 0 and cr + 1 == len(buffer):
                break  # \r\n or a redraw: the next byte says which
            if cr >= 0 and buffer[cr + 1] != 0x0A:  # a redraw, and maybe more before the limit
                last = buffer.rfind(b"\r", cr, limit)
                if last == limit - 1:  # a \r\n's, or one that waits for its next byte
                    last = buffer.rfind(b"\r", cr, last)
                before = buffer.rfind(b"\r", start, last)  # states between: skipped unread
                self._redraw(bytes(buffer[before + 1 if before >= 0 else start : last]))
                start = last + 1
                continue
            if newline >= 0:
                self._line(bytes(buffer[start : cr if cr >= 0 else newline]), lines)
                start = newline + 1
                continue
            if len(buffer) - start >= self._max_line:
                cut = _char_edge(buffer, start + self._max_line)
                self._line(bytes(buffer[start:cut]), lines)
                start = cut
                continue
            break
        del buffer[:start]
        if self._redrawn and buffer.strip() and buffer[-1:] != b"\r":
            self._state = bytes(buffer)  # a bar mid-line: what the terminal shows now
        self._show_if_due(lines)
        return lines

    def due_in(self) -> float | None:
        """Seconds until a held-back state is due (0: now); None when none is held."""
        if self._state is None or self._state == self._shown:
            return None
        return max(0.0, self._shown_at + self._every - self._clock())

    def due(self) -> list[str]:
        """A held-back bar state whose interval is up (the bar stopped moving), if any."""
        lines: list[str] = []
        self._show_if_due(lines)
        return lines

    def finish(self) -> list[str]:
        """The last line, if the stream ended without a newline."""
        lines: list[str] = []
        last = bytes(self._buffer).removesuffix(b"\r")
        self._buffer = bytearray()
        if last:
            self._line(last, lines)
        elif self._state is not None and self._state != self._shown:
            lines.append(_decode(self._state))
        self._state = None
        return lines

    def _redraw(self, state: bytes) -> None:
        self._redrawn = True
        if state.strip():  # not the empty text before a bar's first \r, nor a wipe
            self._state = state

    def _line(self, text: bytes, lines: list[str]) -> None:
        """A line ended by a newline; the bar it ends was shown already if it was its state."""
        if not (self._redrawn and text == self._shown):
            lines.append(_decode(text))
        self._redrawn, self._state, self._shown = False, None, None

    def _show_if_due(self, lines: list[str]) -> None:
        state = self._state
        if state is None or state == self._shown:
            return
        now = self._clock()
        if now - self._shown_at >= self._every:
            lines.append(_decode(state))
            self._shown, self._shown_at, self._state = state, now, None


def _char_edge(buffer: bytearray, cut: int) -> int:
    """``cut``, or the start of the UTF-8 character that a cut there would split."""
    for back in range(1, 4):
        byte = buffer[cut - back]
        if byte & 0xC0 != 0x80:  # the first byte of the character before the cut
            size = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return cut - back if back < size else cut
    return cut


def _decode(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", errors="replace")


async def read_lines(streams: list[tuple[Stream, ByteReader]]) -> AsyncIterator[OutputLine]:
    """Lines from several streams, each in its own order, as they arrive; ends when all close.

    A read that fails with OSError ends that stream like an EOF: the process's
    exit status, not its pipes, says how it ended.
    """
    import asyncio  # here: the splitter serves exec's event-loop-free fast path too

    # Bounded, so a command that floods its output waits for us instead of filling memory.
    queue: asyncio.Queue[OutputLine | None] = asyncio.Queue(maxsize=QUEUE_LINES)

    async def pump(stream: Stream, reader: ByteReader) -> None:
        async for text in split_lines(reader):
            await queue.put(OutputLine(stream, text))
        await queue.put(None)

    tasks = [asyncio.create_task(pump(stream, reader)) for stream, reader in streams]
    open_streams = len(tasks)
    try:
        while open_streams:
            item = await queue.get()
            if item is None:
                open_streams -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def split_lines(reader: ByteReader) -> AsyncIterator[str]:
    """The lines of one stream as its chunks arrive, and a stuck bar's state once it is
    due (the read waits no longer than that). A read that fails with OSError ends it."""
    # here: the splitter serves exec's event-loop-free fast path too
    import asyncio

    splitter = LineSplitter()
    try:
        while True:
            wait = splitter.due_in()
            try:
                chunk = await asyncio.wait_for(reader.read(READ_CHUNK), wait)
            except TimeoutError:  # a bar stopped moving: where it stands
                for text in splitter.due():
                    yield text
                continue
            if not chunk:
                break
            for text in splitter.feed(chunk):
                yield text
            await asyncio.sleep(0)  # let other workers' output through between chunks
    except OSError:
        pass
    for text in splitter.finish():
        yield text
