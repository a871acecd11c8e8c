"""``tpupod.mesh(ici=..., dcn=...)``: one device mesh call for a pod of one slice or several.

Axes are named once, each with a size within a slice (``ici``, the chips' own links) and a
size across slices (``dcn``, the data-center network); a mesh axis is the product of the
two. ``-1`` fills in what is left. TPU devices say their slice (``slice_index``), and
``jax.experimental.mesh_utils.create_hybrid_device_mesh`` groups them by it. CPU and GPU
devices know nothing of tpupod's slices: there the slice is tpupod's
(``TPUPOD_NUM_SLICES``; global worker ids run slice by slice, so process ``p`` is in
slice ``p // processes per slice``), and
each slice's devices are laid out as JAX lays out one slice, the slices side by side as
``create_hybrid_device_mesh`` puts them. On a pod of one slice every dcn size is 1, so the
same program runs unchanged there.

Deferred imports: JAX and numpy, imported by the call (``import tpupod`` stays light).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tpupod.errors import UsageError
from tpupod.launch.identity import worker

if TYPE_CHECKING:
    import jax

HINT = "give each axis a size or -1 (at most one -1 each for ici and dcn), e.g. ici={'fsdp': -1}"


def mesh(
    ici: Mapping[str, int] | None = None,
    dcn: Mapping[str, int] | None = None,
    *,
    devices: Sequence[Any] | None = None,
) -> jax.sharding.Mesh:
    """A ``jax.sharding.Mesh`` over every device (or ``devices``) of the pod, its axes the
    names of ``dcn`` then those of ``ici`` (each in order; an axis named in one only is 1 in
    the other): ``tpupod.mesh(ici={"fsdp": -1}, dcn={"data": -1})`` shards over the chips
    of a slice and replicates data-parallel across slices."""
    import jax  # the call's: tpupod itself does not need JAX

    ici, dcn = dict(ici or {}), dict(dcn or {})
    devices = list(jax.devices() if devices is None else devices)
    groups = _by_slice(devices)
    names = tuple(dict.fromkeys([*dcn, *ici]))
    if not names:
        raise UsageError("tpupod.mesh() needs at least one axis", hint=HINT)
    ici_shape = _sizes(ici, names, len(groups[0]), "ici", "devices in a slice")
    dcn_shape = _sizes(dcn, names, len(groups), "dcn", "slices")
    return jax.sharding.Mesh(_hybrid(ici_shape, dcn_shape, devices, groups), names)


def _tpu(devices: list[Any]) -> bool:
    """TPU devices know their slice. (Multi-process CPU devices have a ``slice_index`` too,
    always 0: it says nothing of tpupod's slices.)"""
    return devices[0].platform == "tpu" and hasattr(devices[0], "slice_index")


def _by_slice(devices: list[Any]) -> list[list[Any]]:
    """The devices, slice by slice: by ``slice_index`` on TPUs, else by tpupod's slice of
    their process."""
    per_slice = 0  # processes per slice, where the slice is tpupod's
    if not _tpu(devices):
        slices = worker().slices
        processes = 1 + max(int(d.process_index) for d in devices)
        if processes % slices:
            raise UsageError(
                f"{processes} processes do not divide into the pod's {slices} slices",
                hint="start the program on every worker with 'tpupod run'",
            )
        per_slice = processes // slices
    grouped: dict[int, list[Any]] = {}
    for d in devices:
        key = int(d.process_index) // per_slice if per_slice else int(d.slice_index)
        grouped.setdefault(key, []).append(d)
    groups = [grouped[k] for k in sorted(grouped)]
    if len({len(g) for g in groups}) > 1:
        sizes = ", ".join(str(len(g)) for g in groups)
        raise UsageError(
            f"the slices have different numbers of devices ({sizes})",
            hint="every slice needs the same devices: check each worker's accelerators",
        )
    return groups


def _sizes(
    sizes: dict[str, int], names: tuple[str, ...], total: int, kind: str, of: str
) -> list[int]:
    """Each axis's size in ``kind`` (1 where it is not named there), ``-1`` filled in so that
    the product is ``total``."""
    shape = [int(sizes.get(name, 1)) for name in names]
    if any(size < 1 and size != -1 for size in shape) or shape.count(-1) > 1:
        raise UsageError(f"{kind}={sizes}: sizes are positive, with at most one -1", hint=HINT)
    known = 1
    for size in shape:
        known *= size if size != -1 else 1
    if total % known or (-1 not in shape and known != total):
        raise UsageError(
            f"{kind}={sizes} does not fit {total} {of} (the product must be {total})",
            hint=HINT,
        )
    return [total // known if size == -1 else size for size in shape]


def _hybrid(
    ici_shape: list[int], dcn_shape: list[int], devices: list[Any], groups: list[list[Any]]
) -> Any:
    """The device array: JAX's own hybrid mesh where devices know their slice, else each of
    tpupod's slices laid out by ``create_device_mesh`` and placed as JAX places slices."""
    import numpy as np  # with JAX, the call's
    from jax.experimental import mesh_utils  # the call's

    if _tpu(devices):
        return mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices)
    per_slice = [mesh_utils.create_device_mesh(ici_shape, group) for group in groups]
    placed = np.arange(len(groups)).reshape(dcn_shape)
    blocks = np.vectorize(lambda i: per_slice[i], otypes=[object])(placed)
    return np.block(blocks.tolist())
