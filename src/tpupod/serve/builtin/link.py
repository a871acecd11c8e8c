"""The link between the builtin server's front end and its engine process.

One Unix socket per engine (``engine-PORT.sock`` in a private folder); the
engine process listens, its front end connects. Frames are a 4-byte length
and a pickle (both ends are this package, and the folder is the owner's
alone: mode 0700). Front end to engine::

    ("s", rid, prompt ids, SamplingParams)     submit
    ("c", rid)                                 cancel (the client went away)

Engine to front end: first ``("h", info)`` (the engine's limits and its
tokenizer), then one frame per engine turn, ``("e", running, waiting,
events)`` with each event as ``(rid, 0, token ids)`` (Tokens), ``(rid, 1,
reason, prompt_tokens, completion_tokens)`` (Finished) or ``(rid, 2,
message)`` (Failed). A turn's events go out as one frame, sent from the
engine's thread, so a stream's first token leaves with the turn that made
it. The front end makes the text (``text.py``): a stop string it reads
comes back as a cancel.

The engine keeps its state (compiled programs, KV cache) when its front end
goes: the requests of that front end are cancelled, and the next front end
to connect is served. The front end (:class:`RemoteEngine`) keeps its ports
when the engine goes: every request in flight fails with the reason, and new
ones get it (503) until an engine connects again.

An engine that stays but stops making progress (a hung device call, a
deadlock, a stopped process) is found by its silence: while requests are in
flight a frame comes every turn, so after ``stall_s`` seconds without one the
front end fails them with the reason and kills the engine process (its pid
came in the first frame); the keeper restarts it as it does any killed child.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pickle
import signal
import socket
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpupod.serve.builtin.events import (
    EngineStopped,
    Event,
    Failed,
    Finished,
    RequestRejected,
    SamplingParams,
    Sink,
    Tokens,
    check_request,
    stalled_message,
)

if TYPE_CHECKING:  # the front end never imports the engine (JAX): only the engine side has one
    from tpupod.serve.builtin.engine import Engine
    from tpupod.serve.builtin.engine import Request as EngineRequest

HEADER = struct.Struct("!I")
ENGINE_DOWN = "the engine process is not running (it exited); it is being restarted: retry shortly"


def socket_path(folder: Path, port: int) -> Path:
    return folder / f"engine-{port}.sock"


def pack(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def encode(rid: int, event: Event) -> tuple[Any, ...]:
    if isinstance(event, Tokens):
        return (rid, 0, event.ids)
    if isinstance(event, Finished):
        return (rid, 1, event.reason, event.prompt_tokens, event.completion_tokens)
    assert isinstance(event, Failed), event  # the engine makes no Delta (text.py does)
    return (rid, 2, event.message)


def decode(item: tuple[Any, ...]) -> tuple[int, Event]:
    rid, kind, *rest = item
    if kind == 0:
        return rid, Tokens(rest[0])
    if kind == 1:
        return rid, Finished(rest[0], rest[1], rest[2])
    return rid, Failed(rest[0])


# ---- the engine's side -------------------------------------------------------------


class _RemoteSink:
    """A request's sink in the engine: its events go to the front end that sent it."""

    def __init__(self, link: _Link, rid: int) -> None:
        self.link, self.rid = link, rid
        self.request: EngineRequest | None = None

    def __call__(self, event: Event) -> None:  # one event outside a turn (not batched)
        self.link.send([(self, event)])


class _Link:
    """One front end's connection, as the engine sees it."""

    def __init__(self, host: EngineHost, conn: socket.socket) -> None:
        self.host, self.conn = host, conn
        self.sinks: dict[int, _RemoteSink] = {}
        self.lock = threading.Lock()
        self.alive = True

    def send(self, events: Sequence[tuple[Sink, Event]]) -> None:
        items = []
        for sink, event in events:
            assert isinstance(sink, _RemoteSink)
            if not isinstance(event, Tokens):
                self.sinks.pop(sink.rid, None)
            items.append(encode(sink.rid, event))
        frame = pack(("e", self.host.engine.running, self.host.engine.waiting, items))
        with self.lock:
            if not self.alive:
                return
            try:
                self.conn.sendall(frame)
            except OSError:
                self.alive = False

    def serve(self) -> None:
        """Read the front end's submits and cancels until it goes; then cancel its requests."""
        engine = self.host.engine
        try:
            with self.conn.makefile("rb") as reader:
                while message := _read(reader):
                    if message[0] == "s":
                        _, rid, prompt, params = message
                        self._submit(engine, rid, prompt, params)
                    elif (sink := self.sinks.get(message[1])) and sink.request:
                        sink.request.cancel()
        except OSError:
            pass
        finally:
            self.alive = False
            self.host.links.discard(self)
            for sink in list(self.sinks.values()):
                if sink.request is not None:
                    sink.request.cancel()
            self.sinks.clear()
            with contextlib.suppress(OSError):
                self.conn.close()

    def _submit(self, engine: Engine, rid: int, prompt: list[int], params: SamplingParams) -> None:
        sink = self.sinks[rid] = _RemoteSink(self, rid)
        try:
            sink.request = engine.submit(prompt, params, sink)
        except (RequestRejected, EngineStopped) as exc:
            sink(Failed(exc.message))


def _read(reader: Any) -> Any:
    head = reader.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    body = reader.read(size)
    return pickle.loads(body) if len(body) == size else None


