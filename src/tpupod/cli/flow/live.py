"""Running fan-outs from the CLI: output printed as it arrives, signals turn into a clean stop."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from tpupod.fanout.context import Interrupt, Sinks
from tpupod.fanout.report import LinePrinter, notice

if TYPE_CHECKING:
    from tpupod.fanout.results import WorkerLike

T = TypeVar("T")


def run_live(
    workers: Sequence[WorkerLike], quiet: bool, body: Callable[[Sinks], Awaitable[T]]
) -> T:
    """Run ``body`` in an event loop where SIGINT and SIGTERM stop every worker cleanly.

    Output lines are printed with their worker prefix unless ``quiet``; if our
    stdout goes away (``| head``), the run is stopped as by SIGPIPE.
    """

    async def go() -> T:
        interrupt = Interrupt()
        loop = asyncio.get_running_loop()
        handled = (signal.SIGINT, signal.SIGTERM)
        for signum in handled:
            loop.add_signal_handler(signum, interrupt.request, signum)
        printer = (
            None
            if quiet
            else LinePrinter(
                workers,
                sys.stdout,
                sys.stderr,
                on_broken_pipe=lambda: interrupt.request(signal.SIGPIPE),
            )
        )
        try:
            return await body(Sinks(printer, notice, interrupt))
        finally:
            for signum in handled:
                loop.remove_signal_handler(signum)

    return asyncio.run(go())
