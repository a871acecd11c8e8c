"""The side channel of a multi-host replica: its leader's step broadcast, with a deadline.

A replica served by K processes (one per worker of its group) runs every
device program in all K at once: JAX's multi-controller model. The leader
(rank 0) decides each step (the scheduler is its own); this channel carries
the step's inputs (the arrays the leader is about to put on the devices) to
the followers, which run the same jitted program on them.

Why a TCP side channel rather than JAX's own broadcast
(``multihost_utils.broadcast_one_to_all``): a JAX collective with a dead peer
blocks until gloo's or the coordinator's heartbeat timeout (about 100 s), and
nothing can bound it from outside. Here every follower holds one TCP
connection to its leader:

- a process that dies (even ``kill -9``) has its connection closed by the
  kernel, so the other end sees EOF at once;
- a process that stops (``SIGSTOP``, a hung host) stops acknowledging steps
  and stops its heartbeats, so the other end gives up after ``timeout`` s
  (``startup_timeout`` s until the first step: loading and compiling may
  starve a heartbeat thread of the GIL for seconds on a busy host);
- either way ``on_failure`` is called once (from the watching thread, while the
  engine's thread may be blocked inside a collective) and the caller takes the
  replica down.

Before anything runs, the same connection is the group's rendezvous: each
follower says who it is and the digests of its code and config; the leader
compares them with its own and either refuses (naming the odd worker) or
hands out the launch id and JAX's coordinator address.

Frames, leader -> follower: ``!II`` (header length, body length), a JSON
header ``{"seq", "kind", "arrays": [[dtype, shape], ...]}``, then the arrays'
bytes; ``kind`` ``"hb"`` is a heartbeat. Follower -> leader: ``!q`` records,
the sequence number of each step received, ``-1`` a heartbeat. The rendezvous
before them is one JSON line each way.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpupod.errors import ServeError

FRAME = struct.Struct("!II")
RECORD = struct.Struct("!q")
HEARTBEAT = -1
DEFAULT_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 120.0  # silence allowed before the first step (loading, compiling)

FailureHandler = Callable[[str], None]


class LockstepError(ServeError):
    """The group cannot form (a refusal, a rendezvous timeout) or lost a member."""


@dataclass(frozen=True)
class Hello:
    rank: int
    worker: int
    code: str
    config: str

    @property
    def label(self) -> str:
        return f"w{self.worker} (rank {self.rank})"


def _read_line(sock: socket.socket, deadline: float) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536 if not data else 1)
        except TimeoutError:
            raise LockstepError("the group's rendezvous timed out") from None
        if not chunk:
            raise LockstepError("the other end closed the connection during the rendezvous")
        data += chunk
    answer: dict[str, Any] = json.loads(data)
    return answer


def _send_line(sock: socket.socket, value: dict[str, Any]) -> None:
    sock.sendall(json.dumps(value).encode() + b"\n")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


class Leader:
    """The leader's end: the rendezvous, then the step broadcast and the watch."""

    def __init__(
        self,
        listener: socket.socket,
        followers: int,
        timeout: float,
        startup_timeout: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.listener = listener
        self.expected = followers
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.members: list[tuple[Hello, socket.socket]] = []
        self._send_lock = threading.Lock()
        self._seq = 0
        self._sent: dict[int, float] = {}  # seq -> when; acknowledged by every follower drops
        self._acked: dict[int, int] = {}  # rank -> last seq acknowledged
        self._heard: dict[int, float] = {}  # rank -> when last heard
        self._failed = threading.Event()
        self._on_failure: FailureHandler = lambda reason: None
        self._watch: threading.Thread | None = None

    # -- the rendezvous --------------------------------------------------------------
    def gather(self, own: Hello, wait: float) -> list[Hello]:
        """Accept every follower's hello; refuse them all if any differs from ``own``."""
        deadline = time.monotonic() + wait
        self.listener.settimeout(0.2)
        while len(self.members) < self.expected:
            if time.monotonic() > deadline:
                have = ", ".join(h.label for h, _ in self.members) or "none"
                self._refuse_all("the group did not form in time")
                raise LockstepError(
                    f"{len(self.members)} of {self.expected} followers joined in {wait:g}s "
                    f"(joined: {have})",
                    hint="is every worker of the group running its member?",
                )
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            try:
                hello = Hello(**_read_line(conn, deadline))
            except (LockstepError, TypeError, ValueError, OSError):
                conn.close()
                continue
            self.members = [(h, s) for h, s in self.members if h.rank != hello.rank]
            self.members.append((hello, conn))
        odd = [h for h, _ in self.members if (h.code, h.config) != (own.code, own.config)]
        if odd:
            parts = []
            for h in odd:
                what = [n for n, a, b in (("code", h.code, own.code), ("config", h.config, own.config)) if a != b]  # fmt: skip  # noqa: E501
                parts.append(f"{h.label} runs a different {' and '.join(what)}")
            message = f"the group's workers differ from its leader w{own.worker}: " + "; ".join(
                parts
            )
            self._refuse_all(message)
            raise LockstepError(
                message,
                hint="every worker of a replica must run the same tpupod and the same "
                "serve options (sync the code, then 'tpupod serve restart')",
            )
        self.members.sort(key=lambda m: m[0].rank)
        return [h for h, _ in self.members]

    def _refuse_all(self, message: str) -> None:
        for _, conn in self.members:
            with contextlib.suppress(OSError):
                _send_line(conn, {"refused": message})
            conn.close()
        self.members = []

    def welcome(self, launch_id: str, coordinator: str) -> None:
        for _, conn in self.members:
            _send_line(conn, {"launch_id": launch_id, "coordinator": coordinator})

    # -- the watch -------------------------------------------------------------------
    def watch(self, on_failure: FailureHandler) -> None:
        """Start watching the followers (heartbeats both ways, acknowledgements, EOF)."""
        self._on_failure = on_failure
        now = time.monotonic()
        for hello, conn in self.members:
            conn.settimeout(self.timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._heard[hello.rank] = now
            self._acked[hello.rank] = -1
        self._watch = threading.Thread(target=self._watching, name="lockstep-watch", daemon=True)
        self._watch.start()

    def set_failure_handler(self, on_failure: FailureHandler) -> None:
        self._on_failure = on_failure

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    def wait_failed(self, timeout: float) -> bool:
        """Whether the group fails (or has failed) within ``timeout`` seconds."""
        return self._failed.wait(timeout)

    def _fail(self, reason: str) -> None:
        if self._failed.is_set():
            return
        self._failed.set()
        self._on_failure(reason)

    def _receive(self, conn: socket.socket, hello: Hello) -> bytes | None:
        """What a follower sent; None once it is gone (the group has failed)."""
        try:
            chunk = conn.recv(4096)
        except ConnectionResetError:
            # killed with our steps unread in its buffer, a member's end closes with a
            # reset, not an EOF (likelier under CPU load): it went away all the same
            self._fail(f"{hello.label} went away (its connection was reset)")
            return None
        except OSError as exc:
            self._fail(f"{hello.label}'s connection failed: {exc}")
            return None
        if not chunk:
            self._fail(f"{hello.label} went away (its connection closed)")
            return None
        return chunk

    def _watching(self) -> None:
        selector = selectors.DefaultSelector()
        buffers: dict[int, bytes] = {}
        for hello, conn in self.members:
            selector.register(conn, selectors.EVENT_READ, hello)
            buffers[hello.rank] = b""
        beat = self.timeout / 5
        next_beat = time.monotonic()
        while not self._failed.is_set():
            for key, _ in selector.select(timeout=min(beat, 0.1)):
                hello = key.data
                chunk = self._receive(key.fileobj, hello)  # type: ignore[arg-type]
                if chunk is None:
                    return
                data = buffers[hello.rank] + chunk
                usable = len(data) - len(data) % RECORD.size
                for (seq,) in RECORD.iter_unpack(data[:usable]):
                    if seq != HEARTBEAT:
                        self._acked[hello.rank] = seq
                buffers[hello.rank] = data[usable:]
                self._heard[hello.rank] = time.monotonic()
            now = time.monotonic()
            for hello, _ in self.members:
                # until a member has taken a step it may be loading and compiling, its
                # heartbeat thread starved of the GIL: only EOF or the startup limit count
                limit = self.timeout if self._acked[hello.rank] > 0 else self.startup_timeout
                if now - self._heard[hello.rank] > limit:
                    self._fail(f"{hello.label} was silent for {limit:g}s")
                    return
            with self._send_lock:
                low = min(self._acked.values(), default=self._seq)
                late = [t for s, t in self._sent.items() if s > low]
                for s in [s for s in self._sent if s <= low]:
                    del self._sent[s]
            if late and now - min(late) > self.timeout:
                slow = [h.label for h, _ in self.members if self._acked[h.rank] == low]
                self._fail(f"{', '.join(slow)} did not take a step within {self.timeout:g}s")
                return
            if now >= next_beat:
                next_beat = now + beat
                self._send(HEARTBEAT, "hb", ())

    # -- the broadcast ---------------------------------------------------------------
    def broadcast(self, kind: str, arrays: Sequence[np.ndarray]) -> None:
        """Send one step's inputs to every follower (raises once the group has failed)."""
        if self._failed.is_set():
            raise LockstepError("the replica lost a member")
        with self._send_lock:
            self._seq += 1
            seq = self._seq
            self._sent[seq] = time.monotonic()
        self._send(seq, kind, arrays)
        if self._failed.is_set():
            raise LockstepError("the replica lost a member")

    def _send(self, seq: int, kind: str, arrays: Sequence[np.ndarray]) -> None:
        contiguous = [np.ascontiguousarray(a) for a in arrays]
        header = json.dumps(
            {"seq": seq, "kind": kind, "arrays": [[a.dtype.str, a.shape] for a in contiguous]}
        ).encode()
        body = b"".join(a.tobytes() for a in contiguous)
        frame = FRAME.pack(len(header), len(body)) + header + body
        with self._send_lock:
            for hello, conn in self.members:
                try:
                    conn.sendall(frame)
                except OSError as exc:
                    threading.Thread(
                        target=self._fail, args=(f"{hello.label} took no step: {exc}",)
                    ).start()
                    return

    def close(self) -> None:
        self._failed.set()
        for _, conn in self.members:
            with contextlib.suppress(OSError):
                conn.close()
        self.listener.close()


class Follower:
    """A follower's end: join the leader, then receive its steps (and watch it)."""

    def __init__(self, timeout: float, startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self._stepped = False  # a step arrived: the leader is serving, the short limit holds
        self.sock: socket.socket | None = None
        self._steps: queue.Queue[tuple[str, list[np.ndarray]] | str] = queue.Queue()
        self._send_lock = threading.Lock()
        self._heard = time.monotonic()

    def join(self, leader: tuple[str, int], hello: Hello, wait: float) -> dict[str, Any]:
        """Connect (retrying until ``wait`` s), say hello; the leader's welcome."""
        deadline = time.monotonic() + wait
        while True:
            try:
                sock = socket.create_connection(leader, timeout=1.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise LockstepError(
                        f"the group's leader at {leader[0]}:{leader[1]} did not answer "
                        f"in {wait:g}s",
                        hint="is the leader's worker running its member?",
                    ) from None
                time.sleep(0.1)
        _send_line(sock, hello.__dict__)
        welcome = _read_line(sock, deadline)
        if "refused" in welcome:
            sock.close()
            raise LockstepError(f"the leader refused this worker: {welcome['refused']}")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        self.sock = sock
        return welcome

    def watch(self, on_failure: FailureHandler) -> None:
        """Read frames on a thread (acknowledging each step), send heartbeats, watch the
        leader: EOF or ``timeout`` s of silence calls ``on_failure`` (once)."""
        assert self.sock is not None
        sock = self.sock
        failed = threading.Event()

        def fail(reason: str) -> None:
            if not failed.is_set():
                failed.set()
                self._steps.put(reason)
                on_failure(reason)

        def reading() -> None:
            try:
                while True:
                    head, size = FRAME.unpack(_recv_exact(sock, FRAME.size))
                    header = json.loads(_recv_exact(sock, head))
                    body = _recv_exact(sock, size)
                    self._heard = time.monotonic()
                    if header["kind"] == "hb":
                        continue
                    arrays, at = [], 0
                    for dtype, shape in header["arrays"]:
                        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
                        arrays.append(np.frombuffer(body[at : at + n], dtype).reshape(shape))
                        at += n
                    self._record(header["seq"])
                    self._stepped = True
                    self._steps.put((header["kind"], arrays))
            except (EOFError, OSError):
                fail("the leader went away (its connection closed)")

        def beating() -> None:
            while not failed.is_set():
                time.sleep(self.timeout / 5)
                limit = self.timeout if self._stepped else self.startup_timeout
                if time.monotonic() - self._heard > limit:
                    fail(f"the leader was silent for {limit:g}s")
                    return
                try:
                    self._record(HEARTBEAT)
                except OSError:
                    fail("the leader went away (its connection failed)")
                    return

        threading.Thread(target=reading, name="lockstep-read", daemon=True).start()
        threading.Thread(target=beating, name="lockstep-beat", daemon=True).start()

    def _record(self, seq: int) -> None:
        assert self.sock is not None
        with self._send_lock:
            self.sock.sendall(RECORD.pack(seq))

    def next_step(self) -> tuple[str, list[np.ndarray]]:
        """The next step's kind and inputs (blocks); raises once the leader is gone."""
        item = self._steps.get()
        if isinstance(item, str):
            raise LockstepError(item)
        return item


def exit_soon(code: int, delay: float) -> None:
    """Leave the process after ``delay`` s, whatever its threads are doing (one of them
    may be blocked inside a collective that will never finish)."""

    def leave() -> None:
        time.sleep(delay)
        os._exit(code)

    threading.Thread(target=leave, name="lockstep-exit", daemon=True).start()
