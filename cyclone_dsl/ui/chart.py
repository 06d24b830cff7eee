"""The queues page's live chart: the SVG frame (axes, ticks, legend) drawn server-side.

The chart plots the steps of every queue (the ``cyclone_v_queues`` columns
``available``, ``running`` and ``waiting``, summed) over the last
:data:`WINDOW_S` seconds. The page's script (``static/cyclone.js``) samples
``/api/stats`` every two seconds, keeps the samples of that window, and redraws
the series, the count (y) axis, the legend values and the time range in the same
markup, reading the plot's geometry from the ``data-*`` attributes of the
``<svg>`` so that the two never disagree. Without the script the frame still
shows the current totals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

#: Series drawn, in legend order: the column of ``cyclone_v_queues`` and its colour.
SERIES = (("available", "#1565c0"), ("running", "#2e7d32"), ("waiting", "#ad1457"))
WIDTH, HEIGHT = 680, 240
#: The plot area (the axes are its left and bottom sides).
LEFT, TOP, RIGHT, BOTTOM = 64, 30, 520, 196
#: Seconds of history the time (x) axis spans, and its tick spacing.
WINDOW_S, X_TICK_S = 120, 30


def nice_ticks(top: float) -> list[int]:
    """Count-axis ticks from 0 to at least ``top``: about five, 1, 2 or 5 times 10ⁿ apart."""
    top = max(1, math.ceil(top))
    raw = top / 4
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    whole = max(1, round(step))
    return [i * whole for i in range(math.ceil(top / whole) + 1)]


def totals(queues: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Each series summed over the queues."""
    return {name: sum(int(q.get(name) or 0) for q in queues) for name, _ in SERIES}


def time_range(now: datetime) -> str:
    """The clock times the x axis spans, ending at ``now`` (the script shows local time)."""
    start = now - timedelta(seconds=WINDOW_S)
    zone = now.tzname() or ""
    return f"{start:%H:%M:%S} - {now:%H:%M:%S} {zone}".rstrip()


def _y(value: float, top: int) -> float:
    return round(BOTTOM - (value / top) * (BOTTOM - TOP), 1)


def _x(seconds_ago: float) -> float:
    return round(RIGHT - (seconds_ago / WINDOW_S) * (RIGHT - LEFT), 1)


def _time_label(seconds_ago: int) -> str:
    return "now" if seconds_ago == 0 else f"-{seconds_ago}s"


def queue_chart(queues: Sequence[Mapping[str, Any]], now: datetime) -> str:
    """The chart's SVG, showing the current totals of ``queues`` taken at ``now``."""
    current = totals(queues)
    ticks = nice_ticks(max(current.values(), default=0))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="chart" class="chart" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="steps in all queues over the last {WINDOW_S} seconds" '
        f'data-left="{LEFT}" data-top="{TOP}" data-right="{RIGHT}" data-bottom="{BOTTOM}" '
        f'data-window="{WINDOW_S}" font-family="system-ui, sans-serif">',
        f'<text class="chart-title" x="{LEFT}" y="16" font-size="12" fill="#222">'
        "Steps in all queues</text>",
        f'<text class="time-range" x="{RIGHT}" y="16" font-size="11" fill="#555" '
        f'text-anchor="end">{time_range(now)}</text>',
        '<g class="axis y-axis" font-size="11" fill="#555">',
        _y_axis(ticks),
        "</g>",
        '<g class="axis x-axis" font-size="11" fill="#555">',
        f'<line class="axis-line" x1="{LEFT}" y1="{BOTTOM}" x2="{RIGHT}" y2="{BOTTOM}" '
        'stroke="#555"/>',
    ]
    for seconds_ago in range(WINDOW_S, -1, -X_TICK_S):
        x = _x(seconds_ago)
        parts.append(
            f'<g class="tick" data-value="{seconds_ago}"><line x1="{x}" y1="{BOTTOM}" '
            f'x2="{x}" y2="{BOTTOM + 5}" stroke="#555"/><text class="tick-label" x="{x}" '
            f'y="{BOTTOM + 18}" text-anchor="middle">{_time_label(seconds_ago)}</text></g>'
        )
    parts.append(
        f'<text class="axis-title" x="{(LEFT + RIGHT) / 2}" y="{HEIGHT - 6}" '
        'text-anchor="middle">time (seconds before now)</text></g>'
    )
    # The series start as the current totals; the script draws them over time.
    parts.append('<g class="series" fill="none" stroke-width="2" stroke-linejoin="round">')
    for name, colour in SERIES:
        y = _y(current[name], ticks[-1])
        parts.append(
            f'<path class="line" data-series="{name}" stroke="{colour}" '
            f'd="M{RIGHT - 4},{y} L{RIGHT},{y}"/>'
        )
    parts.append('</g><g class="legend" font-size="12" fill="#222">')
    for i, (name, colour) in enumerate(SERIES):
        y = TOP + 10 + i * 20
        parts.append(
            f'<g class="legend-item" data-series="{name}"><line x1="{RIGHT + 20}" y1="{y}" '
            f'x2="{RIGHT + 40}" y2="{y}" stroke="{colour}" stroke-width="3"/>'
            f'<text x="{RIGHT + 46}" y="{y + 4}">{name} '
            f'<tspan class="legend-value" font-weight="bold">{current[name]}</tspan></text></g>'
        )
    parts.append("</g></svg>")
    return "".join(parts)


def _y_axis(ticks: list[int]) -> str:
    """The count axis's inner SVG (the script redraws the same markup)."""
    top = ticks[-1]
    parts = [
        f'<line class="axis-line" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{BOTTOM}" stroke="#555"/>'
    ]
    for value in ticks:
        y = _y(value, top)
        parts.append(
            f'<g class="tick" data-value="{value}"><line x1="{LEFT - 5}" y1="{y}" x2="{RIGHT}" '
            f'y2="{y}" stroke="#eee"/><text class="tick-label" x="{LEFT - 8}" y="{y + 4}" '
            f'text-anchor="end">{value}</text></g>'
        )
    middle = (TOP + BOTTOM) / 2
    parts.append(
        f'<text class="axis-title" x="14" y="{middle}" text-anchor="middle" '
        f'transform="rotate(-90 14 {middle})">steps (count)</text>'
    )
    return "".join(parts)
