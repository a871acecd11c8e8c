"""What a worker's program calls: ``tpupod.rendezvous`` and ``tpupod.assert_same``.

The connection to the launch's rendezvous service is opened on first use
(from ``TPUPOD_RENDEZVOUS`` and ``TPUPOD_RENDEZVOUS_TOKEN``, which ``tpupod
run`` sets) and registered with this worker's identity and a digest of what it
runs. Plain blocking sockets: a JAX program has no event loop to share.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import queue
import socket
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn

from tpupod import settings
from tpupod.errors import RendezvousError
from tpupod.launch.exits import watch_exit
from tpupod.launch.identity import WorkerIdentity, worker
from tpupod.launch.rendezvous import DEFAULT_TIMEOUT_S

CONNECT_TIMEOUT_S = 30.0
# A worker told to stop exits with the code TERM would give it (128 + 15), after one line.
STOPPED_EXIT = 143
LEAVING = "tpupod: stopping"


class RendezvousClient:
    """A worker's connection to its launch's rendezvous service.

    Requests (barrier, exchange, exit) are answered in order; a reader thread
    takes every line the service sends, so the service can also tell the
    worker to stop at any moment (``{"op": "stop"}``, when another worker
    failed or the run is being stopped): the worker then leaves at once, even
    in the middle of a JAX computation that would otherwise hang on a dead peer.
    A connection that closes under a running worker means the launcher is gone:
    the worker leaves too, so nothing outlives its launcher.
    """

    def __init__(self, address: str, token: str, identity: WorkerIdentity, digest: str) -> None:
        host, _, port = address.rpartition(":")
        self.identity = identity
        self._sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self._sock.makefile("rb")
        self._lock = threading.Lock()  # one request at a time
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._leaving = False
        self._send(
            {
                "token": token,
                "launch_id": identity.launch_id,
                "worker": identity.id,
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "digest": digest,
            }
        )
        reply = self._read_line()
        if reply is None or "error" in reply:
            why = reply["error"] if reply else "the service closed the connection"
            raise RendezvousError(
                f"the rendezvous refused w{identity.id}: {why}",
                hint="start every worker with the same 'tpupod run'",
            )
        threading.Thread(target=self._read_forever, name="tpupod-rendezvous", daemon=True).start()

    def barrier(self, name: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        reply = self._call({"op": "barrier", "name": name, "timeout": timeout})
        if reply.get("error") == "timeout":
            raise RendezvousError(
                f"barrier {name!r} timed out after {timeout:g}s: "
                f"missing {_workers(reply['missing'])}; arrived {_workers(reply['arrived'])}",
                hint="look at the missing workers' output ('tpupod logs --worker N')",
            )
        if reply.get("error") == "differ":
            raise RendezvousError(
                str(reply["message"]),
                hint="sync the same code and config to every worker",
            )
        if "error" in reply:
            raise RendezvousError(f"barrier {name!r}: {reply['error']}")

    def exchange(self, name: str, value: Any, timeout: float = DEFAULT_TIMEOUT_S) -> dict[int, Any]:
        reply = self._call({"op": "exchange", "name": name, "value": value, "timeout": timeout})
        if reply.get("error") == "timeout":
            raise RendezvousError(
                f"exchange {name!r} timed out after {timeout:g}s: "
                f"missing {_workers(reply['missing'])}"
            )
        return {int(k): v for k, v in reply["values"].items()}

    def report_exit(self, code: int | None, reason: str | None, timeout: float) -> None:
        """Tell the service how this process ends (``code`` None: not known, but deliberate).

        Best effort and bounded: a process on its way out must not hang here.
        """
        self._leaving = True
        message = {"op": "exit", "code": code, "reason": reason}
        if not self._lock.acquire(timeout=timeout):
            return
        try:
            self._send(message)
            self._replies.get(timeout=timeout)
        except (OSError, queue.Empty):
            pass
        finally:
            self._lock.release()

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._send(message)
            reply = self._replies.get()
        if reply is None:
            raise RendezvousError("the rendezvous service went away (did the launcher stop?)")
        return reply

    def _send(self, message: dict[str, Any]) -> None:
        self._sock.sendall(json.dumps(message).encode() + b"\n")

    def _read_line(self) -> dict[str, Any] | None:
        try:
            line = self._file.readline()
        except OSError:
            return None
        if not line:
            return None
        message: dict[str, Any] = json.loads(line)
        return message

    def _read_forever(self) -> None:
        while (message := self._read_line()) is not None:
            if message.get("op") == "stop":
                _leave(f"{LEAVING} w{self.identity.id}: {message.get('reason', 'asked to')}")
            self._replies.put(message)
        self._replies.put(None)
        if not self._leaving:
            # not "its launcher is gone": a launcher that stops a run for a lost worker
            # closes the rendezvous too (a trial read it as the launcher dying)
            closed = "the rendezvous closed (its launcher ended the run, or is gone)"
            _leave(f"{LEAVING} w{self.identity.id}: {closed}")


def _leave(why: str) -> NoReturn:
    """Leave now, as TERM would, from any thread (JAX holds TERM for its preemption notice)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        print(why, file=sys.stderr, flush=True)
    os._exit(STOPPED_EXIT)


@functools.cache
def client() -> RendezvousClient:
    """This process's connection to its launch's rendezvous (opened once)."""
    address, token = settings.rendezvous()
    if not address:
        raise RendezvousError(
            "no rendezvous service: TPUPOD_RENDEZVOUS is not set",
            hint="start the program on every worker with 'tpupod run -- CMD'",
        )
    connected = RendezvousClient(address, token, worker(), program_digest())
    watch_exit(connected.report_exit)
    return connected


def rendezvous(name: str, timeout: float = DEFAULT_TIMEOUT_S) -> WorkerIdentity:
    """Wait until every worker of the launch reaches the barrier ``name``."""
    rendezvous_client = client()
    if rendezvous_client.identity.count > 1:
        rendezvous_client.barrier(name, timeout)
    return rendezvous_client.identity


def assert_same(value: Any, name: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Raise on every worker unless all workers passed an equal ``value`` (JSON) under ``name``."""
    values = client().exchange(name, value, timeout)
    encoded = {w: json.dumps(v, sort_keys=True) for w, v in values.items()}
    common, _ = Counter(encoded.values()).most_common(1)[0]
    odd = sorted(w for w, v in encoded.items() if v != common)
    if odd:
        shown = ", ".join(f"w{w}: {values[w]!r}" for w in odd)
        raise RendezvousError(
            f"workers disagree on {name!r}: {shown} (the others have {json.loads(common)!r})",
            hint="every worker must run the same code with the same config",
        )


def program_digest() -> str:
    """What this worker runs: command line, main script, synced commit, TPUPOD_CONFIG_DIGEST."""
    digest = hashlib.sha256(json.dumps(sys.argv).encode())
    main = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if main is not None and main.is_file():
        digest.update(main.read_bytes())
    for part in settings.program_identity():
        digest.update(part.encode())
    return digest.hexdigest()


def _workers(ids: list[int]) -> str:
    return ", ".join(f"w{w}" for w in ids) or "none"
