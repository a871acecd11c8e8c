"""Copying files and folders so that nothing half-written ever sits under the final name."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path


def staging_name(dest: str | Path) -> str:
    """A hidden sibling of ``dest`` to write into before the final rename."""
    path = Path(dest)
    return str(path.with_name(f".{path.name}.tpupod-{secrets.token_hex(4)}"))


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
