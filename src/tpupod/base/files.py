"""Copying files and folders so that nothing half-written ever sits under the final name."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable
from pathlib import Path


def staging_name(dest: str | Path) -> str:
    """A hidden sibling of ``dest`` to write into before the final rename."""
    path = Path(dest)
    return str(path.with_name(f".{path.name}.tpupod-{os.urandom(4).hex()}"))


def copy_atomic(src: Path, dest: Path) -> None:
    """Copy a file or a folder to ``dest``: staged beside it, then renamed into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(staging_name(dest))
    try:
        if src.is_dir():
            shutil.copytree(src, staged, symlinks=True)
        else:
            shutil.copy2(src, staged)
        replace(staged, dest)
    finally:
        remove_path(staged)


def write_atomic(
    path: Path,
    data: str | bytes | Iterable[bytes | memoryview],
    *,
    mode: int = 0o600,
    sync: bool = True,
) -> None:
    """Write ``data`` (text, bytes, or parts of bytes written in turn) to ``path`` so that
    readers see the old file or the new one, never half: written under a name of its own
    beside it (two writers never share one), then renamed. ``sync``: on disk before the
    rename (a crash then leaves the old file or the whole new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_name(path)  # the one pattern of staged files (a resume removes them)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # not narrowed by the umask
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, str):
                f.write(data.encode())
            elif isinstance(data, bytes):
                f.write(data)
            else:
                for part in data:
                    f.write(part)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None and exc.errno is not None:  # a failed write (a full disk)
            raise OSError(exc.errno, exc.strerror, str(path)) from exc  # names the file
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_path(path: Path) -> None:
    """Remove a file or a folder, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace(staged: Path, dest: Path) -> None:
    """Move ``staged`` to ``dest``; an existing folder there is moved aside, then removed."""
    if dest.is_dir() and not dest.is_symlink():
        old = Path(staging_name(dest))
        os.rename(dest, old)
        os.rename(staged, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, dest)


def put_target(local: Path, remote: str) -> str:
    """``REMOTE`` as a path: a trailing slash means "inside that folder", as with cp."""
    return remote + local.name if remote.endswith("/") else remote


# A put replaces a folder whole only with a folder: a file where a folder is would lose the
# folder's contents (a trial's `put train.py results`). Every transport says it in these words.
def file_over_folder(local: Path, target: str) -> tuple[str, str]:
    """The reason and hint of a refused put of the file ``local`` where the folder
    ``target`` is."""
    return (
        f"{target} is a folder, and a file does not replace one",
        f"end the destination in / to put {local.name} inside it: {target.rstrip('/')}/",
    )


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
ROOM_PROBE_BYTES = 256 * 1024  # a run's records and its next launch's first lines


def full(folder: Path) -> bool:
    """Whether ``folder``'s disk has less than ``ROOM_PROBE_BYTES`` left for an ordinary
    writer (statvfs: nothing is written, so a status may ask it each time; a quota is not
    seen, as :func:`no_room` sees it)."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize < ROOM_PROBE_BYTES


def no_room(folder: Path) -> OSError | None:
    """Why ``folder``'s disk cannot take a few hundred KB now (full, or over quota), or
    None: a probe file is written, synced and removed."""
    probe = Path(staging_name(folder / "room-probe"))
    try:
        with probe.open("wb") as f:
            f.write(bytes(ROOM_PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if exc.errno in FULL_DISK:
            return exc
        raise
    finally:
        probe.unlink(missing_ok=True)
    return None
