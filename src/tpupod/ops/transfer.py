"""``put`` and ``get``: files and folders to and from every worker, in parallel, atomically."""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
from collections.abc import Sequence
from pathlib import Path

from tpupod.base.files import put_target
from tpupod.errors import UsageError
from tpupod.fanout.execute import for_each
from tpupod.fanout.results import FanoutResult
from tpupod.pod.record import Pod, Worker
from tpupod.providers import Connector
from tpupod.transport import Transport


async def put(
    pod: Pod,
    local: Path,
    remote: str,
    *,
    workers: str | Sequence[Worker] | None = None,
    connector: Connector | None = None,
) -> FanoutResult:
    """Copy ``local`` (a file or folder) to ``remote`` on every worker."""
    if not await asyncio.to_thread(local.exists):
        raise UsageError(f"{local}: no such file or folder", hint="check the local path")
    _refuse_home(local, remote)
    files, size = await asyncio.to_thread(_measure, local)

    async def action(worker: Worker, transport: Transport) -> str:
        await transport.put(local, remote)
        return f"{files} file{'s' if files != 1 else ''}, {_human(size)}"

    return await for_each(pod, action, workers=workers, connector=connector)


# What a put must never replace: a worker's home (its relative paths' root), its parent, the
# root. A trial's `put train.py .` replaced each local worker's home with the file.
_NOT_REPLACED = frozenset({".", "..", "~", "/"})


def _refuse_home(local: Path, remote: str) -> None:
    target = put_target(local, remote)
    normal = posixpath.normpath(target) if target.strip() else "."
    if normal in _NOT_REPLACED or set(normal.split("/")) == {".."}:
        where = remote.strip().rstrip("/") or "."
        raise UsageError(
            f"put would replace {remote!r}: each worker's home, or a folder above it",
            hint=f"end the destination in / to put {local.name} inside it: {where}/",
        )


async def get(
    pod: Pod,
    remote: str,
    local_dir: Path,
    *,
    workers: str | Sequence[Worker] | None = None,
    connector: Connector | None = None,
) -> FanoutResult:
    """Copy ``remote`` from every worker into ``local_dir/worker-N/``."""
    name = posixpath.basename(remote.rstrip("/"))
    if not name or name in (".", ".."):
        raise UsageError(
            f"cannot tell what to name {remote!r} locally", hint="name a file or folder"
        )

    made_dir = not await asyncio.to_thread(local_dir.exists)

    async def action(worker: Worker, transport: Transport) -> str:
        folder = local_dir / f"worker-{worker.id}"
        made = not await asyncio.to_thread(folder.exists)
        try:
            await transport.get(remote, folder / name)
        except BaseException:
            if made:  # a failed copy leaves no empty worker-N folder behind
                await asyncio.to_thread(_remove_if_empty, folder)
            raise
        files, size = await asyncio.to_thread(_measure, folder / name)
        return f"{files} file{'s' if files != 1 else ''}, {_human(size)} -> {folder / name}"

    result = await for_each(pod, action, workers=workers, connector=connector)
    if made_dir:
        await asyncio.to_thread(_remove_if_empty, local_dir)
    return result


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty, or already gone
        folder.rmdir()


def _measure(path: Path) -> tuple[int, int]:
    if path.is_file():
        return 1, path.stat().st_size
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
