"""Humane values: durations, relative times and exact times, and the axes' tick steps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from cyclone_dsl.ui import humane
from cyclone_dsl.ui.timeline import nice_step
from cyclone_dsl.ui.trend import nice_scale

NOW = datetime(2026, 12, 3, 10, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 ms"),
        (0.0042, "4.2 ms"),
        (0.25, "250 ms"),
        (0.9996, "1000 ms"),
        (1.2, "1.2 s"),
        (1.0, "1 s"),
        (9.94, "9.9 s"),
        (42.4, "42 s"),
        (180, "3 min"),
        (210, "3.5 min"),
        (45 * 60, "45 min"),
        (2.5 * 3600, "2.5 h"),
        (30 * 3600, "30 h"),
        (3 * 86400, "3 d"),
        (-1.5, "-1.5 s"),
    ],
)
def test_durations(seconds: float, text: str) -> None:
    assert humane.duration(seconds) == text
    assert humane.duration(timedelta(seconds=seconds)) == text


@pytest.mark.parametrize(
    ("before", "text"),
    [
        (timedelta(seconds=2), "just now"),
        (timedelta(seconds=42), "42 s ago"),
        (timedelta(minutes=3, seconds=59), "3 min ago"),
        (timedelta(hours=5, minutes=59), "5 h ago"),
        (timedelta(hours=47), "47 h ago"),
        (timedelta(days=3, hours=23), "3 days ago"),
        (-timedelta(minutes=3, seconds=10), "in 3 min"),
    ],
)
def test_relative_times(before: timedelta, text: str) -> None:
    assert humane.ago(NOW - before, NOW) == text


def test_exact_times_are_utc_to_the_millisecond_and_shown_on_hover() -> None:
    local = datetime(2026, 12, 3, 11, 0, 3, 120_999, tzinfo=timezone(timedelta(hours=1)))
    assert humane.exact(local) == "2026-12-03 10:00:03.120 UTC"
    assert humane.clock(local) == "10:00:03.120"
    html = str(humane.when_html(NOW - timedelta(minutes=3), NOW))
    assert html == (
        '<time datetime="2026-12-03T09:57:00+00:00" title="2026-12-03 09:57:00.000 UTC" '
        "data-ago>3 min ago</time>"
    )
    assert str(humane.when_html(None, NOW)) == ""
    assert humane.took(NOW, NOW + timedelta(seconds=1.2)) == "1.2 s"
    assert humane.took(NOW, None) == ""


@pytest.mark.parametrize(
    ("span", "step"),
    [(2.1, 0.5), (0.03, 0.005), (45, 10), (400, 120), (3000, 600), (5 * 3600, 3600)],
)
def test_time_axis_steps_cut_a_span_in_at_most_six(span: float, step: float) -> None:
    assert nice_step(span) == step
    assert span / step <= 6


def test_value_axis_ticks_reach_the_top() -> None:
    assert nice_scale(0) == [0, 0.5, 1]
    assert nice_scale(0.168) == [0, 0.05, 0.1, 0.15, 0.2]
    assert nice_scale(7) == [0, 2, 4, 6, 8]
    assert nice_scale(100) == [0, 50, 100]
