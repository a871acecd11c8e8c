"""Progress of one host's extraction: counters, and a line every few seconds.

Worker 0 says a plain line (samples/s, tokens/s, bytes written, writes
pending, ETA), which a log keeps. Every host also prints a progress marker
(``tpupod.fanout.progress``) as often and when it ends: the launcher turns those
into a live table of every host on its terminal (samples done, samples/s, ETA),
or into plain per-host lines when its output is no terminal, and leaves worker
0's own line out of both (each count was said twice, in two formats).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from tpupod import settings
from tpupod.fanout.progress import marker, seconds_text


@dataclasses.dataclass
class HostStats:
    host: int
    samples: int
    tokens: int
    bytes: int
    seconds: float


class Progress:
    def __init__(
        self,
        host: int,
        total: int,
        say: Callable[[str], None] | None,
        mark: Callable[[str], None] | None = None,
    ) -> None:
        self.host = host
        self.total = total
        self.say = say
        self.mark = mark
        self.samples = 0
        self.tokens = 0
        self.bytes = 0
        self.shards = 0
        self.pending: Callable[[], int] = lambda: 0
        self.every = settings.progress_every_s()
        self.start = time.monotonic()
        self._last = self.start
        self._marked = self.start
        self._marker(self.start)

    def step(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        now = time.monotonic()
        if self.say is not None and now - self._last >= self.every:
            self._last = now
            self.say(self.line(now))
        # the last count is the end's to mark, with the bytes written after it (said once)
        if now - self._marked >= self.every and self.samples < self.total:
            self._marker(now)

    def _marker(self, now: float) -> None:
        if self.mark is None:
            return
        self._marked = now
        elapsed = max(now - self.start, 1e-9)
        doing = (
            f"{self.tokens / elapsed:.0f} tokens/s, {self.bytes / 1e6:.1f} MB written, "
            f"{self.pending()} writes pending"
        )
        self.mark(marker(self.samples, self.total, "samples", doing))

    def written(self, n: int) -> None:  # called from the writer's thread
        self.bytes += n

    def shard_done(self) -> None:
        self.shards += 1

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.samples / elapsed
        eta = (self.total - self.samples) / rate if rate > 0 else None
        return (
            f"{self.samples}/{self.total} samples, {rate:.1f} samples/s, "
            f"{self.tokens / elapsed:.0f} tokens/s, {self.bytes / 1e6:.1f} MB written, "
            f"{self.pending()} writes pending, ETA {seconds_text(eta)}"
        )

    def finish(self) -> HostStats:
        self._marker(time.monotonic())
        return HostStats(
            self.host, self.samples, self.tokens, self.bytes, time.monotonic() - self.start
        )
