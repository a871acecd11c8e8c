"""Training across slices: data parallel over the data-center network, sharded within a slice.

Run it on every worker of a pod of slices (or of one slice, unchanged)::

    tpupod up --name ms --local 4 --slices 2 --devices-per-worker 2
    tpupod run --pod ms -- python examples/multislice_train.py --steps 5

``tpupod.mesh(ici={"fsdp": -1}, dcn={"data": -1})`` makes a mesh of two axes: ``data``
across slices (one per slice), ``fsdp`` over the devices of a slice. The first layer's
weights are sharded over ``fsdp`` and the batch over both, so the only traffic across
slices is the gradients' reduction. The loss is the same as one process's with every
device and the same global batch.
"""

from __future__ import annotations

import argparse

import numpy as np

import tpupod

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--batch", type=int, default=64, help="the global batch")
parser.add_argument("--dim", type=int, default=16)
parser.add_argument("--hidden", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.1)
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
for i in range(args.steps):
    loss, state = step(state, x, y)
    if identity.is_coordinator:
        print(f"step {i} loss {float(loss.addressable_data(0)):.9f}", flush=True)
print(
    f"worker {identity.id} (slice {identity.slice} of {identity.slices}): "
    f"mesh {dict(mesh.shape)}, final loss {float(loss.addressable_data(0)):.9f}"
)
