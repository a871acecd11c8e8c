"""Where outputs go: a local folder or an fsspec URL (``gs://BUCKET/PREFIX``), and the
bounded background queue that writes to it.

Every file is written whole under its final name only at the end: locally
staged beside it and renamed, remotely uploaded in one piece (an object
appears complete or not at all). A shard's manifest is queued after its
tensors, so a manifest present means the shard is complete.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tpupod.errors import ExtractError
from tpupod.extract.tensorfile import Buffer
from tpupod.files import write_atomic

QUEUE_DEPTH = 4  # shards waiting to be written before compute waits
WRITER_THREADS = 4


Data = bytes | list[Buffer]  # a whole file, or its parts in order


def _parts(data: Data) -> list[Buffer]:
    return [data] if isinstance(data, bytes) else data


def size_of(data: Data) -> int:
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in _parts(data))


class Store(Protocol):
    url: str

    def write(self, name: str, data: Data) -> None: ...
    def read(self, name: str) -> bytes | None: ...
    def names(self) -> list[str]: ...
    def local_path(self, name: str) -> Path | None: ...


class LocalStore:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.url = str(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ExtractError(
                f"cannot create {folder}: {exc.strerror}", hint="choose --out"
            ) from exc

    def write(self, name: str, data: Data) -> None:
        # no fsync: shards are large, and a run that dies redoes a shard without a manifest
        write_atomic(self.folder / name, _parts(data), mode=0o644, sync=False)

    def read(self, name: str) -> bytes | None:
        with contextlib.suppress(FileNotFoundError):
            return (self.folder / name).read_bytes()
        return None

    def names(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir() if not p.name.startswith("."))

    def local_path(self, name: str) -> Path | None:
        return self.folder / name

    def remove_staged(self, names: list[str]) -> None:
        """What a killed run was writing under ``names`` (hidden, never under a final name)."""
        for name in names:
            for p in self.folder.glob(f".{name}.tpupod-*"):
                p.unlink(missing_ok=True)


class FsspecStore:
    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.fs: Any
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    def write(self, name: str, data: Data) -> None:
        with self.fs.open(f"{self.root}/{name}", "wb") as f:  # one object, complete or absent
            for part in _parts(data):
                f.write(part)

    def read(self, name: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(f"{self.root}/{name}"))
        except FileNotFoundError:
            return None

    def names(self) -> list[str]:
        try:
            found = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(str(n).rsplit("/", 1)[-1] for n in found)

    def local_path(self, name: str) -> Path | None:
        return None


def open_store(where: str) -> LocalStore | FsspecStore:
    if "://" in where:
        return FsspecStore(where)
    return LocalStore(Path(where))


class Writer:
    """Writes (name, data) groups on ``WRITER_THREADS`` threads, each group in order (a
    shard's tensors, then its manifest); ``put`` waits only when ``QUEUE_DEPTH`` groups
    are already pending. An error in a thread comes back at the next ``put`` or at
    ``close``. Several threads because one thread's writes (a memcpy into the page
    cache, or one upload) run slower than a GPU produces activations."""

    def __init__(self, store: Store, on_written: Callable[[int], None] = lambda n: None) -> None:
        self.store = store
        self.on_written = on_written
        self._queue: queue.Queue[list[tuple[str, Data]] | None] = queue.Queue(QUEUE_DEPTH)
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"tpupod-extract-writer-{n}", daemon=True)
            for n in range(WRITER_THREADS)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def put(self, files: list[tuple[str, Data]]) -> None:
        self._raise()
        self._queue.put(files)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise ExtractError(
                f"writing to {self.store.url} failed: {self._error}",
                hint="check the output location (space, permissions); rerun to resume",
            ) from self._error

    def _run(self) -> None:
        while (files := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                for name, data in files:
                    self.store.write(name, data)
                    with self._lock:
                        self.on_written(size_of(data))
            except Exception as exc:  # reported to the computing thread, with its cause
                self._error = exc
