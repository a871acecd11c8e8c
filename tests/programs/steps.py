"""A stand-in for training, for the recovery tests and benchmarks/preemption.py: STEPS
steps of a deterministic update, a checkpoint every SAVE_EVERY steps (default 1; worker 0
writes it: a temporary file, then a rename), resumed from the newest complete one. On
SIGTERM it finishes its step, saves it, and leaves (143): the save at a preemption
notice. Every step done is logged per worker (``steps-wN.log``, a line per step: the step
and when it ended): a step logged twice was redone, lost at the notice. Started by
``tpupod run``, it meets the others at the rendezvous first and stays connected to it, as
a program that calls ``init_jax()`` does.

    python steps.py CKPT_DIR STEPS SECONDS_PER_STEP [SAVE_EVERY]
"""

import os
import signal
import sys
import time
from pathlib import Path

ckpt, steps, pause = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
save_every = int(sys.argv[4]) if len(sys.argv) > 4 else 1
ckpt.mkdir(parents=True, exist_ok=True)
worker = int(os.environ["TPUPOD_WORKER_ID"])
stop: list[int] = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
if os.environ.get("TPUPOD_RENDEZVOUS"):
    import tpupod

    tpupod.rendezvous("start")


def latest() -> tuple[int, int]:
    done = sorted(int(p.stem) for p in ckpt.glob("*.ckpt"))
    if not done:
        return 0, 1
    return done[-1] + 1, int((ckpt / f"{done[-1]}.ckpt").read_text())


start, value = latest()
if worker == 0:  # for the tests: when this attempt began (written whole, then renamed)
    (ckpt / "started.tmp").write_text(str(start))
    os.replace(ckpt / "started.tmp", ckpt / f"started-{os.environ.get('TPUPOD_ATTEMPT', '0')}")
print(f"worker {worker} attempt {os.environ.get('TPUPOD_ATTEMPT')} from step {start}", flush=True)
for step in range(start, steps):
    value = (value * 31 + step) % 1_000_003
    time.sleep(pause)
    if worker == 0 and (stop or (step + 1) % save_every == 0):
        tmp = ckpt / f"{step}.tmp-{os.getpid()}"
        tmp.write_text(str(value))
        os.replace(tmp, ckpt / f"{step}.ckpt")
    with (ckpt / f"steps-w{worker}.log").open("a") as log:
        log.write(f"{step} {time.time():.3f}\n")
    if os.environ.get("TPUPOD_RENDEZVOUS"):
        tpupod.heartbeat(step)  # the run's goodput (a marker the launcher takes out)
    if stop:
        print(f"worker {worker}: SIGTERM, saved step {step}", flush=True)
        sys.exit(143)
if worker == 0:
    (ckpt / "final").write_text(str(value))
print(f"worker {worker} done: {value}", flush=True)
