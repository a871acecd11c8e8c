"""Samples from JSONL: ``{"id", "text"}`` or ``{"id", "messages"}``, plain or gzip, local or remote.

A folder means every ``*.jsonl`` and ``*.jsonl.gz`` in it, in name order. A
malformed line (an empty text too: it has no tokens) is reported with its
file and line number and skipped, or is fatal with ``strict``; duplicate
ids are always fatal, before any compute.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tpupod.base.jsontext import lone_surrogate
from tpupod.errors import DataError

DATA_SUFFIXES = (".jsonl", ".jsonl.gz")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sample: its id and either its text or its chat messages."""

    id: str
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


@dataclasses.dataclass
class Samples:
    """What a data path holds: the samples in file order, a hash of the bytes, what was skipped."""

    samples: list[Sample]
    digest: str
    skipped: list[str]


def is_remote(path: str) -> bool:
    return "://" in path


def read_samples(
    path: str, strict: bool = False, on_skip: Callable[[str], None] = print
) -> Samples:
    """Read every sample under ``path`` (a file or a folder), checked."""
    files = _data_files(path)
    digest = hashlib.sha256()
    samples: list[Sample] = []
    skipped: list[str] = []
    for name, raw in files:
        digest.update(hashlib.sha256(raw).digest())
        for where, problem in _parse(name, raw, samples):
            message = f"{where}: {problem}"
            if strict:
                raise DataError(message, hint="fix the line, or drop --strict to skip such lines")
            skipped.append(message)
            on_skip(f"skipped {message}")
    _refuse_duplicates(samples)
    if not samples:
        raise DataError(
            f"no samples in {path}",
            hint='each line is {"id": ..., "text": ...} or {"id": ..., "messages": [...]}',
        )
    return Samples(samples, digest.hexdigest(), skipped)


def _data_files(path: str) -> list[tuple[str, bytes]]:
    """(name, bytes) of each data file under ``path``, gunzipped."""
    if is_remote(path):
        return _remote_files(path)
    local = Path(path)
    if local.is_dir():
        names = sorted(p for p in local.iterdir() if p.name.endswith(DATA_SUFFIXES))
        if not names:
            raise DataError(f"no *.jsonl or *.jsonl.gz files in {path}", hint="name them *.jsonl")
        return [(str(p), _gunzip(str(p), p.read_bytes())) for p in names]
    if not local.is_file():
        raise DataError(f"no data file {path}", hint="give a JSONL file or a folder of them")
    return [(path, _gunzip(path, local.read_bytes()))]


def _remote_files(path: str) -> list[tuple[str, bytes]]:
    # the model extra's: remote data (gs://) only
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    protocol = path.split("://", 1)[0]
    if fs.isdir(root):
        names = sorted(n for n in fs.ls(root, detail=False) if n.endswith(DATA_SUFFIXES))
    else:
        names = [root] if fs.exists(root) else []
    if not names:
        raise DataError(f"no data at {path}", hint="give a JSONL file or a folder of them")
    return [(f"{protocol}://{n}", _gunzip(n, fs.cat_file(n))) for n in names]


def _gunzip(name: str, raw: bytes) -> bytes:
    if not raw.startswith(b"\x1f\x8b"):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError) as exc:
        raise DataError(f"{name}: not a readable gzip file ({exc})", hint="recompress it") from exc


def _parse(name: str, raw: bytes, into: list[Sample]) -> list[tuple[str, str]]:
    """Append the file's samples to ``into``; return (file:line, problem) of bad lines."""
    problems = []
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if (problem := lone_surrogate(record, line)) is not None:
                raise ValueError(problem)  # the tokenizer's TypeError on a worker, else
            into.append(_sample(record))
        except (ValueError, TypeError) as exc:
            problems.append((f"{name}:{number}", str(exc).splitlines()[0]))
    return problems


def _sample(record: Any) -> Sample:
    if not isinstance(record, dict):
        raise ValueError("a line must be a JSON object")
    sample_id = record.get("id")
    if not isinstance(sample_id, str | int) or isinstance(sample_id, bool) or sample_id == "":
        raise ValueError('no "id" (a non-empty string or an integer)')
    text, messages = record.get("text"), record.get("messages")
    if (text is None) == (messages is None):
        raise ValueError('a line needs exactly one of "text" and "messages"')
    if text is not None:
        if not isinstance(text, str):
            raise ValueError('"text" must be a string')
        if not text:
            raise ValueError('"text" is empty: it has no tokens to extract')
        return Sample(str(sample_id), text=text)
    return Sample(str(sample_id), messages=_messages(messages))


def _messages(messages: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list')
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError('each message needs a "role" and a "content" string')
        if not isinstance(m.get("content"), str):
            raise ValueError('each message needs a "role" and a "content" string')
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def _refuse_duplicates(samples: list[Sample]) -> None:
    seen: set[str] = set()
    duplicates = []
    for s in samples:
        if s.id in seen:
            duplicates.append(s.id)
        seen.add(s.id)
    if duplicates:
        shown = ", ".join(repr(d) for d in duplicates[:5])
        more = f" and {len(duplicates) - 5} more" if len(duplicates) > 5 else ""
        raise DataError(
            f"duplicate sample ids: {shown}{more}",
            hint="every sample needs its own id (outputs and resume are keyed by it)",
        )
