"""``python -m tpupod.sim --hosts N``: run a simulated pod until interrupted (root only).

Prints one JSON line once every host answers: the hosts' addresses, the
key that logs in as root on them (e.g. for ``tpupod up --ssh``) and how long
the start took (``startup_s``). SIGINT or
SIGTERM tears everything down.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from tpupod.sim.pod import SimError, SimPod


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tpupod.sim", description=__doc__)
    parser.add_argument("--hosts", type=int, default=4)
    args = parser.parse_args()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        sim = SimPod(args.hosts)
        sim.start()
    except SimError as exc:
        sys.exit(f"error: {exc}")
    try:
        hosts = [{"hostname": h.hostname, "address": h.address} for h in sim.hosts]
        startup = round(sim.startup_s, 2)
        print(json.dumps({"key": str(sim.key), "startup_s": startup, "hosts": hosts}), flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        sim.stop()


if __name__ == "__main__":
    main()
