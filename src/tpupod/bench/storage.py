"""Where results live: a local folder, or a ``gs://`` (any fsspec) URL.

Local files are written atomically (a temporary file, then a rename); an
object store's object appears whole when its upload ends. Remote URLs go
through fsspec (gcsfs for ``gs://``), imported only when one is used.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

from tpupod.errors import UsageError
from tpupod.files import write_atomic


def is_remote(location: str) -> bool:
    return "://" in location


def join(location: str, *parts: str) -> str:
    if is_remote(location):
        return posixpath.join(location, *parts)
    return str(Path(location).joinpath(*parts))


def _fs(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError as exc:
        raise UsageError(
            f"{url}: remote storage needs fsspec", hint="pip install 'tpupod[checkpoint-bench]'"
        ) from exc
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise UsageError(f"{url}: {exc}", hint="gs:// needs gcsfs") from exc
    return fs, path


def write(location: str, data: bytes) -> None:
    if not is_remote(location):
        write_atomic(Path(location), data, mode=0o644)
        return
    fs, path = _fs(location)
    fs.pipe_file(path, data)  # an object appears whole, when its upload ends


def write_text(location: str, text: str) -> None:
    if is_remote(location):
        write(location, text.encode())
    else:
        write_atomic(Path(location), text, mode=0o644)


def read_text(location: str) -> str:
    if not is_remote(location):
        return Path(location).read_text()
    fs, path = _fs(location)
    data: bytes = fs.cat_file(path)
    return data.decode()


def glob(location: str, pattern: str) -> list[str]:
    """Files under ``location`` matching ``pattern``, as locations of the same kind."""
    if not is_remote(location):
        return [str(p) for p in Path(location).glob(pattern)]
    fs, path = _fs(location)
    protocol = location.split("://", 1)[0]
    return [f"{protocol}://{p}" for p in fs.glob(posixpath.join(path, pattern))]


def check_writable(location: str, what: str) -> None:
    """Write and remove a probe object under a remote ``location``: a missing bucket or
    missing rights is one line here, before any worker starts (not a worker's traceback)."""
    fs, path = _fs(location)
    probe = posixpath.join(path, ".tpupod-probe")
    try:
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except (OSError, ValueError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(
            f"{what} {location}: cannot write there ({why})",
            hint="name a bucket that exists and that these credentials can write",
        ) from exc
