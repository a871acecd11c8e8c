"""Training across slices: data parallel over the data-center network, sharded within a slice.

Run it on every worker of a pod of slices (or of one slice, unchanged)::

    tpupod up --name ms --local 4 --slices 2 --devices-per-worker 2
    tpupod run --pod ms -- python examples/multislice_train.py --steps 5

``tpupod.mesh(ici={"fsdp": -1}, dcn={"data": -1})`` makes a mesh of two axes: ``data``
across slices (one per slice), ``fsdp`` over the devices of a slice. The first layer's
weights are sharded over ``fsdp`` and the batch over both, so the only traffic across
slices is the gradients' reduction. The loss is the same as one process's with every
device and the same global batch.

With ``--ckpt`` it survives preemption as ``examples/preemptible_train.py`` does: an Orbax
``CheckpointManager`` saves every ``--save-every`` steps and at JAX's preemption sync
point (the step every process reaches after ``tpupod run --retries`` sent the notice's
TERM), and a new attempt restores the newest complete step (``tpupod.latest_checkpoint``)
into the mesh it is given, however the slices were replaced meanwhile::

    tpupod run --retries 3 -- python examples/multislice_train.py --ckpt gs://b/run1 --steps 1000
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

import tpupod

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5)
parser.add_argument(
    "--batch", type=int, default=192, help="the global batch (192: even over 1-4, 6, 8 ... devices)"
)
parser.add_argument("--dim", type=int, default=16)
parser.add_argument("--hidden", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument(
    "--ckpt", help="checkpoint folder every worker sees (gs://..., a shared path): resumable"
)
parser.add_argument("--save-every", type=int, default=10)
parser.add_argument("--step-seconds", type=float, default=0.0, help="slow it down (demos)")
parser.add_argument("--out", help="worker 0 writes the final parameters here (.npz)")
args = parser.parse_args()

identity = tpupod.init_jax()

import jax  # noqa: E402  (after init_jax: jax.distributed must come before any JAX call)
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = tpupod.mesh(ici={"fsdp": -1}, dcn={"data": -1})
rng = np.random.default_rng(0)  # the same numbers on every worker: each takes its shards
data = {
    "x": rng.normal(size=(args.batch, args.dim)).astype(np.float32),
    "y": rng.normal(size=(args.batch,)).astype(np.float32),
}
params = {
    "w1": (rng.normal(size=(args.dim, args.hidden)) / np.sqrt(args.dim)).astype(np.float32),
    "w2": (rng.normal(size=(args.hidden,)) / np.sqrt(args.hidden)).astype(np.float32),
}
specs = {"x": P(("data", "fsdp")), "y": P(("data", "fsdp")), "w1": P("fsdp"), "w2": P()}


def place(name: str, value: np.ndarray) -> jax.Array:
    sharding = NamedSharding(mesh, specs[name])
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


@jax.jit
def step(params: dict[str, jax.Array], x: jax.Array, y: jax.Array):  # type: ignore[no-untyped-def]
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return loss, jax.tree.map(lambda p, g: p - args.lr * g, params, grads)


state = {name: place(name, value) for name, value in params.items()}
x, y = place("x", data["x"]), place("y", data["y"])
start, manager = 0, None
if args.ckpt:
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(save_interval_steps=args.save_every, max_to_keep=3)
    manager = ocp.CheckpointManager(args.ckpt, options=options)
    last = tpupod.latest_checkpoint(args.ckpt)
    if last is not None:  # into this mesh's shardings, whatever the saving run's were
        state = manager.restore(last, args=ocp.args.StandardRestore(state))
        start = last + 1
    run = os.environ.get("TPUPOD_RUN_ID")  # set by run --retries: the same on every attempt
    attempt = f"run {run} attempt {os.environ.get('TPUPOD_ATTEMPT')}, " if run else ""
    print(f"worker {identity.id}: {attempt}from step {start}", flush=True)
# One process has no preemption sync point (it is jax.distributed's): a notice (SIGTERM)
# would end it unsaved, as when an elastic run goes on with one slice of one worker. It
# saves at the end of the step under way instead.
noticed: list[int] = []
if manager is not None and jax.process_count() == 1:
    signal.signal(signal.SIGTERM, lambda *_: noticed.append(1))
for i in range(start, args.steps):
    loss, state = step(state, x, y)
    # Every worker waits for its step. On CPU (gloo) two steps in flight at once could
    # run their collectives in a different order on two processes: 2 workers of 2
    # devices hung at step 1 for good, each waiting in a different step's collective.
    jax.block_until_ready(state)
    if identity.is_coordinator:
        print(f"step {i} loss {float(loss.addressable_data(0)):.9f}", flush=True)
    if args.step_seconds:
        time.sleep(args.step_seconds)
    tpupod.heartbeat(i)  # the run's progress: hang rules, status, goodput (a no-op outside)
    if manager is not None and (manager.should_save(i) or noticed):  # interval, preemption
        manager.save(i, args=ocp.args.StandardSave(state), force=bool(noticed))
    if manager is not None and (manager.reached_preemption(i) or noticed):
        manager.wait_until_finished()
        print(f"worker {identity.id}: preempted, saved step {i}", flush=True)
        sys.exit(143)
if manager is not None:
    manager.wait_until_finished()
loss = jax.jit(loss_fn)(state, x, y)  # of the final parameters (no step may have run here)
print(
    f"worker {identity.id} (slice {identity.slice} of {identity.slices}): "
    f"mesh {dict(mesh.shape)}, final loss {float(loss.addressable_data(0)):.9f}"
)
if args.out:  # every worker takes part in the gather; worker 0 writes
    from jax.experimental import multihost_utils

    final = {k: multihost_utils.process_allgather(v, tiled=True) for k, v in state.items()}
    if identity.id == 0:
        np.savez(args.out, **{k: np.asarray(v) for k, v in final.items()})
