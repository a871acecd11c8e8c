"""Split a byte stream into text lines, the same way for every transport."""

from __future__ import annotations

from tpupod.plain import TYPE_CHECKING
from tpupod.transport.base import OutputLine, Stream

if TYPE_CHECKING:  # typing is not imported at run time: the local fast path imports this
    from collections.abc import AsyncIterator
    from typing import Protocol

    class ByteReader(Protocol):
        async def read(self, n: int = -1) -> bytes: ...


MAX_LINE_BYTES = 64 * 1024
READ_CHUNK = 64 * 1024
QUEUE_LINES = 1024


class LineSplitter:
    """Feed bytes, get complete lines back (without the newline).

    Bytes are decoded as UTF-8 with replacement, a trailing ``\\r`` is dropped,
    and a line longer than ``MAX_LINE_BYTES`` is cut into pieces rather than
    held forever, so a program that prints a progress bar without newlines
    cannot make tpupod buffer without bound.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._buffer = bytearray()
        self._max_line = max_line

    def feed(self, data: bytes) -> list[str]:
        self._buffer += data
        lines: list[str] = []
        while True:
            cut = self._buffer.find(b"\n")
            if cut < 0:
                if len(self._buffer) < self._max_line:
                    return lines
                cut = self._max_line
                piece, rest = self._buffer[:cut], self._buffer[cut:]
            else:
                piece, rest = self._buffer[:cut], self._buffer[cut + 1 :]
            lines.append(_decode(piece))
            self._buffer = rest

    def finish(self) -> list[str]:
        """The last line, if the stream ended without a newline."""
        if not self._buffer:
            return []
        last = _decode(self._buffer)
        self._buffer = bytearray()
        return [last]


def _decode(data: bytes | bytearray) -> str:
    text = bytes(data).decode("utf-8", errors="replace")
    return text[:-1] if text.endswith("\r") else text


async def read_lines(streams: list[tuple[Stream, ByteReader]]) -> AsyncIterator[OutputLine]:
    """Lines from several streams, each in its own order, as they arrive; ends when all close.

    A read that fails with OSError ends that stream like an EOF: the process's
    exit status, not its pipes, says how it ended.
    """
    import asyncio  # here: the splitter serves exec's event-loop-free fast path too

    # Bounded, so a command that floods its output waits for us instead of filling memory.
    queue: asyncio.Queue[OutputLine | None] = asyncio.Queue(maxsize=QUEUE_LINES)

    async def pump(stream: Stream, reader: ByteReader) -> None:
        splitter = LineSplitter()
        try:
            while chunk := await reader.read(READ_CHUNK):
                for text in splitter.feed(chunk):
                    await queue.put(OutputLine(stream, text))
                await asyncio.sleep(0)  # let other workers' output through between chunks
        except OSError:
            pass
        for text in splitter.finish():
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
