"""A training stand-in with a real Orbax ``CheckpointManager``, for the recovery test of a
preemption during a checkpoint write: STEPS steps of a deterministic update of an int64
array, every step saved by worker 0, resumed from ``tpupod.latest_checkpoint``.

On its first attempt, worker 0 writes step CUT_AT's checkpoint into Orbax's temporary
folder and then waits before the rename that commits it (leaving a file ``cut`` beside
CKPT_DIR): a host preempted there loses the write half done, as one preempted mid-write
does. Worker 0 writes the final array to FINAL (.npy).

    python orbax_steps.py CKPT_DIR STEPS CUT_AT FINAL
"""

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

import tpupod

ckpt, steps, cut_at, final = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
worker = int(os.environ["TPUPOD_WORKER_ID"])
attempt = os.environ.get("TPUPOD_ATTEMPT", "1")
rename = os.rename


def held_rename(src: Any, dst: Any, **_: Any) -> None:
    """Orbax commits a step by renaming its temporary folder: step CUT_AT's waits."""
    if Path(dst).name == str(cut_at):
        (ckpt.parent / "cut").write_text(str(src))
        time.sleep(600)
    rename(src, dst)


if worker == 0 and attempt == "1":
    os.rename = held_rename
options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
manager = ocp.CheckpointManager(ckpt.absolute(), options=options)
last = tpupod.latest_checkpoint(ckpt)
value = np.arange(4, dtype=np.int64)
if last is not None:
    value = manager.restore(last, args=ocp.args.StandardRestore({"v": value}))["v"]
start = 0 if last is None else last + 1
print(f"worker {worker} attempt {attempt} from step {start}", flush=True)
for step in range(start, steps):
    value = (value * 31 + step) % 1_000_003
    if worker == 0:
        manager.save(step, args=ocp.args.StandardSave({"v": value}), force=True)
if worker == 0:
    np.save(final, value)
print(f"worker {worker} done", flush=True)
