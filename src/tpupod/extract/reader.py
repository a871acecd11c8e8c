"""Read an extraction back: ``tpupod.extract.open(PATH)`` (a folder or a gs:// prefix).

The merged ``manifest.json`` says where each sample is; a run still going (or
killed) has no merged manifest yet, so the committed shards' manifests are
read instead. Local shards are memory-mapped (a layer of a shard is one
``np.memmap`` into the safetensors file, no copy); remote shards are fetched
once each and kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tpupod.errors import ExtractError
from tpupod.extract import shards
from tpupod.extract.store import Store, open_store
from tpupod.extract.tensorfile import TensorFile


class Dataset:
    """Activations by sample id: ``ids`` (in the data's order), ``layers``,
    ``activations``, ``tokens``, ``completion`` and ``completion_tokens`` (with
    ``--generate``), ``cut`` (ids cut to --max-length), and ``layer(shard, layer)``
    for bulk reads. An id given as an integer in the data is found by that integer."""

    def __init__(self, store: Store) -> None:
        self._store = store
        entries = _entries(store)
        if not entries:
            raise ExtractError(
                f"no extraction output at {store.url}", hint="give the --out of 'tpupod extract'"
            )
        self.shards: list[dict[str, Any]] = entries
        self.layers: list[int] = list(entries[0]["layers"])
        self.dtype: str = entries[0]["dtype"]
        self._where: dict[str, tuple[int, int]] = {}
        place: dict[str, int] = {}
        for n, entry in enumerate(entries):
            # format 1 had no positions: shard order then
            positions = entry.get("positions") or range(len(place), len(place) + len(entry["ids"]))
            for i, (sample_id, position) in enumerate(zip(entry["ids"], positions, strict=True)):
                self._where[sample_id] = (n, i)
                place[sample_id] = position
        self.ids: list[str] = sorted(place, key=place.__getitem__)
        self.cut: list[str] = sorted(
            (i for entry in entries for i in entry.get("cut", [])), key=place.__getitem__
        )
        self._files: dict[int, TensorFile] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def activations(self, sample_id: str | int, layer: int) -> np.ndarray:
        """``[tokens, d_model]``: that sample's real tokens at hidden state ``layer``."""
        n, i = self._find(sample_id)
        if layer not in self.layers:
            raise ExtractError(f"layer {layer} was not extracted", hint=f"one of {self.layers}")
        entry = self.shards[n]
        return self._file(n).tensor(f"hidden.{layer}")[
            entry["offsets"][i] : entry["offsets"][i + 1]
        ]

    def tokens(self, sample_id: str | int) -> np.ndarray:
        n, i = self._find(sample_id)
        entry = self.shards[n]
        return self._file(n).tensor("tokens")[entry["offsets"][i] : entry["offsets"][i + 1]]

    def completion(self, sample_id: str | int) -> str:
        n, i = self._find(sample_id)
        completions = self.shards[n].get("completions")
        if completions is None:
            raise ExtractError(
                "this extraction has no completions", hint="extract with --generate N"
            )
        return str(completions[i])

    def completion_tokens(self, sample_id: str | int) -> list[int]:
        n, i = self._find(sample_id)
        self.completion(sample_id)  # says so when there are none
        return list(self.shards[n]["completion_tokens"][i])

    def layer(self, shard: int, layer: int) -> np.ndarray:
        """All of one shard's tokens at ``layer`` (memory-mapped when local); rows per sample
        are given by ``self.shards[shard]["offsets"]``."""
        return self._file(shard).tensor(f"hidden.{layer}")

    def _find(self, sample_id: str | int) -> tuple[int, int]:
        try:
            return self._where[str(sample_id)]  # ids are kept as text, as the data's ints too
        except KeyError:
            raise ExtractError(f"no sample {sample_id!r}", hint="see ds.ids") from None

    def _file(self, n: int) -> TensorFile:
        if n not in self._files:
            name = self.shards[n]["file"]
            local = self._store.local_path(name)
            raw = None if local is not None else self._store.read(name)
            self._files[n] = TensorFile(local, raw)
        return self._files[n]


def _entries(store: Store) -> list[dict[str, Any]]:
    merged = store.read(shards.MANIFEST_FILE)
    if merged is not None:
        return list(json.loads(merged)["shards"])
    found = []
    for name in store.names():
        if name.startswith("shard-") and name.endswith(".json"):
            raw = store.read(name)
            if raw is not None:
                found.append(json.loads(raw))
    return sorted(found, key=lambda e: int(e["shard"]))


def open(path: str) -> Dataset:
    """Open an extraction's output folder or ``gs://`` prefix."""
    return Dataset(open_store(path) if "://" in path else _existing(path))


def _existing(path: str) -> Store:
    if not Path(path).is_dir():
        raise ExtractError(f"no folder {path}", hint="give the --out of 'tpupod extract'")
    return open_store(path)
