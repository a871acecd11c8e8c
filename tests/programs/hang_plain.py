"""A program that hangs, without JAX (tests/test_hang.py): every worker steps with a
heartbeat; the last one stops in ``next_batch`` at step 3 while the others wait for it in
``wait_for_peers``. Modes (argv[1]):

- ``hang``: as above, on every attempt;
- ``hang-once``: only on attempt 1 (``TPUPOD_ATTEMPT``), so a rerun finishes;
- ``chatty``: every worker's heartbeat stops at step 3, but it goes on printing a line every
  0.1 s (output is not progress once a program has a heartbeat);
- ``straggle``: the last worker's steps stop at 3 for 6 s while the others go on to 20;
- ``ends``: the others finish at step 5 (exit 0) while the last one is stuck at step 3;
- ``nostep``: the last worker is stuck before its first heartbeat, the others step on;
- ``partial``: a line begun with ``print(..., end="")``, a heartbeat, then its end;
- ``noisy``: as ``hang``, and on SIGTERM each worker prints a traceback's worth of lines
  and waits on (until KILL);
- ``pool``: the last worker's multiprocessing child is stuck in ``load_item``.
"""

import multiprocessing
import os
import signal
import sys
import time

import tpupod

mode = sys.argv[1]
me = int(os.environ["TPUPOD_WORKER_ID"])
last = int(os.environ["TPUPOD_NUM_WORKERS"]) - 1
attempt = os.environ.get("TPUPOD_ATTEMPT", "1")
tpupod.rendezvous("start")
if mode == "noisy":

    def fall(*_: object) -> None:  # as a collective's error as its peers go: then KILL
        for line in ("Traceback (most recent call last):", "  File x", "ValueError: peer gone"):
            print(line, flush=True)

    signal.signal(signal.SIGTERM, fall)


def load_item(item: int) -> int:
    if item == 1:
        time.sleep(3600)
    return item


if mode == "pool" and me == last:
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(load_item, range(2))
if mode == "nostep" and me == last:
    time.sleep(3600)
if mode == "partial":
    print("step 0 loss=", end="", flush=True)
    tpupod.heartbeat(0)
    print("0.5", flush=True)
    sys.exit(0)


def next_batch(step: int) -> None:
    hangs = mode in ("hang", "ends", "noisy") or (mode == "hang-once" and attempt == "1")
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
    time.sleep(0.1 if mode in ("straggle", "nostep") else 0.3)
    if step == 5 and me != last and mode == "ends":
        break
    waits = mode in ("hang", "noisy") or (mode == "hang-once" and attempt == "1")
    if step == 5 and me != last and waits:
        wait_for_peers()
print("done", flush=True)
