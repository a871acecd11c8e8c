"""The event loop under tpupod's HTTP servers (the router, the builtin server's front end),
and ``cancelled``, the one way a serving task stops another.

uvloop where it is installed (the serve extra brings it; ``TPUPOD_NO_UVLOOP=1`` keeps
asyncio's own). Measured on this project's 2-core VM (BENCHMARKS.md): the router serves
about 2x the requests/s on it, and the builtin server's front end spends less per streamed
token. Neither server starts subprocesses through asyncio, where uvloop's would differ."""

from __future__ import annotations

import asyncio

from tpupod import settings


def use_uvloop() -> None:
    """Make ``asyncio.run`` start uvloop's loop, where installed and not turned off."""
    if not settings.use_uvloop():
        return
    try:
        # optional (the serve extra's): asyncio's own loop without it
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def cancelled(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for its end, even when we are cancelled meanwhile (that cancel
    is raised after). A task left to unwind later, such as an HTTP request whose connection
    attempt is a task of its own, outlives its owner and is cut by the loop's shutdown."""
    task.cancel()
    interrupted = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            interrupted = True
    if interrupted:
        raise asyncio.CancelledError
