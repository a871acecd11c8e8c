"""safetensors files as streams of buffers, and read back as numpy views.

The format (8 bytes of header length, a JSON header of dtype, shape and byte
offsets, then the raw bytes) is written here rather than with
``safetensors.numpy.save`` because a shard's tensors are concatenations of
per-sample rows: ``save`` would first concatenate them (one copy), then turn
each tensor into bytes (a second) and build the file in memory (a third);
streaming the rows costs none, which at a GPU's rate is the difference
(measured, BENCHMARKS.md). The files are ordinary safetensors: a test reads
them with the safetensors library. The reader memory-maps a local file and
views a fetched one, so a layer of a shard is one ``np.memmap``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "int64": "I64"}
_NAMES = {code: name for name, code in _CODES.items()}

Buffer = bytes | memoryview


def encode(tensors: dict[str, Sequence[np.ndarray]]) -> list[Buffer]:
    """The file as buffers to write in order; each tensor is its parts concatenated
    along the first axis (parts share dtype and trailing shape)."""
    header: dict[str, Any] = {}
    chunks: list[Buffer] = []
    offset = 0
    for name, parts in tensors.items():
        first = parts[0]
        rows = sum(p.shape[0] for p in parts)
        size = sum(p.nbytes for p in parts)
        header[name] = {
            "dtype": _CODES[first.dtype.name],
            "shape": [rows, *first.shape[1:]],
            "data_offsets": [offset, offset + size],
        }
        offset += size
        chunks += [_bytes_of(p) for p in parts if p.nbytes]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return [struct.pack("<Q", len(raw)), raw, *chunks]


def _bytes_of(array: np.ndarray) -> memoryview:
    """The array's bytes without a copy (bfloat16 has no buffer format: viewed as bytes)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


class TensorFile:
    """Tensors of one safetensors file as numpy views: an ``np.memmap`` of a local
    file, or slices of the bytes of a fetched one."""

    def __init__(self, path: Path | None, raw: bytes | None) -> None:
        if path is not None:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = f.read(size)
            self.data: np.ndarray = np.memmap(path, np.uint8, "r", offset=8 + size)
        else:
            raw = raw or b""
            (size,) = struct.unpack("<Q", raw[:8])
            header = raw[8 : 8 + size]
            self.data = np.frombuffer(raw, np.uint8, offset=8 + size)
        self.header: dict[str, Any] = json.loads(header)
        self.header.pop("__metadata__", None)

    def tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        start, end = info["data_offsets"]
        view: np.ndarray = self.data[start:end].view(_dtype(info["dtype"])).reshape(info["shape"])
        return view


def _dtype(code: str) -> np.dtype[Any]:
    if code == "BF16":
        # comes with JAX (the model extra): bfloat16 only
        import ml_dtypes

        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    return np.dtype(_NAMES[code])
