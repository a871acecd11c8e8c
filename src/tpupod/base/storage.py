"""Where outputs live: a local folder or an fsspec URL (``gs://BUCKET/PREFIX``, ``memory://``),
behind one set of calls. Extraction outputs (``extract/store.py``) and benchmark results
(``bench/``) both go through it.

A location is a string: a local path, or a URL (anything with ``://``), which goes
through fsspec (gcsfs for ``gs://``), imported only when one is used. Nothing
half-written sits under a final name: a local file is staged beside it under a name of
its own and renamed (``files.write_atomic``: two writers never share a staging file), and
an object store's object appears whole when its upload ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tpupod.base.files import write_atomic
from tpupod.errors import UsageError

Data = str | bytes | Iterable[bytes | memoryview]  # text, bytes, or parts written in turn


def is_remote(location: str) -> bool:
    return "://" in location


def join(location: str, *parts: str) -> str:
    if is_remote(location):
        return posixpath.join(location, *parts)
    return str(Path(location).joinpath(*parts))


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path in it; a one-line error without fsspec."""
    try:
        # an extra's (model, checkpoint-bench): where a path is opened, a clear error without it
        import fsspec
    except ImportError as exc:
        raise UsageError(
            f"{url}: remote storage needs fsspec",
            hint="pip install 'tpupod[checkpoint-bench]' or 'tpupod[model]'",
        ) from exc
    if not url.split("://", 1)[1].strip("/"):
        raise UsageError(f"{url}: no bucket or path", hint="name one: gs://BUCKET/PREFIX")
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise UsageError(f"{url}: {exc}", hint="gs:// needs gcsfs: pip install gcsfs") from exc
    except ValueError as exc:
        raise UsageError(
            f"{url}: {exc}", hint="give a local folder or an fsspec URL such as gs://BUCKET/PREFIX"
        ) from exc
    return fs, path


def write(location: str, data: Data, *, sync: bool = True) -> None:
    """Write a whole file. ``sync`` (local only): on disk before it takes the final name."""
    if not is_remote(location):
        write_atomic(Path(location), data, mode=0o644, sync=sync)
        return
    fs, path = filesystem(location)
    with fs.open(path, "wb") as f:  # one object, complete or absent
        for part in [data] if isinstance(data, str | bytes) else data:
            f.write(part.encode() if isinstance(part, str) else part)


def read(location: str) -> bytes | None:
    """The file's bytes, or None when there is none."""
    if not is_remote(location):
        with contextlib.suppress(FileNotFoundError):
            return Path(location).read_bytes()
        return None
    fs, path = filesystem(location)
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        return None


def read_text(location: str) -> str:
    """The file's text; FileNotFoundError when there is none."""
    data = read(location)
    if data is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), location)
    return data.decode()


def exists(location: str) -> bool:
    if not is_remote(location):
        return Path(location).exists()
    fs, path = filesystem(location)
    return bool(fs.exists(path))


def names(folder: str) -> list[str]:
    """The names in ``folder`` (sorted, hidden ones left out); none when it is not there."""
    if not is_remote(folder):
        with contextlib.suppress(FileNotFoundError):
            return sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("."))
        return []
    fs, path = filesystem(folder)
    try:
        found = fs.ls(path, detail=False, refresh=True)  # refresh: not a listing cached earlier
    except FileNotFoundError:
        return []
    visible = (str(n).rsplit("/", 1)[-1] for n in found)
    return sorted(n for n in visible if not n.startswith("."))


def glob(location: str, pattern: str) -> list[str]:
    """Files under ``location`` matching ``pattern``, as locations of the same kind."""
    if not is_remote(location):
        return [str(p) for p in Path(location).glob(pattern)]
    fs, path = filesystem(location)
    protocol = location.split("://", 1)[0]
    return [f"{protocol}://{p}" for p in fs.glob(posixpath.join(path, pattern))]


def remove(location: str) -> None:
    """Remove a file, if it is there."""
    if not is_remote(location):
        Path(location).unlink(missing_ok=True)
        return
    fs, path = filesystem(location)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


def remove_tree(location: str) -> None:
    """Remove a folder and all it holds, if it is there."""
    if not is_remote(location):
        shutil.rmtree(location, ignore_errors=True)
        return
    fs, path = filesystem(location)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)


def local_path(location: str) -> Path | None:
    """The local file to open or memory-map, or None for a remote one (read it whole)."""
    return None if is_remote(location) else Path(location)


def remove_staged(folder: str, names: Iterable[str]) -> None:
    """What a killed writer left staged for ``names`` in a local ``folder`` (hidden, never
    under a final name). An object store keeps no half-written objects: nothing to do."""
    if is_remote(folder):
        return
    for name in names:
        for staged in Path(folder).glob(f".{name}.tpupod-*"):  # files.staging_name's pattern
            staged.unlink(missing_ok=True)


def check_writable(location: str, what: str) -> None:
    """Write and remove a probe object under a remote ``location``: a missing bucket or
    missing rights is one line here, before any worker starts (not a worker's traceback)."""
    probe = join(location, ".tpupod-probe")
    try:
        write(probe, b"")
        remove(probe)
    except (OSError, ValueError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(
            f"{what} {location}: cannot write there ({why})",
            hint="name a bucket that exists and that these credentials can write",
        ) from exc
