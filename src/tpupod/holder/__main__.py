"""``python -m tpupod.holder --home DIR --pod NAME``: started by the CLI, not by people."""

from __future__ import annotations

import argparse
from pathlib import Path

from tpupod import settings
from tpupod.holder.server import run

parser = argparse.ArgumentParser(prog="python -m tpupod.holder")
parser.add_argument("--home", type=Path, required=True, help="the state directory")
parser.add_argument("--pod", required=True)
parser.add_argument("--idle", type=float, default=None, help="seconds idle before exiting")
args = parser.parse_args()
run(args.home, args.pod, args.idle if args.idle is not None else settings.holder_idle_s())
