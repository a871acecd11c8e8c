"""Time series as small server-rendered SVG line charts (no script, no library), and times
and durations as every page shows them (Jinja filters; dashboard.js ticks the same format
on for what still runs)."""

from __future__ import annotations

import math
import time
from html import escape

from tpupod.base.durations import spoken

WIDTH, HEIGHT = 600, 150
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 8, 22  # room for the axes' labels
TITLES = {  # a series' key (NAME:WHAT) as a chart's title, and whether it is a share
    "reachable": ("{}: workers reachable", False),
    "load": ("{}: load per core", False),
    "memory": ("{}: memory in use", True),
    "jobs": ("jobs {}", False),
    "requests_per_s": ("{}: requests/s", False),
}


def title_of(key: str) -> tuple[str, bool]:
    """A series' title, and whether its values are shares (shown as %)."""
    kind, _, name = key.partition(":")
    form, share = TITLES.get(kind, ("{}", False))
    return form.format(name or kind), share


def line_chart(
    points: list[tuple[float, float]], title: str, share: bool = False, unit: str = ""
) -> str:
    """An SVG chart of ``points`` (time, value) with its axes: the values from 0 to a round
    top, and the times of its start, middle and end; "no data yet" when there are none.
    ``share``: values are fractions, shown as percentages."""
    label = escape(title)
    if not points:
        return f'<figure class="chart"><figcaption>{label}: no data yet</figcaption></figure>'
    scale, unit = (100.0, "%") if share else (1.0, unit)
    values = [v * scale for _, v in points]
    t0, t1 = points[0][0], points[-1][0]
    top = _round_up(max(values))
    span = max(t1 - t0, 1e-9)
    width, height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(t: float) -> float:
        return LEFT + (t - t0) / span * width

    def y(v: float) -> float:
        return TOP + height - v / top * height

    line = " ".join(f"{x(t):.1f},{y(v):.1f}" for (t, _), v in zip(points, values, strict=True))
    corner = f"{LEFT},{TOP + height}"
    marks = [
        f'<polyline class="grid" points="{LEFT},{TOP} {corner} {WIDTH - RIGHT},{TOP + height}"/>'
    ]
    for v in (0.0, top / 2, top):
        marks.append(
            f'<text class="axis y" x="{LEFT - 4}" y="{y(v) + 4:.1f}" text-anchor="end">'
            f"{v:.3g}{escape(unit)}</text>"
        )
    clock = "%H:%M" if t1 - t0 >= 600 else "%H:%M:%S"
    for t, anchor in ((t0, "start"), ((t0 + t1) / 2, "middle"), (t1, "end")):
        marks.append(
            f'<text class="axis x" x="{x(t):.1f}" y="{HEIGHT - 6}" text-anchor="{anchor}">'
            f"{time.strftime(clock, time.localtime(t))}</text>"
        )
    return (
        f'<figure class="chart"><figcaption>{label}: {values[-1]:.3g}{escape(unit)} now, '
        f"max {max(values):.3g}{escape(unit)}</figcaption>"
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{label}">'
        f'{"".join(marks)}<polyline fill="none" stroke="currentColor" stroke-width="2" '
        f'points="{line}"/></svg></figure>'
    )


def _round_up(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value`` (1 for none)."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(m * power for m in (1.0, 2.0, 5.0, 10.0) if m * power >= value)


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
    """``spoken`` (``12.3 s``, ``4 min 05 s``, ``2 h 07 min``, ``3 d 4 h``); "" for none."""
    return "" if seconds is None else spoken(seconds)


FILTERS = {"when": when, "iso": iso, "duration": duration}
