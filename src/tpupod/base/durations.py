"""Durations as people write them: ``90``, ``90s``, ``10m``, ``1h30m`` (light: the CLI and
the spec parse them on every call)."""

from __future__ import annotations

import re

from tpupod.errors import UsageError

_PART = re.compile(r"(\d+(?:\.\d+)?)([hms]?)")
_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "": 1.0}
HINT = "write seconds (90), or with units: 90s, 10m, 1h30m"


def parse_duration(text: str | float, what: str = "duration") -> float:
    """Seconds in ``text`` (a number is seconds); a UsageError naming ``what`` otherwise."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        words = str(text).strip().lower().replace(" ", "")
        parts = _PART.findall(words)
        if not words or "".join(n + u for n, u in parts) != words:
            raise UsageError(f"{what}: {text!r} is not a duration", hint=HINT)
        units = [u for _, u in parts]
        if len(parts) > 1 and ("" in units or len(set(units)) != len(units)):
            raise UsageError(f"{what}: {text!r} is not a duration", hint=HINT)
        seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise UsageError(f"{what}: {text!r} must be more than 0 seconds", hint=HINT)
    return seconds


def format_seconds(seconds: float) -> str:
    """``20s``, ``10m``, ``1h30m``: the short form of a duration."""
    whole = round(seconds)
    if whole < 60:
        return f"{seconds:g}s"
    if whole % 60 and whole < 600:
        return f"{whole // 60}m{whole % 60}s"
    hours, minutes = divmod(whole // 60, 60)
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes or not hours else "")


def spoken(seconds: float) -> str:
    """A length of time as a person reads it: ``12.3 s``, ``4 min 05 s``, ``2 h 07 min``,
    ``3 d 4 h`` (the dashboard's and ``jobs show``'s)."""
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
