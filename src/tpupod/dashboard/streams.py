"""Server-sent event streams that end when the server stops.

An open stream (every tab holds ``/api/events``, a run or job page its log's follow) kept
uvicorn's graceful shutdown waiting until the browser left: Ctrl-C did nothing, and a
second one cut the streams with tracebacks. ``Closing`` is set as the stop begins (from
the signal, server.py), and every stream made by ``sse`` ends then; the browser reconnects
to the next dashboard with the id of the last event it got (``Last-Event-ID``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
RETRY_MS = 2000  # how long a browser waits before it reconnects


class Closing:
    """Set once the server begins to stop: safe to set from a signal handler or a thread."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.event: asyncio.Event | None = None
        self.early = False  # set before the loop ran (a signal during start)

    def bind(self) -> None:
        """Called on the server's loop as it starts (the app's lifespan)."""
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        if self.early:
            self.event.set()

    def set(self) -> None:
        if self.loop is None or self.event is None:
            self.early = True
            return
        with contextlib.suppress(RuntimeError):  # the loop closed already
            self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self) -> None:
        if self.event is None:  # a test's app without a lifespan: never closing
            await asyncio.Future()
        assert self.event is not None
        await self.event.wait()


def sse(stream: AsyncIterator[str], closing: Closing) -> StreamingResponse:
    """``stream``'s events as a response that ends when the server begins to stop."""
    return StreamingResponse(
        until_closing(stream, closing), media_type="text/event-stream", headers=HEADERS
    )


async def until_closing(stream: AsyncIterator[str], closing: Closing) -> AsyncIterator[str]:
    """``stream``'s items until it ends or ``closing`` is set; ``stream`` is closed either
    way (its ``finally`` runs: a follow's thread stops)."""
    closed = asyncio.ensure_future(closing.wait())
    step: asyncio.Future[str] | None = None
    try:
        yield f"retry: {RETRY_MS}\n\n"
        while True:
            step = asyncio.ensure_future(anext(stream))
            await asyncio.wait({step, closed}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        closed.cancel()
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await step
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
