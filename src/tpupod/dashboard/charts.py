"""Time series as small server-rendered SVG line charts (no script, no library)."""

from __future__ import annotations

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
