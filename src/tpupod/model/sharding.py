"""Where each parameter and activation lives on a (data, model) mesh.

Tensor parallelism splits attention by heads and the MLP by its width over
the ``model`` axis; activations and the KV cache split by batch over the
``data`` axis. A dimension that the axis does not divide (two key/value heads
on a model axis of four) stays replicated rather than failing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tpupod.errors import ModelError

DATA, MODEL = "data", "model"

# parameter path (dots) -> which dimension the model axis splits, or None
_MODEL_DIM: list[tuple[str, int | None]] = [
    (r"embedding", 0),  # [V, D]: vocabulary
    (r"lm_head", 0),  # [V, D]
    (r"layers\.\d+\.attn\.[qkv]_kernel", 0),  # [N|K, H, D]: heads
    (r"layers\.\d+\.attn\.[qkv]_bias", 0),  # [N|K, H]
    (r"layers\.\d+\.attn\.o_kernel", 1),  # [D, N, H]
    (r"layers\.\d+\.mlp\.(gate|up)_kernel", 0),  # [F, D]
    (r"layers\.\d+\.mlp\.down_kernel", 1),  # [D, F]
]


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over ``data * model`` devices (all processes' devices)."""
    devices = list(devices if devices is not None else jax.devices())
    if data * model != len(devices):
        raise ModelError(
            f"a {data} x {model} mesh needs {data * model} devices; there are {len(devices)}",
            hint="choose data and model so that their product is the device count",
        )
    return Mesh(np.array(devices).reshape(data, model), (DATA, MODEL))


def param_spec(path: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The partition spec of the parameter at ``path`` (e.g. ``layers.3.mlp.up_kernel``)."""
    width = mesh.shape[MODEL]
    for pattern, dim in _MODEL_DIM:
        if re.fullmatch(pattern, path):
            if dim is None or shape[dim] % width:
                break
            spec: list[str | None] = [None] * len(shape)
            spec[dim] = MODEL
            return PartitionSpec(*spec)
    return PartitionSpec()


def param_sharding(path: str, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, param_spec(path, shape, mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Activations, token ids, masks: split the leading (batch) dimension by data."""
    return NamedSharding(mesh, PartitionSpec(DATA))


def logits_sharding(mesh: Mesh, vocab_size: int) -> NamedSharding:
    """Logits [B, T, V]: batch by data, vocabulary by model (as the LM head is split)."""
    vocab = MODEL if vocab_size % mesh.shape[MODEL] == 0 else None
    return NamedSharding(mesh, PartitionSpec(DATA, None, vocab))


def cache_sharding(mesh: Mesh, num_kv_heads: int) -> NamedSharding:
    """KV cache [B, K, S, H]: batch by data, heads by model where they divide."""
    heads = MODEL if num_kv_heads % mesh.shape[MODEL] == 0 else None
    return NamedSharding(mesh, PartitionSpec(DATA, heads, None, None))


def place(array: np.typing.ArrayLike, sharding: NamedSharding) -> jax.Array:
    """Put a host array that every process holds in full onto a (global) sharding.

    Works in a multi-process run, where ``jax.device_put`` of a host array to
    devices of other processes is not possible: each process fills only its
    own shards.
    """
    host = np.asarray(array)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
