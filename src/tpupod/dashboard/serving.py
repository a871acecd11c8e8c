"""The serving fleets for the dashboard: `tpupod serve status`'s own call (``Fleet.status``),
plus requests/s from two samples in a row."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from typing import Any

from tpupod.errors import ServeError, StateError
from tpupod.pod.state import StateDir
from tpupod.serve.fleet.control import Fleet
from tpupod.serve.fleet.status import FleetStatus

WINDOW = 3  # sampling intervals a backend's requests/s is taken over


class Serving:
    """Every pod's fleet; keeps each backend's last request count for the rate."""

    def __init__(self) -> None:
        # address -> its last (time, requests) samples: the rate spans WINDOW intervals, so
        # how long one status call took (seconds on a busy pod) moves it less
        self.last: dict[str, deque[tuple[float, int]]] = {}

    async def sample(self, state: StateDir) -> list[dict[str, Any]]:
        found = await asyncio.gather(*(self._one(state, name) for name in state.names()))
        return [self._view(status, at) for status, at in filter(None, found)]

    async def _one(self, state: StateDir, name: str) -> tuple[FleetStatus, float] | None:
        """The fleet's status and when the router read its counts (the rate's clock: the
        end of the whole status, which waits on every agent, moved with the load and put
        a rate 10-30 % off on a loaded machine)."""
        try:
            fleet = Fleet(state.load(name), state)
            fleet.record()
        except (ServeError, StateError):  # no fleet serves here, or the pod's record is
            return None  # broken (the pods page names it): the other pods' fleets go on
        status = await asyncio.to_thread(fleet.status)
        return status, status.router_at if status.router_at is not None else time.time()

    def _view(self, status: FleetStatus, now: float) -> dict[str, Any]:
        record = status.record
        return {
            "pod": record.pod,
            "model": record.model,
            "router": f"down: {status.router_error}" if status.router_error else "up",
            "router_restarts": status.router_restarts,  # as serve status counts them
            "healthy": status.healthy,
            "endpoint": record.base_url,
            "backends": [self._rated(dataclasses.asdict(s), now) for s in status.servers],
        }

    def _rated(self, row: dict[str, Any], now: float) -> dict[str, Any]:
        requests = row.get("requests")
        rate = None
        if isinstance(requests, int):
            seen = self.last.setdefault(row["address"], deque(maxlen=WINDOW + 1))
            seen.append((now, requests))
            (t0, c0), (t1, c1) = seen[0], seen[-1]
            if t1 > t0:
                rate = max(0, c1 - c0) / (t1 - t0)
        return {**row, "requests_per_s": rate}


def restart(state: StateDir, pod: str, worker: int, port: int) -> list[str]:
    """Restart the server on ``port`` of ``worker`` as ``tpupod serve restart -w W --port P``
    does; what was restarted (``w0:NAME``)."""
    return Fleet(state.load(pod), state).restart(workers=str(worker), port=port)


LOG_LINES = 200  # of a backend's log on its page


def log_tail(state: StateDir, pod: str, worker: int, port: int) -> list[str]:
    """The last lines of the log of the server on ``port`` of ``worker``, as
    ``tpupod serve logs -w W --port P`` prints them."""
    found: list[str] = []
    fleet = Fleet(state.load(pod), state)
    fleet.logs(lambda w, line: found.append(line.text), str(worker), port, lines=LOG_LINES)
    return found
