"""Line charts of a quantity over equal time slices (the fleet page's throughput and
latency), drawn server-side as SVG: a value axis with its unit, a clock axis, the time
range it covers and a legend. A slice without a value leaves a gap in its line."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from html import escape
from typing import Any

WIDTH, HEIGHT = 760, 230
LEFT, TOP, RIGHT, BOTTOM = 64, 30, 520, 186
X_TICKS = 4


def nice_scale(top: float) -> list[float]:
    """Value-axis ticks from 0 to at least ``top``: about four, 1, 2 or 5 times 10ⁿ apart."""
    if top <= 0 or not math.isfinite(top):
        top = 1.0
    raw = top / 4
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    return [round(i * step, 10) for i in range(math.ceil(top / step - 1e-9) + 1)]


def _number(value: float) -> str:
    return f"{value:g}" if value < 1000 else f"{value:,.0f}"


def _clock(when: datetime, window: timedelta) -> str:
    utc = when.astimezone(UTC)
    return f"{utc:%H:%M:%S}" if window <= timedelta(minutes=10) else f"{utc:%H:%M}"


def trend_chart(
    *,
    chart_id: str,
    title: str,
    unit: str,
    values: Sequence[Mapping[str, Any]],
    series: Sequence[tuple[str, str, str]],
    until: datetime,
    window: timedelta,
) -> str:
    """``values``: one mapping per slice, oldest first; ``series``: (key, legend label,
    colour). Slice ``i`` of ``n`` covers ``until - window + i·window/n`` onwards."""
    count = max(len(values), 1)
    found = [float(v[key]) for v in values for key, _, _ in series if v.get(key) is not None]
    ticks = nice_scale(max(found, default=0.0))
    top = ticks[-1]
    start = until - window

    def x(index: float) -> float:
        return round(LEFT + (index / count) * (RIGHT - LEFT), 1)

    def y(value: float) -> float:
        return round(BOTTOM - (value / top) * (BOTTOM - TOP), 1)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="{escape(chart_id)}" class="chart trend" '
        f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)}" font-family="system-ui, sans-serif">',
        f'<text class="chart-title" x="{LEFT}" y="16" font-size="12" fill="#222">'
        f"{escape(title)}</text>",
        f'<text class="time-range" x="{RIGHT}" y="16" font-size="11" fill="#555" '
        f'text-anchor="end">{_clock(start, window)} - {_clock(until, window)} UTC</text>',
        '<g class="axis y-axis" font-size="11" fill="#555">',
        f'<line class="axis-line" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{BOTTOM}" stroke="#555"/>',
    ]
    for value in ticks:
        parts.append(
            f'<g class="tick" data-value="{value:g}"><line x1="{LEFT - 5}" y1="{y(value)}" '
            f'x2="{RIGHT}" y2="{y(value)}" stroke="#eee"/><text class="tick-label" '
            f'x="{LEFT - 8}" y="{y(value) + 4}" text-anchor="end">{_number(value)}</text></g>'
        )
    middle = (TOP + BOTTOM) / 2
    parts.append(
        f'<text class="axis-title" x="14" y="{middle}" text-anchor="middle" '
        f'transform="rotate(-90 14 {middle})">{escape(unit)}</text></g>'
    )
    parts.append(
        '<g class="axis x-axis" font-size="11" fill="#555">'
        f'<line class="axis-line" x1="{LEFT}" y1="{BOTTOM}" x2="{RIGHT}" y2="{BOTTOM}" '
        'stroke="#555"/>'
    )
    for i in range(X_TICKS + 1):
        at = start + window * i / X_TICKS
        tx = x(count * i / X_TICKS)
        parts.append(
            f'<g class="tick"><line x1="{tx}" y1="{BOTTOM}" x2="{tx}" y2="{BOTTOM + 5}" '
            f'stroke="#555"/><text class="tick-label" x="{tx}" y="{BOTTOM + 18}" '
            f'text-anchor="middle">{_clock(at, window)}</text></g>'
        )
    parts.append(
        f'<text class="axis-title" x="{(LEFT + RIGHT) / 2}" y="{HEIGHT - 6}" '
        'text-anchor="middle">time (UTC)</text></g>'
    )
    parts.append('<g class="series" fill="none" stroke-width="2" stroke-linejoin="round">')
    for key, _, colour in series:
        path: list[str] = []
        dots: list[str] = []
        move = True
        for i, v in enumerate(values):
            point = v.get(key)
            if point is None:
                move = True
                continue
            path.append(f"{'M' if move else 'L'}{x(i + 0.5)},{y(float(point))}")
            if float(point) > 0:  # a lone slice shows as a dot
                dots.append(f'<circle cx="{x(i + 0.5)}" cy="{y(float(point))}" r="2.5"/>')
            move = False
        parts.append(
            f'<path class="line" data-series="{escape(key)}" stroke="{colour}" '
            f'd="{" ".join(path)}"/><g class="dots" data-series="{escape(key)}" '
            f'fill="{colour}" stroke="none">{"".join(dots)}</g>'
        )
    parts.append('</g><g class="legend" font-size="12" fill="#222">')
    for i, (key, label, colour) in enumerate(series):
        ly = TOP + 10 + i * 20
        last = next((v.get(key) for v in reversed(values) if v.get(key) is not None), None)
        shown = "-" if last is None else _number(round(float(last), 3))
        parts.append(
            f'<g class="legend-item" data-series="{escape(key)}"><line x1="{RIGHT + 20}" '
            f'y1="{ly}" x2="{RIGHT + 40}" y2="{ly}" stroke="{colour}" stroke-width="3"/>'
            f'<text x="{RIGHT + 46}" y="{ly + 4}">{escape(label)} <tspan class="legend-value" '
            f'font-weight="bold">{shown}</tspan></text></g>'
        )
    parts.append("</g></svg>")
    return "".join(parts)
