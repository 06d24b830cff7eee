"""The fleet page's charts and the throughput read behind them."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta

import pytest
from starlette.testclient import TestClient

from cyclone_dsl import Client, InvalidArgument, Worker
from cyclone_dsl.ui.app import create_app
from tests.ui.geometry import SVG, axis_labels, parse_svg
from tests.ui.test_ui_api import echo


def test_throughput_counts_the_steps_started_in_the_window(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    empty = client.throughput(window=timedelta(minutes=15), buckets=30)
    assert len(empty) == 30 and sum(r["started"] for r in empty) == 0
    assert all(r["wait_p50_s"] is None for r in empty)
    start_worker(echo)
    for value in range(3):
        client.enqueue(echo, value).result(timeout=20)
    rows = client.throughput(window=timedelta(minutes=15), buckets=30)
    assert [r["bucket"] for r in rows] == list(range(30))
    assert sum(r["started"] for r in rows) == sum(r["completed"] for r in rows) == 3
    busy = [r for r in rows if r["started"]]
    assert busy and all(0 <= r["wait_p50_s"] <= r["wait_p95_s"] <= r["wait_max_s"] for r in busy)
    assert rows[-1]["started"] == 3  # just now: the newest slice
    with pytest.raises(InvalidArgument):
        client.throughput(window=timedelta(0))
    with pytest.raises(InvalidArgument):
        client.throughput(buckets=0)


def test_the_fleet_page_charts_have_axes_units_and_a_time_range(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(echo)
    for value in range(4):
        client.enqueue(echo, value).result(timeout=20)
    with TestClient(create_app(client)) as web:
        page = web.get("/fleet", params={"range": "15m"}).text
        assert web.get("/fleet", params={"range": "2d"}).status_code == 400
    for chart_id, unit in (("throughput", "steps per minute"), ("latency", "seconds")):
        chart = parse_svg(page, f'id="{chart_id}"')
        titles = [t.text for t in chart.iter(f"{SVG}text") if t.get("class") == "axis-title"]
        assert titles == [unit, "time (UTC)"]
        assert len(axis_labels(chart, "x-axis")) == 5
        assert float(axis_labels(chart, "y-axis")[0]) == 0
        time_range = chart.find(f"{SVG}text[@class='time-range']")
        assert time_range is not None
        found = re.fullmatch(r"(\d\d):(\d\d) - (\d\d):(\d\d) UTC", str(time_range.text))
        assert found is not None
        h0, m0, h1, m1 = map(int, found.groups())
        assert (h1 * 60 + m1 - h0 * 60 - m0) % 1440 == 15
    throughput = parse_svg(page, 'id="throughput"')
    values = [
        "".join(g.itertext()) for g in throughput.iter(f"{SVG}g") if g.get("class") == "legend-item"
    ]
    # 4 steps in the newest slice of 30 s: 8 per minute.
    assert values == ["started 8", "of them completed 8"]
