"""Time series as small server-rendered SVG line charts (no script, no library), and times
and durations as every page shows them (Jinja filters; dashboard.js ticks the same format
on for what still runs)."""

from __future__ import annotations

import time
from html import escape

WIDTH, HEIGHT, PAD = 600, 120, 4


def line_chart(points: list[tuple[float, float]], title: str, unit: str = "") -> str:
    """An SVG chart of ``points`` (time, value); "no data yet" when there are none."""
    label = escape(title)
    if not points:
        return f'<figure class="chart"><figcaption>{label}: no data yet</figcaption></figure>'
    t0, t1 = points[0][0], points[-1][0]
    top = max([v for _, v in points] + [1e-9])
    span = max(t1 - t0, 1e-9)
    xy = " ".join(
        f"{PAD + (t - t0) / span * (WIDTH - 2 * PAD):.1f},"
        f"{HEIGHT - PAD - v / top * (HEIGHT - 2 * PAD):.1f}"
        for t, v in points
    )
    last = points[-1][1]
    return (
        f'<figure class="chart"><figcaption>{label}: {last:.3g}{escape(unit)} now, '
        f"max {top:.3g}{escape(unit)}</figcaption>"
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{label}" '
        f'preserveAspectRatio="none"><polyline fill="none" stroke="currentColor" '
        f'stroke-width="2" points="{xy}"/></svg></figure>'
    )


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
