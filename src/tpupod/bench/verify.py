"""Restored arrays against the ones saved: the same keys, sharding and values on this host."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def restore_problems(expected: Any, restored: Any) -> list[str]:
    """What differs between two pytrees, one line per leaf (empty: they are equal).

    Arrays compare by sharding, then shard by shard on this host's devices, so
    every host checks exactly the bytes it saved and restored.
    """
    if restored is None:
        return ["nothing was restored"]
    want = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    got = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(restored)}
    problems = [f"{key}: missing after restore" for key in sorted(want.keys() - got.keys())]
    problems += [f"{key}: not saved" for key in sorted(got.keys() - want.keys())]
    for key in sorted(want.keys() & got.keys()):
        problem = _leaf_problem(want[key], got[key])
        if problem:
            problems.append(f"{key}: {problem}")
    return problems


def _leaf_problem(want: Any, got: Any) -> str | None:
    if not isinstance(want, jax.Array):
        return None if want == got else f"{got!r} != {want!r}"
    if not isinstance(got, jax.Array):
        return f"restored as {type(got).__name__}, not an array"
    if (got.shape, got.dtype) != (want.shape, want.dtype):
        return f"{got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
    if not got.sharding.is_equivalent_to(want.sharding, want.ndim):
        return f"sharding {got.sharding} != {want.sharding}"
    mine = {s.device.id: s.data for s in want.addressable_shards}
    for shard in got.addressable_shards:
        if not np.array_equal(np.asarray(shard.data), np.asarray(mine[shard.device.id])):
            return f"values differ on device {shard.device.id} (shard {shard.index})"
    return None
