"""What a worker's program calls: ``tpupod.rendezvous`` and ``tpupod.assert_same``.

The connection to the launch's rendezvous service is opened on first use
(from ``TPUPOD_RENDEZVOUS`` and ``TPUPOD_RENDEZVOUS_TOKEN``, which ``tpupod
run`` sets) and registered with this worker's identity and a digest of what it
runs. Plain blocking sockets: a JAX program has no event loop to share.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from tpupod.errors import RendezvousError
from tpupod.launch.identity import WorkerIdentity, worker
from tpupod.launch.rendezvous import DEFAULT_TIMEOUT_S

CONNECT_TIMEOUT_S = 30.0


class RendezvousClient:
    def __init__(self, address: str, token: str, identity: WorkerIdentity, digest: str) -> None:
        host, _, port = address.rpartition(":")
        self.identity = identity
        self._sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self._sock.makefile("rb")
        reply = self._call(
            {
                "token": token,
                "launch_id": identity.launch_id,
                "worker": identity.id,
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "digest": digest,
            }
        )
        if "error" in reply:
            raise RendezvousError(
                f"the rendezvous refused w{identity.id}: {reply['error']}",
                hint="start every worker with the same 'tpupod run'",
            )

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

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        self._sock.sendall(json.dumps(message).encode() + b"\n")
        line = self._file.readline()
        if not line:
            raise RendezvousError("the rendezvous service went away (did the launcher stop?)")
        reply: dict[str, Any] = json.loads(line)
        return reply


@functools.cache
def client() -> RendezvousClient:
    """This process's connection to its launch's rendezvous (opened once)."""
    address = os.environ.get("TPUPOD_RENDEZVOUS")
    token = os.environ.get("TPUPOD_RENDEZVOUS_TOKEN", "")
    if not address:
        raise RendezvousError(
            "no rendezvous service: TPUPOD_RENDEZVOUS is not set",
            hint="start the program on every worker with 'tpupod run -- CMD'",
        )
    return RendezvousClient(address, token, worker(), program_digest())


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
    digest.update(os.environ.get("TPUPOD_CODE_COMMIT", "").encode())
    digest.update(os.environ.get("TPUPOD_CONFIG_DIGEST", "").encode())
    return digest.hexdigest()


def _workers(ids: list[int]) -> str:
    return ", ".join(f"w{w}" for w in ids) or "none"
