"""``python -m tpupod.launch.rendezvous_main``: a launch's rendezvous service, run on worker 0.

``tpupod run`` starts it there when the workers cannot reach the launcher (``auto`` on a
Cloud TPU reached at its external addresses: a laptop behind NAT). The token comes in
``TPUPOD_RENDEZVOUS_TOKEN``; once listening it prints one line, ``tpupod-rendezvous-ready
HOST:PORT``, then one line per refused worker and ``tpupod-rendezvous-failed WORKER
REASON-JSON`` per failure a worker reports, after ``tpupod-rendezvous-exit-code WORKER
CODE`` when it gave itself an exit code (the launcher decides what follows).

It must outlive the program's save at a preemption: a worker leaves when its rendezvous
connection closes, so a service that died of the notice would cut every worker's save
short. On GCE the notice is a TERM to every process of the VM, this one too; so TERM
does not end it: it serves on until no worker is connected any more (each saved and
left, or was killed), then ends. The launcher ends it with TERM once its workers are
done (nothing connected: at once), and with KILL to stop the workers now (their
connections close, and each leaves). A launcher gone mid-run is the orphan guard's: it
TERMs this group, then KILLs. Its output may go nowhere by then (the SSH session ended
with the host's shutdown): a line that cannot be written is dropped, never fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal

from tpupod import settings
from tpupod.launch.rendezvous import RendezvousServer

READY = "tpupod-rendezvous-ready"
FAILED = "tpupod-rendezvous-failed"
EXIT_CODE = "tpupod-rendezvous-exit-code"
DRAINING = "TERM received: serving on until every worker has left"


def say(text: str) -> None:
    """One line to the launcher; a closed stdout (its session gone) is no reason to die."""
    with contextlib.suppress(OSError, ValueError):
        print(text, flush=True)


def tell_failure(worker: int, reason: str | None, code: int | None) -> None:
    """A worker's failure, as the launcher reads it: the code it gave itself first, on a
    line of its own (a launcher from before it came shows that line as a notice), then
    the failure's line, unchanged."""
    if code is not None:
        say(f"{EXIT_CODE} {worker} {code}")
    say(f"{FAILED} {worker} {json.dumps(reason)}")


async def serve(launch_id: str, token: str, count: int, host: str, port: int) -> None:
    server = RendezvousServer(
        launch_id,
        token,
        count,
        on_event=say,
        on_failure=tell_failure,
    )
    bound_host, bound_port = await server.start(host, port)
    terminated = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminated.set)
    say(f"{READY} {bound_host}:{bound_port}")
    await terminated.wait()
    if server.connections:
        say(DRAINING)
        await server.drained()
    await server.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tpupod.launch.rendezvous_main")
    parser.add_argument("--launch-id", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    _, token = settings.rendezvous()
    asyncio.run(serve(args.launch_id, token, args.count, args.host, args.port))


if __name__ == "__main__":
    main()
