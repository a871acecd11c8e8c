"""A program that hangs, without JAX (tests/test_hang.py): every worker steps with a
heartbeat; the last one stops in ``next_batch`` at step 3 while the others wait for it in
``wait_for_peers``. Modes (argv[1]):

- ``hang``: as above, on every attempt;
- ``hang-once``: only on attempt 1 (``TPUPOD_ATTEMPT``), so a rerun finishes;
- ``chatty``: every worker's heartbeat stops at step 3, but it goes on printing a line every
  0.1 s (output is not progress once a program has a heartbeat);
- ``straggle``: the last worker's steps stop at 3 for 6 s while the others go on to 20.
"""

import os
import sys
import time

import tpupod

mode = sys.argv[1]
me = int(os.environ["TPUPOD_WORKER_ID"])
last = int(os.environ["TPUPOD_NUM_WORKERS"]) - 1
attempt = os.environ.get("TPUPOD_ATTEMPT", "1")
tpupod.rendezvous("start")


def next_batch(step: int) -> None:
    hangs = mode == "hang" or (mode == "hang-once" and attempt == "1")
    if me == last and step == 3 and hangs:
        print("loading step 3", flush=True)
        time.sleep(3600)
    if me == last and step == 3 and mode == "straggle":
        time.sleep(6)


def wait_for_peers() -> None:
    time.sleep(3600)


for step in range(20):
    next_batch(step)
    if mode == "chatty" and step >= 3:
        while True:
            print("still here", flush=True)
            time.sleep(0.1)
    tpupod.heartbeat(step)
    print(f"step {step}", flush=True)
    time.sleep(0.3 if mode != "straggle" else 0.1)
    if step == 5 and me != last and mode.startswith("hang") and (mode == "hang" or attempt == "1"):
        wait_for_peers()
print("done", flush=True)
