"""Progress of one host's extraction: counters, and a line every few seconds on worker 0.

Workers run under ``tpupod run``, whose terminal shows each worker's lines
prefixed, so progress is a plain line (samples/s, tokens/s, bytes written,
writes pending, ETA) rather than a redrawn bar.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

EVERY_S = 2.0


@dataclasses.dataclass
class HostStats:
    host: int
    samples: int
    tokens: int
    bytes: int
    seconds: float


class Progress:
    def __init__(self, host: int, total: int, say: Callable[[str], None] | None) -> None:
        self.host = host
        self.total = total
        self.say = say
        self.samples = 0
        self.tokens = 0
        self.bytes = 0
        self.shards = 0
        self.pending: Callable[[], int] = lambda: 0
        self.start = time.monotonic()
        self._last = self.start

    def step(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        now = time.monotonic()
        if self.say is not None and now - self._last >= EVERY_S:
            self._last = now
            self.say(self.line(now))

    def written(self, n: int) -> None:  # called from the writer's thread
        self.bytes += n

    def shard_done(self) -> None:
        self.shards += 1

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.samples / elapsed
        eta = (self.total - self.samples) / rate if rate > 0 else float("inf")
        return (
            f"{self.samples}/{self.total} samples, {rate:.1f} samples/s, "
            f"{self.tokens / elapsed:.0f} tokens/s, {self.bytes / 1e6:.1f} MB written, "
            f"{self.pending()} writes pending, ETA {eta:.0f} s"
        )

    def finish(self) -> HostStats:
        return HostStats(
            self.host, self.samples, self.tokens, self.bytes, time.monotonic() - self.start
        )
