"""The rendezvous service of one launch: registration, named barriers, a small value exchange.

``tpupod run`` starts it and tells every worker where it is and the launch's
token. Protocol: one TCP connection per worker process, one JSON object per
line. The first message registers (token, launch id, worker id, hostname,
pid, a digest of what the worker will run); then each request gets one reply:

* ``{"op": "barrier", "name": N, "timeout": S}`` -> ``{"ok": true}`` once all
  ``count`` workers arrived, or ``{"error": "timeout", "arrived": [...],
  "missing": [...]}``;
* ``{"op": "exchange", "name": N, "value": V, "timeout": S}`` -> every
  worker's value, ``{"values": {"0": V0, ...}}``;
* ``{"op": "exit", "code": C, "reason": R}`` -> ``{"ok": true}``: the worker is
  leaving (see ``exits.py``); a code other than 0 or null is a failure, passed
  to ``on_failure`` at once, before the process is gone.

The service may also send a worker ``{"op": "stop", "reason": R}`` at any
time (:meth:`RendezvousServer.stop`); the worker leaves when it reads it.
A worker whose connection closes without an ``exit`` vanished (killed,
``os._exit``): ``on_failure(worker, None, None)`` says so at once. That is not a
failure by itself (``os._exit(0)`` vanishes too), but it is the earliest sign
of a death: when another worker then fails, most likely because of it (JAX
aborts when its coordinator dies; a collective with a dead peer fails), the
supervisor can blame the one that vanished first.

A worker with another launch id, a bad token or a worker id already taken is
refused with a reason; the launcher hears of it too (``on_event``). If the
registered workers report different digests, every barrier fails, naming
the workers that differ from the rest.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tpupod.base import limits

DEFAULT_TIMEOUT_S = 300.0
DIGEST_BARRIER = "__digests__"


@dataclass
class Member:
    worker: int
    hostname: str
    pid: int
    digest: str
    writer: asyncio.StreamWriter | None = None
    uses: Counter[str] = field(default_factory=Counter)  # how often it used each name
    leaving: bool = False  # it said it exits
    stopped: bool = False  # we told it to stop

    def key(self, kind: str, name: str) -> str:
        """The n-th use of a name is its own gathering, so a barrier can be passed again."""
        self.uses[kind + name] += 1
        return f"{kind}:{name}:{self.uses[kind + name]}"


@dataclass
class _Gathering:
    """Workers arriving at one named barrier (or exchange), and their values.

    The reply every worker gets is built and encoded once, by the last one to
    arrive, and the gathering is forgotten once every worker took it: a
    barrier costs O(count) in all, not O(count) per arrival, and the service
    keeps nothing per barrier passed.
    """

    values: dict[int, Any] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    reply: bytes = b""
    taken: int = 0  # how many workers took the reply


# on_failure(worker, reason, code): a failure it reported (and the exit code it gave, when
# it gave one), or reason None: it vanished without a word.
FailureHandler = Callable[[int, "str | None", "int | None"], None]


class RendezvousServer:
    def __init__(
        self,
        launch_id: str,
        token: str,
        count: int,
        on_event: Callable[[str], None] | None = None,
        on_failure: FailureHandler | None = None,
    ) -> None:
        self.launch_id = launch_id
        self.token = token
        self.count = count
        self.on_event = on_event or (lambda text: None)
        self.on_failure = on_failure or (lambda worker, reason, code: None)
        self.members: dict[int, Member] = {}
        self._gatherings: dict[str, _Gathering] = {}
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._emptied = asyncio.Event()  # set when the last connection's handler ends
        self._closing = False
        self._frozen = False

    async def start(self, host: str, port: int = 0) -> tuple[str, int]:
        short = limits.open_files(self.count)
        if short:
            self.on_event(f"warning: {short}")
        self._server = await asyncio.start_server(
            self._handle, host, port, backlog=max(4096, self.count)
        )
        address = self._server.sockets[0].getsockname()
        return str(address[0]), int(address[1])

    def stop(self, reason: str) -> None:
        """Tell every connected worker that is not already leaving to stop now."""
        for member in list(self.members.values()):
            if not member.leaving and not member.stopped and member.writer is not None:
                member.stopped = True
                _reply(member.writer, {"op": "stop", "reason": reason})

    @property
    def connections(self) -> int:
        """Worker connections open now (registered or not yet)."""
        return len(self._handlers)

    async def drained(self) -> None:
        """Return once no worker is connected (each left, or its process ended)."""
        while self._handlers:
            self._emptied.clear()
            await self._emptied.wait()

    async def close(self) -> None:
        """Stop listening and end every connection (its handler too: nothing left pending)."""
        self._closing = True
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        member = None
        try:
            member = self._register(json.loads(await reader.readline() or b"{}"))
            member.writer = writer
            _reply(writer, {"ok": True, "count": self.count})
            while line := await reader.readline():
                answer = await self._serve(member, json.loads(line))
                if not writer.is_closing():
                    writer.write(answer if isinstance(answer, bytes) else _encode(answer))
                await writer.drain()
        except _Refused as exc:
            _reply(writer, {"error": str(exc)})
            self.on_event(f"refused a worker: {exc}")
        except (ConnectionError, ValueError, asyncio.CancelledError):
            pass
        finally:
            if member is not None and self.members.get(member.worker) is member:
                del self.members[member.worker]
                if not (member.leaving or member.stopped or self._closing):
                    self.on_failure(member.worker, None, None)
            writer.close()
            if task is not None:
                self._handlers.discard(task)
            if not self._handlers:
                self._emptied.set()

    def _register(self, message: dict[str, Any]) -> Member:
        if not hmac.compare_digest(str(message.get("token", "")), self.token):
            raise _Refused("wrong rendezvous token (is this worker from another launch?)")
        worker = int(message.get("worker", -1))
        who = f"w{worker} ({message.get('hostname')}, pid {message.get('pid')})"
        if message.get("launch_id") != self.launch_id:
            raise _Refused(
                f"{who} has launch id {message.get('launch_id')}, this launch is {self.launch_id}: "
                "it was started by another 'tpupod run'"
            )
        if not 0 <= worker < self.count:
            raise _Refused(f"{who}: worker id out of range 0..{self.count - 1}")
        taken = self.members.get(worker)
        if taken is not None:
            raise _Refused(
                f"{who}: worker id {worker} is already taken by {taken.hostname} pid {taken.pid}"
            )
        member = Member(
            worker,
            str(message.get("hostname")),
            int(message.get("pid", 0)),
            str(message.get("digest", "")),
        )
        self.members[worker] = member
        if len(self.members) == self.count and not self._frozen:
            # Every connection is in: the collector need not re-scan thousands of
            # long-lived streams on each barrier (that grew faster than the clients).
            gc.freeze()
            self._frozen = True
        return member

    async def _serve(self, member: Member, request: dict[str, Any]) -> dict[str, Any] | bytes:
        op = request.get("op")
        name = str(request.get("name", ""))
        timeout = float(request.get("timeout", DEFAULT_TIMEOUT_S))
        if op == "barrier":
            return await self._gather(member.key("b", name), member, None, timeout)
        if op == "exit":
            return self._exit(member, request.get("code"), request.get("reason"))
        if op == "exchange":
            return await self._gather(member.key("x", name), member, request.get("value"), timeout)
        return {"error": f"unknown request {op!r}"}

    async def _gather(
        self, key: str, member: Member, value: Any, timeout: float
    ) -> dict[str, Any] | bytes:
        gathering = self._gatherings.setdefault(key, _Gathering())
        gathering.values[member.worker] = value
        if len(gathering.values) == self.count:
            gathering.reply = _encode(self._outcome(key, gathering.values))
            gathering.done.set()
        try:
            async with asyncio.timeout(timeout):  # a timer, not a task per waiter
                await gathering.done.wait()
        except TimeoutError:
            arrived = sorted(gathering.values)
            missing = [w for w in range(self.count) if w not in gathering.values]
            answer: dict[str, Any] | bytes = {
                "error": "timeout",
                "arrived": arrived,
                "missing": missing,
            }
        else:
            answer = gathering.reply
        gathering.taken += 1
        if gathering.taken == self.count:
            del self._gatherings[key]
        return answer

    def _outcome(self, key: str, values: dict[int, Any]) -> dict[str, Any]:
        """What every worker of a complete gathering hears: a barrier checks the digests too."""
        if key.startswith("b:"):
            return self._digest_check() or {"ok": True}
        return {"values": {str(k): v for k, v in values.items()}}

    def _exit(self, member: Member, code: Any, reason: Any) -> dict[str, Any]:
        member.leaving = True
        if code and not member.stopped:  # a failure of its own, not the end we asked for
            given = code if isinstance(code, int) else None
            self.on_failure(member.worker, str(reason) if reason else f"exit {code}", given)
        return {"ok": True}

    def _digest_check(self) -> dict[str, Any] | None:
        digests = {m.worker: m.digest for m in self.members.values()}
        common, _ = Counter(digests.values()).most_common(1)[0]
        odd = sorted(w for w, d in digests.items() if d != common)
        if not odd:
            return None
        hosts = ", ".join(f"w{w} ({self.members[w].hostname})" for w in odd)
        return {
            "error": "differ",
            "workers": odd,
            "message": f"{hosts} will run something different from the other workers "
            "(code, config or command): their digests differ",
        }


class _Refused(Exception):
    pass


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _reply(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    if not writer.is_closing():
        writer.write(_encode(message))


class AsyncMember:
    """A worker's side of the protocol in asyncio (tests and benchmarks run many in one process)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def join(
        cls, address: tuple[str, int], registration: dict[str, Any]
    ) -> tuple[AsyncMember, dict[str, Any]]:
        reader, writer = await asyncio.open_connection(*address)
        member = cls(reader, writer)
        return member, await member.request(registration)

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        self._writer.write(json.dumps(message).encode() + b"\n")
        await self._writer.drain()
        reply: dict[str, Any] = json.loads(await self._reader.readline() or b'{"error": "closed"}')
        return reply

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()
