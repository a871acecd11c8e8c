"""Between the launcher and the workers: the plan going out, worker 0's results coming back.

The plan travels in the environment (``TPUPOD_BENCH_PLAN``), so nothing has to
be copied to the workers first. The results come back as output lines of
worker 0 (``tpupod-bench-results I/N CHUNK``: compressed JSON in base64,
chunks well under the 64 KiB a line may hold), so they reach the launcher the
same way on a local pod, over SSH, and on a Cloud TPU, with no shared disk.
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

from pydantic import BaseModel

from tpupod.bench.results import Results

MARKER = "tpupod-bench-results "
CHUNK = 48 * 1024


class Plan(BaseModel):
    """What every worker runs."""

    config: dict[str, Any]
    source: str  # the config file's name, for messages
    checkpoint_dir: str  # where checkpoints go: a folder every worker sees (or a ramfs)
    commit: str
    pod: str


def encode(results: Results) -> list[str]:
    data = base64.b64encode(zlib.compress(results.model_dump_json().encode())).decode()
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [""]
    return [f"{MARKER}{i + 1}/{len(chunks)} {chunk}" for i, chunk in enumerate(chunks)]


class Collector:
    """Gathers worker 0's result lines as they arrive; ``results`` once all have."""

    def __init__(self) -> None:
        self._chunks: dict[int, str] = {}
        self._count = 0

    def feed(self, text: str) -> bool:
        """Take a line if it is one of ours (True), else leave it (False)."""
        if not text.startswith(MARKER):
            return False
        position, _, chunk = text[len(MARKER) :].partition(" ")
        index, _, count = position.partition("/")
        self._chunks[int(index)] = chunk
        self._count = int(count)
        return True

    def results(self) -> Results | None:
        if not self._count or len(self._chunks) != self._count:
            return None
        data = "".join(self._chunks[i] for i in range(1, self._count + 1))
        return Results.model_validate_json(zlib.decompress(base64.b64decode(data)))
