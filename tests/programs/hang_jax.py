"""Four workers of a JAX program, one of them hung (tests/test_hang.py): the last worker
sleeps in its data loader at step 2 while the others block in a cross-host gather."""

import sys
import time

import tpupod

me = tpupod.init_jax()

import jax.numpy as jnp  # noqa: E402  (after init_jax)
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402


def next_batch(step: int) -> np.ndarray:
    if me.id == me.count - 1 and step == 2:
        print("loading step 2", flush=True)
        time.sleep(3600)  # a stuck data loader
    return np.ones(4) * step


def train(steps: int) -> None:
    for step in range(steps):
        batch = next_batch(step)
        total = multihost_utils.process_allgather(jnp.asarray(batch.sum()))
        tpupod.heartbeat(step)
        print(f"step {step} sum {float(total.sum())}", flush=True)


train(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
