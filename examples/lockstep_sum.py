"""A lockstep JAX program: every worker meets the others, then they sum across hosts.

Run it on every worker with ``tpupod run -- python examples/lockstep_sum.py``.
Each device holds one number (its global index + 1); the sum over a mesh of
all devices of all workers must be n(n+1)/2 on every worker.
"""

from __future__ import annotations

import numpy as np

import tpupod

identity = tpupod.init_jax()

import jax  # noqa: E402  (after init_jax: jax.distributed must come before any JAX call)
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

tpupod.assert_same({"program": "lockstep_sum", "local_devices": jax.local_device_count()}, "config")

mesh = Mesh(np.array(jax.devices()), ("devices",))
first = jax.process_index() * jax.local_device_count()
local = np.arange(first, first + jax.local_device_count(), dtype=np.float32) + 1
values = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("devices")), local)
total = float(jax.jit(jnp.sum)(values).addressable_data(0))
processes = multihost_utils.process_allgather(jnp.array([jax.process_index()])).ravel().tolist()

n = jax.device_count()
print(
    f"worker {identity.id} of {identity.count}: {n} devices in the mesh, "
    f"cross-host sum {total:g} (expected {n * (n + 1) / 2:g}), processes {processes}"
)
