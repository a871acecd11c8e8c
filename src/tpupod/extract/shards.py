"""The output format: per shard one safetensors file and its JSON manifest; ``run.json``
(what the run computes) and ``manifest.json`` (every shard, merged at the end).

A shard ``shard-KKKKKK.safetensors`` holds ``hidden.L`` (``[tokens, d_model]``,
the real tokens of every sample, concatenated) for each requested layer ``L``,
``tokens`` (int32) and ``offsets`` (int64, ``[samples + 1]``: sample ``i`` is
rows ``offsets[i]:offsets[i+1]``). Its manifest ``shard-KKKKKK.json`` lists
the samples' ids, their places in the data (``positions``: the reader lists
ids in the data's order), the ids cut to ``max_length`` (``cut``), lengths
and offsets, the layers, the dtype, the run's
config (model name and config hash, data hash, tpupod version) and, with
``--generate``, each completion. Nothing host- or time-dependent is in a
shard, so a shard is the same bytes whoever computes it, whenever.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpupod import __version__
from tpupod.errors import ExtractError
from tpupod.extract import tensorfile
from tpupod.extract.tensorfile import Buffer

RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.json"
FORMAT = 2  # 2: manifests hold positions and cut


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that decides the output's bytes; a resume must match it exactly."""

    model: str
    config_hash: str
    data_hash: str
    layers: tuple[int, ...]
    dtype: str
    max_length: int
    batch_size: int
    shard_samples: int
    max_samples: int | None
    generate: int
    temperature: float
    seed: int
    format: int = FORMAT
    tpupod_version: str = __version__

    def to_json(self) -> bytes:
        return _dump(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> RunConfig:
        data = json.loads(raw)
        data["layers"] = tuple(data["layers"])
        return cls(**data)


@dataclasses.dataclass
class ShardResult:
    """One computed shard, ready to encode."""

    index: int
    ids: list[str]
    tokens: list[np.ndarray]  # per sample, int32 [length]
    hidden: dict[int, list[np.ndarray]]  # layer -> per sample [length, d_model]
    completions: list[str] | None = None
    completion_tokens: list[list[int]] | None = None
    positions: list[int] = dataclasses.field(default_factory=list)  # per sample, in the data
    cut: list[str] = dataclasses.field(default_factory=list)  # ids cut to max_length


def encode(shard: ShardResult, config: RunConfig) -> tuple[list[Buffer], bytes]:
    """The shard's safetensors file (as buffers to write in order) and its manifest."""
    lengths = [len(t) for t in shard.tokens]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tensors: dict[str, Sequence[np.ndarray]] = {
        f"hidden.{layer}": parts for layer, parts in shard.hidden.items()
    }
    tensors["tokens"] = [t.astype(np.int32) for t in shard.tokens]
    tensors["offsets"] = [offsets]
    manifest: dict[str, Any] = {
        "shard": shard.index,
        "file": f"{_stem(shard.index)}.safetensors",
        "ids": shard.ids,
        "positions": shard.positions,
        "cut": shard.cut,
        "lengths": lengths,
        "offsets": offsets.tolist(),
        "layers": list(config.layers),
        "dtype": config.dtype,
        "run": dataclasses.asdict(config),
    }
    if shard.completions is not None:
        manifest["completions"] = shard.completions
        manifest["completion_tokens"] = shard.completion_tokens
    return tensorfile.encode(tensors), _dump(manifest)


def files_of(index: int) -> tuple[str, str]:
    return f"{_stem(index)}.safetensors", f"{_stem(index)}.json"


def _stem(index: int) -> str:
    return f"shard-{index:06d}"


def committed(manifest: bytes | None, config: RunConfig) -> bool:
    """Whether a shard's manifest (its commit) is there and belongs to this run."""
    if manifest is None:
        return False
    try:
        return bool(json.loads(manifest)["run"] == json.loads(config.to_json()))
    except (ValueError, KeyError):
        return False


def check_run(existing: bytes | None, config: RunConfig, where: str) -> None:
    """Refuse to resume into a folder that holds another run's output."""
    if existing is None:
        return
    try:
        before = RunConfig.from_json(existing)
    except (ValueError, TypeError, KeyError) as exc:
        raise ExtractError(
            f"{where}/{RUN_FILE} is not readable", hint="choose another --out"
        ) from exc
    if before != config:
        old, new = json.loads(before.to_json()), json.loads(config.to_json())  # lists, not tuples
        changed = ", ".join(f"{k} ({old[k]!r} -> {new[k]!r})" for k in old if old[k] != new[k])
        raise ExtractError(
            f"{where} holds another run's output: {changed}",
            hint="resume with the same options, or choose another --out",
        )


def merge(config: RunConfig, manifests: list[bytes]) -> bytes:
    """``manifest.json``: the run and every shard's manifest (without the repeated run)."""
    shards = []
    for raw in manifests:
        entry = json.loads(raw)
        entry.pop("run")
        shards.append(entry)
    shards.sort(key=lambda e: int(e["shard"]))
    total = sum(len(e["ids"]) for e in shards)
    return _dump({"run": dataclasses.asdict(config), "samples": total, "shards": shards})


def _dump(data: Any) -> bytes:
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
