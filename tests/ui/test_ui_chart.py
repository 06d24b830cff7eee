"""The queue chart's frame as drawn by the server (no database): axes with titles and
tick labels, the time range, the legend, and the geometry the page's script reads."""

from __future__ import annotations

from datetime import UTC, datetime

from cyclone_dsl.ui.chart import nice_ticks, queue_chart
from tests.ui.geometry import SVG, axis_labels, parse_svg


def test_nice_ticks() -> None:
    assert nice_ticks(0) == [0, 1]
    assert nice_ticks(1) == [0, 1]
    assert nice_ticks(3) == [0, 1, 2, 3]
    assert nice_ticks(7) == [0, 2, 4, 6, 8]
    assert nice_ticks(100) == [0, 50, 100]
    assert nice_ticks(1234) == [0, 500, 1000, 1500]


def test_the_queue_chart_has_axes_ticks_a_time_range_and_a_legend() -> None:
    now = datetime(2026, 12, 3, 10, 0, 0, tzinfo=UTC)
    svg = queue_chart([{"available": 3, "running": 1, "waiting": 2}, {"waiting": 5}], now)
    chart = parse_svg(svg, 'id="chart"')
    assert axis_labels(chart, "x-axis") == ["-120s", "-90s", "-60s", "-30s", "now"]
    assert axis_labels(chart, "y-axis") == ["0", "2", "4", "6", "8"]
    texts = {t.get("class"): "".join(t.itertext()) for t in chart.iter(f"{SVG}text")}
    assert texts["time-range"] == "09:58:00 - 10:00:00 UTC"
    titles = [str(t.text) for t in chart.iter(f"{SVG}text") if t.get("class") == "axis-title"]
    assert sorted(titles) == ["steps (count)", "time (seconds before now)"]
    legend = {
        str(item.get("data-series")): " ".join("".join(item.itertext()).split())
        for item in chart.iter(f"{SVG}g")
        if item.get("class") == "legend-item"
    }
    assert legend == {"available": "available 3", "running": "running 1", "waiting": "waiting 7"}
    lines = [p.get("data-series") for p in chart.iter(f"{SVG}path") if p.get("class") == "line"]
    assert lines == list(legend)
    # The plot's geometry, which the page's script reads, frames the axes.
    assert chart.get("data-window") == "120"
    left, bottom = chart.get("data-left"), chart.get("data-bottom")
    y_line = chart.find(f"{SVG}g[@class='axis y-axis']/{SVG}line[@class='axis-line']")
    assert y_line is not None and y_line.get("x1") == left and y_line.get("y2") == bottom
    empty = parse_svg(queue_chart([], now), 'id="chart"')
    assert axis_labels(empty, "y-axis") == ["0", "1"]