class EngineHost:
    """Serves one engine to the front end connected to ``path`` (the newest one)."""

    def __init__(self, engine: Engine, path: Path) -> None:
        self.engine = engine
        self.path = path
        engine.dispatch = self.dispatch
        self.links: set[_Link] = set()  # the front ends connected now
        self.info = {
            "max_length": engine.max_length,
            "max_batch": engine.max_batch,
            "vocab_size": engine.model.config.vocab_size,
            "tokenizer": engine.tokenizer,
            "pid": os.getpid(),  # for the front end to kill it when it stalls
        }
        # bound under a temporary name, then renamed: the path appears once it answers
        temporary = path.with_name(path.name + ".new")
        temporary.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(temporary))
        self.listener.listen(4)
        os.replace(temporary, path)

    def dispatch(self, events: list[tuple[Sink, Event]]) -> None:
        """The engine's ``dispatch``: a turn's events, one frame per front end (a turn
        without events: the running and waiting counts to every front end)."""
        if not events:
            for link in list(self.links):
                link.send([])
            return
        by_link: dict[int, tuple[_Link, list[tuple[Sink, Event]]]] = {}
        for sink, event in events:
            if isinstance(sink, _RemoteSink):
                by_link.setdefault(id(sink.link), (sink.link, []))[1].append((sink, event))
        for link, mine in by_link.values():
            link.send(mine)

    def start(self, name: str) -> None:
        threading.Thread(target=self._accept, name=f"{name}-link", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            link = _Link(self, conn)
            try:
                conn.sendall(pack(("h", self.info)))
            except OSError:
                conn.close()
                continue
            self.links.add(link)
            threading.Thread(target=link.serve, name="engine-link", daemon=True).start()


# ---- the front end's side ---------------------------------------------------------------


class RemoteRequest:
    """A request submitted through the link (what :meth:`Engine.submit` returns, remotely)."""

    def __init__(self, engine: RemoteEngine, rid: int) -> None:
        self.engine, self.rid = engine, rid

    def cancel(self) -> None:
        self.engine._cancel(self.rid)


class RemoteEngine:
    """The engine behind a link, as the OpenAI app uses it (``check``, ``submit``, limits,
    ``running``/``waiting``); ``down`` says why it takes nothing now (None: it does)."""

    def __init__(self, path: Path, stall_s: float = 0.0) -> None:
        self.path = path
        self.stall_s = stall_s  # 0: never
        self.heard = time.monotonic()  # the last frame, or the first submit after a quiet time
        self.down: str | None = "the engine is starting"
        self.tokenizer: Any = None
        self.max_length = self.max_batch = self.vocab_size = 0
        self.running = self.waiting = 0
        self.connected = asyncio.Event()
        self._sinks: dict[int, Sink] = {}
        self._ids = itertools.count()
        self._writer: asyncio.StreamWriter | None = None
        self._closing = False

    def check(self, prompt: Sequence[int], max_tokens: int | None) -> int:
        if self.down is not None:
            raise EngineStopped(self.down)
        return check_request(prompt, max_tokens, self.max_length)

    def submit(self, prompt: Sequence[int], params: SamplingParams, sink: Sink) -> RemoteRequest:
        if self.down is not None or self._writer is None:
            raise EngineStopped(self.down or ENGINE_DOWN)
        rid = next(self._ids)
        if not self._sinks:  # the engine owed nothing until now: its silence counts from here
            self.heard = time.monotonic()
        self._sinks[rid] = sink
        self._writer.write(pack(("s", rid, list(map(int, prompt)), params)))
        return RemoteRequest(self, rid)

    def _cancel(self, rid: int) -> None:
        if self._sinks.pop(rid, None) is not None and self._writer is not None:
            self._writer.write(pack(("c", rid)))

    def shutdown(self, message: str) -> None:
        """Fail everything in flight with ``message`` and take no more (the server stops)."""
        self._closing = True
        self._fail(message)

    def _fail(self, message: str) -> None:
        self.down = message
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            with contextlib.suppress(Exception):
                sink(Failed(message))

    async def run(self) -> None:
        """Connect (again) whenever the engine is there; serve its events."""
        while not self._closing:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.path))
            except OSError:
                await asyncio.sleep(0.05)
                continue
            try:
                await self._serve(reader, writer)
            except (OSError, asyncio.IncompleteReadError, pickle.UnpicklingError):
                pass
            finally:
                self._writer = None
                writer.close()
            if not self._closing:
                self._fail(ENGINE_DOWN)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, info = await _read_async(reader)
        self.max_length, self.max_batch = info["max_length"], info["max_batch"]
        self.vocab_size, self.tokenizer = info["vocab_size"], info["tokenizer"]
        self._writer = writer
        self.down = None
        self.connected.set()
        watch = asyncio.create_task(self._watch(info["pid"])) if self.stall_s > 0 else None
        try:
            await self._events(reader)
        finally:
            if watch is not None:
                watch.cancel()

    async def _watch(self, pid: int) -> None:
        """Kill the engine once it owes events and has been silent for ``stall_s``."""
        while True:
            await asyncio.sleep(min(1.0, self.stall_s / 4))
            if self._sinks and time.monotonic() - self.heard > self.stall_s:
                self._fail(stalled_message(self.stall_s, len(self._sinks)))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                return

    async def _events(self, reader: asyncio.StreamReader) -> None:
        while True:
            _, self.running, self.waiting, items = await _read_async(reader)
            self.heard = time.monotonic()
            for item in items:
                rid, event = decode(item)
                ends = not isinstance(event, Tokens)
                sink = self._sinks.pop(rid, None) if ends else self._sinks.get(rid)
                if sink is not None:
                    with contextlib.suppress(Exception):
                        sink(event)


async def _read_async(reader: asyncio.StreamReader) -> Any:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))
