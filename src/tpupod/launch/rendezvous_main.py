"""``python -m tpupod.launch.rendezvous_main``: a launch's rendezvous service, run on worker 0.

``tpupod run --rendezvous-on worker0`` starts it when the workers cannot
reach the launcher (a laptop behind NAT driving a Cloud TPU). The token comes
in ``TPUPOD_RENDEZVOUS_TOKEN``; once listening it prints one line,
``tpupod-rendezvous-ready HOST:PORT``, then one line per refused worker and
``tpupod-rendezvous-failed WORKER REASON-JSON`` per failure a worker reports
(the launcher decides what follows), and serves until it is killed (the
launcher's orphan guard sees to that). Killing it tells every worker to stop:
a worker leaves when its rendezvous connection closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from tpupod import settings
from tpupod.launch.rendezvous import RendezvousServer

READY = "tpupod-rendezvous-ready"
FAILED = "tpupod-rendezvous-failed"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tpupod.launch.rendezvous_main")
    parser.add_argument("--launch-id", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    _, token = settings.rendezvous()

    async def serve() -> None:
        server = RendezvousServer(
            args.launch_id,
            token,
            args.count,
            on_event=lambda text: print(text, flush=True),
            on_failure=lambda worker, reason: print(
                f"{FAILED} {worker} {json.dumps(reason)}", flush=True
            ),
        )
        host, port = await server.start(args.host, args.port)
        print(f"{READY} {host}:{port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
