"""What a Cloud TPU accelerator type is: chips, worker VMs (hosts), chips per worker.

Sources (Google Cloud documentation, read 2026-11):
https://cloud.google.com/tpu/docs/v2 , /v3 , /v4 , /v5p , /v5e , /v6e and
https://cloud.google.com/tpu/docs/runtimes (default runtime versions).

Two naming schemes: v2, v3, v4 and v5p types count TensorCores (two per
chip), so ``v4-16`` is 8 chips; v5e (``v5litepod``) and v6e types count chips.
A *worker* is one TPU VM, the unit tpupod runs a process on. Multi-host
slices use 4-chip VMs on every generation (v5e and v6e: the ``-4t`` machine
types), so ``v5litepod-256`` has 64 workers. Google's v5e and v6e topology
tables count 8-chip *physical* hosts instead (4x4 = "2 hosts"); those are
not worker VMs. Single-host v5e and v6e slices put up to 8 chips on one VM.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from tpupod.errors import UsageError

CHIPS_PER_MULTIHOST_WORKER = 4


@dataclass(frozen=True)
class Generation:
    prefix: str
    sizes: tuple[int, ...]
    counts_cores: bool  # the size counts TensorCores (two per chip), not chips
    runtime: str  # the default runtime (software) version

    def chips(self, size: int) -> int:
        return size // 2 if self.counts_cores else size


GENERATIONS = (
    Generation("v2", (8, 32, 128, 256, 512), True, "tpu-ubuntu2204-base"),
    Generation("v3", (8, 32, 64, 128, 256, 512, 1024, 2048), True, "tpu-ubuntu2204-base"),
    Generation(
        "v4", (8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 4096), True, "tpu-ubuntu2204-base"
    ),
    Generation(
        "v5p",
        (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 6144, 8192, 12288),
        True,
        "v2-alpha-tpuv5",
    ),
    Generation("v5litepod", (1, 4, 8, 16, 32, 64, 128, 256), False, "v2-alpha-tpuv5-lite"),
    Generation("v6e", (1, 4, 8, 16, 32, 64, 128, 256), False, "v2-alpha-tpuv6e"),
)
# Names people write that the API does not take.
ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "trillium": "v6e"}
TYPE_RE = re.compile(r"^(?P<prefix>[a-z0-9]+)-(?P<size>\d+)$")


@dataclass(frozen=True)
class AcceleratorType:
    name: str
    generation: str
    chips: int
    workers: int
    chips_per_worker: int
    default_runtime: str

    @property
    def multi_host(self) -> bool:
        return self.workers > 1


def all_names() -> list[str]:
    return [f"{g.prefix}-{size}" for g in GENERATIONS for size in g.sizes]


def lookup(name: str) -> AcceleratorType:
    """The type ``name`` (``v4-16``, ``v5litepod-64``), or a UsageError naming the nearest."""
    match = TYPE_RE.match(name.strip().lower())
    generation = None
    if match:
        prefix = ALIASES.get(match["prefix"], match["prefix"])
        generation = next((g for g in GENERATIONS if g.prefix == prefix), None)
    aliased = match is not None and match["prefix"] in ALIASES
    if match is None or generation is None or aliased or int(match["size"]) not in generation.sizes:
        raise UsageError(f"unknown TPU type {name!r}", hint=_suggest(name, match, generation))
    size = int(match["size"])
    chips = generation.chips(size)
    if generation.counts_cores:  # v2 to v5p: every VM has up to 4 chips
        per_worker = min(chips, CHIPS_PER_MULTIHOST_WORKER)
    else:  # v5e, v6e: up to 8 chips on a single-host slice, 4 per VM beyond
        per_worker = chips if chips <= 8 else CHIPS_PER_MULTIHOST_WORKER
    return AcceleratorType(
        name=f"{generation.prefix}-{size}",
        generation=generation.prefix,
        chips=chips,
        workers=max(1, chips // per_worker),
        chips_per_worker=per_worker,
        default_runtime=generation.runtime,
    )


def _suggest(name: str, match: re.Match[str] | None, generation: Generation | None) -> str:
    renamed = match is not None and match["prefix"] in ALIASES
    if renamed and generation is not None and match and int(match["size"]) in generation.sizes:
        return f"the API calls it {generation.prefix}-{match['size']}"
    if generation is not None:
        sizes = ", ".join(str(s) for s in generation.sizes)
        return f"{generation.prefix} comes in sizes {sizes}"
    close = difflib.get_close_matches(name.lower(), all_names(), n=3, cutoff=0.5)
    if close:
        return f"did you mean {' or '.join(close)}?"
    return f"known generations: {', '.join(g.prefix for g in GENERATIONS)}"
