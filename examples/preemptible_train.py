"""Training that survives spot preemption: copy this shape into your own program.

    tpupod run --retries 3 --sync ~/code -- python examples/preemptible_train.py \
        --ckpt gs://my-bucket/run1 --steps 1000

Every worker trains the same small model (a two-layer MLP on a regression task whose
data is a function of the step, so a resumed run sees exactly the batches it would
have seen). An Orbax ``CheckpointManager`` asks ``should_save(step)`` every step: it
says yes every ``--save-every`` steps and at JAX's preemption sync point, the step
every process reaches after one of them got SIGTERM (what ``tpupod run --retries``
sends on a preemption notice, within GCE's ~30 s). After saving there the program
leaves; the next attempt (``TPUPOD_RESUMED=1``) restores the newest complete step
(``tpupod.latest_checkpoint``) and goes on. ``TPUPOD_RUN_ID`` stays the same across
attempts: give it to your experiment tracker as the run's id.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import numpy as np

import tpupod

identity = tpupod.init_jax()

import jax  # noqa: E402  (after init_jax: jax.distributed must come before any JAX call)
import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument(
    "--ckpt", required=True, help="checkpoint folder every worker sees (gs://..., a shared path)"
)
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--save-every", type=int, default=10)
parser.add_argument("--step-seconds", type=float, default=0.0, help="slow it down (demos)")
parser.add_argument("--out", help="worker 0 writes the final parameters here (.npz)")
args = parser.parse_args()

WIDTH = 16
# The parameters are replicated on every device of every worker: global arrays, which
# Orbax saves once for all processes.
REPLICATED = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec())


def init_params() -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (8, WIDTH)) * 0.3,
        "b1": jnp.zeros(WIDTH),
        "w2": jax.random.normal(k2, (WIDTH, 1)) * 0.3,
    }


def batch(step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The step's batch: the same on every attempt."""
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), step), (32, 8))
    return x, jnp.sin(x.sum(axis=1, keepdims=True))


def loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


@jax.jit  # (the step is a host value: every worker passes the same)
def train_step(params: dict[str, jax.Array], step: jax.Array) -> dict[str, jax.Array]:
    x, y = batch(step)
    grads = jax.grad(loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)


options = ocp.CheckpointManagerOptions(save_interval_steps=args.save_every, max_to_keep=3)
manager = ocp.CheckpointManager(args.ckpt, options=options)
params = jax.jit(init_params, out_shardings=REPLICATED)()
last = tpupod.latest_checkpoint(args.ckpt)
if last is not None:
    params = manager.restore(last, args=ocp.args.StandardRestore(params))
start = 0 if last is None else last + 1
print(
    f"worker {identity.id}: run {os.environ.get('TPUPOD_RUN_ID')} attempt "
    f"{os.environ.get('TPUPOD_ATTEMPT')}, from step {start}",
    flush=True,
)
# One process has no preemption sync point (it is jax.distributed's): a notice (SIGTERM)
# would end it unsaved. It saves at the end of the step under way instead.
noticed: list[int] = []
if jax.process_count() == 1:
    signal.signal(signal.SIGTERM, lambda *_: noticed.append(1))
for step in range(start, args.steps):
    params = train_step(params, step)
    if args.step_seconds:
        jax.block_until_ready(params)
        import time

        time.sleep(args.step_seconds)
    tpupod.heartbeat(step)  # the run's progress: hang rules, status, goodput (a no-op outside)
    if manager.should_save(step) or noticed:  # every --save-every steps, and a preemption
        manager.save(step, args=ocp.args.StandardSave(params), force=bool(noticed))
    if manager.reached_preemption(step) or noticed:
        manager.wait_until_finished()
        print(f"worker {identity.id}: preempted, saved step {step}", flush=True)
        sys.exit(143)
manager.wait_until_finished()
final = float(jax.jit(loss)(params, *batch(jnp.asarray(args.steps))))
print(f"worker {identity.id}: done, {args.steps} steps, loss {final:.6f}", flush=True)
if args.out and identity.id == 0:
    np.savez(args.out, **{k: np.asarray(v.addressable_data(0)) for k, v in params.items()})
