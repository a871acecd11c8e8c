"""Where an extraction's outputs go: a folder (local, or an fsspec URL such as
``gs://BUCKET/PREFIX``, through ``tpupod.base.storage``), and the bounded background queue
that writes to it.

Every file is written whole under its final name only at the end: locally
staged beside it and renamed, remotely uploaded in one piece (an object
appears complete or not at all). A shard's manifest is queued after its
tensors, so a manifest present means the shard is complete.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path

from tpupod.base import storage
from tpupod.errors import ExtractError
from tpupod.extract.tensorfile import Buffer

QUEUE_DEPTH = 4  # shards waiting to be written before compute waits
WRITER_THREADS = 4


Data = bytes | list[Buffer]  # a whole file, or its parts in order


def size_of(data: Data) -> int:
    parts = [data] if isinstance(data, bytes) else data
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


class Store:
    """An output folder, its files by name. Open with ``open_store``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def write(self, name: str, data: Data) -> None:
        # no fsync: shards are large, and a run that dies redoes a shard without a manifest
        storage.write(storage.join(self.url, name), data, sync=False)

    def read(self, name: str) -> bytes | None:
        return storage.read(storage.join(self.url, name))

    def names(self) -> list[str]:
        return storage.names(self.url)

    def local_path(self, name: str) -> Path | None:
        return storage.local_path(storage.join(self.url, name))

    def remove_staged(self, names: list[str]) -> None:
        """What a killed run was writing under ``names`` (hidden, never under a final name)."""
        storage.remove_staged(self.url, names)


def open_store(where: str) -> Store:
    if storage.is_remote(where):
        storage.filesystem(where)  # a URL it cannot use is one line here
        return Store(where.rstrip("/"))
    folder = Path(where)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExtractError(f"cannot create {folder}: {exc.strerror}", hint="choose --out") from exc
    return Store(str(folder))


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
