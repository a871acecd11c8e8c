"""Times and durations as the pages show them (Jinja filters; dashboard.js ticks the same
format on for what still runs)."""

from __future__ import annotations

import time


def when(epoch: float | None) -> str:
    """A moment in this machine's local time, to the second; "" for none."""
    if epoch is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def iso(epoch: float | None) -> str:
    """The same moment for a ``<time datetime>`` attribute (UTC)."""
    if epoch is None:
        return ""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def duration(seconds: float | None) -> str:
    """``12.3 s``, ``4 min 05 s``, ``2 h 07 min``, ``3 d 4 h``; "" for none."""
    if seconds is None:
        return ""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


FILTERS = {"when": when, "iso": iso, "duration": duration}
