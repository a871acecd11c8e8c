"""The event loop under tpupod's HTTP servers: the router and the builtin server's front end.

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
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
