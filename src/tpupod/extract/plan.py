"""Which samples go in which shard, and which host computes it.

Samples are ordered by a hash of their id and cut into shards of a fixed
number of samples, so a shard's contents depend only on the data and the
shard size: never on how many hosts run, or on what an earlier, interrupted
run got done. Shard ``k`` goes to host ``k % hosts``; a resumed run (on any
number of hosts) skips the committed shards and plans the rest the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib

from tpupod.extract.data import Sample


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One shard: its number and its samples (in hash order)."""

    index: int
    samples: tuple[Sample, ...]

    @property
    def name(self) -> str:
        return shard_name(self.index)


def shard_name(index: int) -> str:
    return f"shard-{index:06d}"


def id_hash(sample_id: str) -> int:
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big")


def plan_shards(samples: list[Sample], shard_samples: int) -> list[ShardPlan]:
    """Every shard of the run, in order."""
    ordered = sorted(samples, key=lambda s: (id_hash(s.id), s.id))
    return [
        ShardPlan(k, tuple(ordered[start : start + shard_samples]))
        for k, start in enumerate(range(0, len(ordered), shard_samples))
    ]


def for_host(shards: list[ShardPlan], host: int, hosts: int) -> list[ShardPlan]:
    return [s for s in shards if s.index % hosts == host]


def batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Positions of a shard's samples grouped into batches, shortest first (less padding)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
