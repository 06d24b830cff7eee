"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright).

It runs the flagship example, sends the signal its run waits for from the
page, watches it complete, cancels another run, and checks that an output
holding ``<script>`` renders as text. It watches a run with a retried step, a
signal wait, a fan-out and a child move on its timeline without a reload, and
measures the bars: one per attempt, in order, a backoff before the retry, the
wait drawn as a wait. It measures the drawn run graph (no edge
runs behind a node; edges that skip rows stay visible) and the queue chart (axes,
tick labels that fit and do not overlap, a time range, a series that follows the
counts). Screenshots go to a temporary folder; ``CYCLONE_SCREENSHOTS=1`` writes
the ones the docs show to ``docs/img/``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from cyclone_dsl import Client, Registry, Worker
from cyclone_dsl.cli import flagship
from cyclone_dsl.ui.app import create_app
from cyclone_dsl.ui.chart import nice_ticks
from tests.ui import tour
from tests.ui.test_ui_api import echo, skips, waits
from tests.waiting import wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: Screenshots go to a temporary folder; CYCLONE_SCREENSHOTS=1 refreshes the ones in docs/img.
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "img"

if CHROMIUM is None and os.environ.get("CI"):
    raise RuntimeError("CI needs Debian's chromium for the browser tests (.ci/run installs it)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")

#: Walks every edge of the run graph pixel by pixel with the browser's own geometry
#: (getTotalLength, getPointAtLength, getBBox, getScreenCTM). ``problems``: points inside
#: a node that is not one of the edge's ends (or within 1px of it), or more than 1px
#: inside one of its ends. Per edge, away from its ends: how many points were sampled,
#: at how many the topmost element on the page is the edge itself (``own``), and at how
#: many it is a node (``hidden``).
EDGE_PROBES = """(svg) => {
  svg.scrollIntoView({block: "center", inline: "center"});
  const boxes = {};
  for (const node of svg.querySelectorAll("g.node")) {
    boxes[node.dataset.node] = node.querySelector("rect").getBBox();
  }
  const inside = (p, b, inset) => p.x > b.x + inset && p.x < b.x + b.width - inset
    && p.y > b.y + inset && p.y < b.y + b.height - inset;
  const toScreen = svg.getScreenCTM();
  const problems = [];
  const edges = {};
  for (const edge of svg.querySelectorAll("path.edge")) {
    const ends = [edge.dataset.from, edge.dataset.to];
    const name = ends.join("->");
    const length = edge.getTotalLength();
    const seen = {skips: Number(edge.dataset.skips), samples: 0, own: 0, hidden: 0};
    for (let at = 0; at <= length; at += 1) {
      const p = edge.getPointAtLength(at);
      let nearEnd = false;
      for (const [node, box] of Object.entries(boxes)) {
        const mine = ends.includes(node);
        if (inside(p, box, mine ? 1 : -1)) {
          problems.push(`${name} meets ${node} at ${p.x.toFixed(1)},${p.y.toFixed(1)}`);
        }
        nearEnd ||= mine && inside(p, box, -12);  // the arrowhead and the border
      }
      if (nearEnd) continue;
      const q = new DOMPoint(p.x, p.y).matrixTransform(toScreen);
      const hit = document.elementFromPoint(q.x, q.y);
      seen.samples += 1;
      if (hit === edge) seen.own += 1;
      if (hit !== null && hit.closest("g.node") !== null) seen.hidden += 1;
    }
    edges[name] = seen;
  }
  return {nodes: Object.keys(boxes).length, edges, problems: problems.slice(0, 20)};
}"""

#: The queue chart as drawn: each axis's line, title and tick labels (with whether they
#: lie inside the chart and clear of each other), the time range, the legend, and the
#: y of the latest point of the ``available`` series next to the y of each count tick.
CHART_PROBES = """(svg) => {
  const frame = svg.viewBox.baseVal;
  const within = (b) => b.width > 0 && b.height > 0 && b.x >= frame.x && b.y >= frame.y
    && b.x + b.width <= frame.x + frame.width && b.y + b.height <= frame.y + frame.height;
  const apart = (a, b) => a.x + a.width <= b.x || b.x + b.width <= a.x
    || a.y + a.height <= b.y || b.y + b.height <= a.y;
  const axis = (name) => {
    const group = svg.querySelector(`.${name}`);
    const labels = [...group.querySelectorAll("text.tick-label")];
    const boxes = labels.map((t) => t.getBBox());
    const ticks = {};
    for (const tick of group.querySelectorAll(".tick")) {
      ticks[tick.dataset.value] = Number(tick.querySelector("line").getAttribute("y1"));
    }
    return {
      line: group.querySelector("line.axis-line") !== null,
      title: group.querySelector("text.axis-title").textContent,
      labels: labels.map((t) => t.textContent),
      inside: boxes.every(within),
      apart: boxes.every((a, i) => boxes.slice(i + 1).every((b) => apart(a, b))),
      ticks,
    };
  };
  const series = svg.querySelector('.series [data-series="available"]').getAttribute("d");
  const ys = [...series.matchAll(/[ML][\\d.]+,([\\d.]+)/g)].map((m) => Number(m[1]));
  return {
    x: axis("x-axis"),
    y: axis("y-axis"),
    range: svg.querySelector(".time-range").textContent,
    legend: [...svg.querySelectorAll(".legend-item")].map((g) => g.textContent.trim()),
    ys,
  };
}"""


#: The timeline as drawn: for each row, its bars (attempt, outcome, the phases of their
#: segments and their left and right ends on the page) and whether the row is shown.
TIMELINE_PROBES = """(timeline) => {
  const rows = {};
  for (const row of timeline.querySelectorAll(".tl-row[data-node]")) {
    rows[row.dataset.node] = {
      shown: row.getBoundingClientRect().height > 0,
      density: row.querySelectorAll(".density .cell").length,
      bars: [...row.querySelectorAll("g.bar")].map((bar) => {
        const box = bar.getBoundingClientRect();
        return {
          attempt: bar.dataset.attempt ? Number(bar.dataset.attempt) : null,
          outcome: bar.dataset.outcome,
          phases: [...bar.querySelectorAll("rect.seg")].map((r) => r.dataset.phase),
          left: box.left,
          right: box.right,
        };
      }),
    };
  }
  return rows;
}"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server(client: Client) -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(create_app(client), host="127.0.0.1", port=port, log_level="warning")
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    wait_until(lambda: instance.started, what="the dashboard's server to start")
    yield f"http://127.0.0.1:{port}"
    instance.should_exit = True
    thread.join(10)


@pytest.fixture
def browser_page() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.on("dialog", lambda dialog: dialog.accept())
        yield page
        browser.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where the screenshots the docs show go."""
    return DOCS_IMAGES if os.environ.get("CYCLONE_SCREENSHOTS") == "1" else tmp_path


def check_edges(drawn: dict[str, Any]) -> None:
    """No edge meets a node it does not link; every edge shows on top of the page
    nearly all along (only crossing edges may cover it, at points)."""
    assert drawn["problems"] == []
    for name, seen in drawn["edges"].items():
        assert seen["hidden"] == 0, f"{name} is hidden behind a node: {seen}"
        if seen["skips"]:
            assert seen["samples"] > 50, f"{name} is too short to tell: {seen}"
            assert seen["own"] >= 0.8 * seen["samples"], f"{name} is not visible: {seen}"


def test_the_flagship_run_is_steered_from_the_browser(
    server: str, client: Client, cyclone_dsn: str, browser_page: object, shots: Path
) -> None:
    from playwright.sync_api import Page, expect

    page: Page = browser_page  # type: ignore[assignment]
    registry = Registry.from_objects([flagship])
    with Worker(cyclone_dsn, registry=registry, poll_interval=0.1, scan_interval=0.2):
        with Client(cyclone_dsn, registry=registry) as flagship_client:
            run = flagship_client.submit(flagship.demo_order, "order-7")
        other = client.submit(waits, "<script>window.hacked = true</script>")
        page.goto(f"{server}/runs")
        expect(page.locator(f'tr[data-run="{run.id}"]')).to_be_visible()
        page.screenshot(path=str(shots / "runs.png"))
        page.goto(f"{server}/runs/{run.id}")
        expect(page.locator('g.node[data-node="approved"]')).to_have_attribute(
            "data-state", "waiting_signal", timeout=15_000
        )
        page.fill('input[name="name"]', "approved")
        page.fill('input[name="payload"]', '{"by": "browser"}')
        page.click("text=Send signal")
        expect(page.locator(".flash.ok")).to_contain_text("consumed")
        for _ in range(100):
            page.goto(f"{server}/runs/{run.id}")
            if page.locator("#run-state").inner_text() == "completed":
                break
            time.sleep(0.1)
        expect(page.locator("#run-state")).to_have_text("completed")
        expect(page.locator('g.node[data-node="demo_ship_line"]')).to_contain_text("4/4 items")
        page.screenshot(path=str(shots / "run.png"), full_page=True)
        drawn = page.locator("svg.dag").evaluate(EDGE_PROBES)
        assert drawn["nodes"] == 9
        assert sorted(n for n, seen in drawn["edges"].items() if seen["skips"]) == [
            "approved->demo_confirm",
            "demo_confirm->demo_summarize",
            "demo_fetch_order->demo_invoice",
            "demo_list_lines->demo_ship_line",
        ]
        check_edges(drawn)
        page.goto(f"{server}/runs/{other.id}")
        assert page.evaluate("window.hacked === undefined")
        expect(page.locator("p.meta", has_text="input:")).to_contain_text(
            "<script>window.hacked = true</script>"
        )
        page.click("text=Cancel")
        expect(page.locator("#run-state")).to_have_text("cancelled")


def test_the_graph_and_the_queue_chart_as_drawn(
    server: str, client: Client, browser_page: object, shots: Path, tmp_path: Path
) -> None:
    from playwright.sync_api import Page, expect

    page: Page = browser_page  # type: ignore[assignment]
    run = client.submit(skips, 1)
    page.goto(f"{server}/runs/{run.id}")
    graph = page.locator("svg.dag")
    graph.screenshot(path=str(tmp_path / "graph-skips.png"))
    drawn = graph.evaluate(EDGE_PROBES)
    assert drawn["nodes"] == 6 and len(drawn["edges"]) == 9
    assert {n: seen["skips"] for n, seen in drawn["edges"].items() if seen["skips"]} == {
        "top->bottom": 2,
        "mid0->bottom": 1,
        "mid1->bottom": 1,
        "mid2->bottom": 1,
    }
    check_edges(drawn)

    # The chart samples /api/stats every 2 s: it follows the counts and rescales its axis.
    client.cancel(run.id)  # its steps leave the queues
    client.enqueue(echo, 1, queue="nobody")
    client.enqueue(echo, 2, queue="nobody")
    page.goto(f"{server}/queues")
    chart = page.locator("#chart")
    expect(chart).to_have_attribute("data-samples", re.compile(r"^[2-9]"), timeout=10_000)
    before = chart.evaluate(CHART_PROBES)
    assert before["y"]["labels"] == [str(t) for t in nice_ticks(2)] == ["0", "1", "2"]
    assert before["ys"][-1] == before["y"]["ticks"]["2"]
    for value in range(5):
        client.enqueue(echo, value, queue="busy")
    expect(page.locator('.legend-item[data-series="available"]')).to_contain_text(
        "available 7", timeout=10_000
    )
    axes = chart.evaluate(CHART_PROBES)
    if shots == DOCS_IMAGES:  # for the docs, a page whose tables agree with its chart
        page.reload()
        expect(chart).to_have_attribute("data-samples", re.compile(r"^[3-9]"), timeout=10_000)
    page.screenshot(path=str(shots / "queues.png"))

    for name, title in (("x", "time (seconds before now)"), ("y", "steps (count)")):
        assert axes[name]["line"] and axes[name]["title"] == title
        assert axes[name]["inside"] and axes[name]["apart"], axes[name]
    assert axes["x"]["labels"] == ["-120s", "-90s", "-60s", "-30s", "now"]
    assert axes["y"]["labels"] == [str(t) for t in nice_ticks(7)] == ["0", "2", "4", "6", "8"]
    # The series went from 2 to 7 steps, on the rescaled axis.
    y_of = axes["y"]["ticks"]
    assert axes["ys"][-1] == pytest.approx(y_of["6"] + (y_of["8"] - y_of["6"]) / 2, abs=0.1)
    assert pytest.approx(y_of["2"], abs=0.1) in axes["ys"][:-1]
    assert axes["legend"] == ["available 7", "running 0", "waiting 0"]
    start, end = re.fullmatch(r"(\S+) - (\S+) UTC", axes["range"]).groups()  # type: ignore[union-attr]
    span = datetime.strptime(end, "%H:%M:%S") - datetime.strptime(start, "%H:%M:%S")
    assert span.total_seconds() % 86400 == 120


def test_the_timeline_shows_attempts_waits_fan_out_and_child_live(
    server: str,
    client: Client,
    start_worker: Callable[..., Worker],
    browser_page: object,
    shots: Path,
) -> None:
    from playwright.sync_api import Page, expect

    page: Page = browser_page  # type: ignore[assignment]
    start_worker(tour, poll_interval=0.1)
    run = client.submit(tour.tour, 2)
    page.goto(f"{server}/runs/{run.id}")
    timeline = page.locator("#timeline")
    # The page follows the run without a reload: the retry appears, then the run ends.
    flaky = page.locator('.tl-row[data-node="tl_flaky"] g.bar')
    expect(flaky).to_have_count(2, timeout=15_000)
    expect(flaky.nth(1)).to_have_attribute("data-outcome", "completed", timeout=15_000)
    waiting = timeline.evaluate(TIMELINE_PROBES)["go"]["bars"]
    assert [(b["outcome"], b["phases"]) for b in waiting] == [("waiting", ["signal"])]
    client.signal(run.id, "go", {"by": "browser"})
    expect(page.locator("#run-state")).to_have_text("completed", timeout=15_000)
    assert int(page.locator("#live").get_attribute("data-updates") or 0) >= 2

    rows = page.locator("#timeline").evaluate(TIMELINE_PROBES)
    first, second = rows["tl_flaky"]["bars"]
    assert (first["attempt"], first["outcome"], first["phases"]) == (
        1,
        "retried",
        ["queued", "running"],
    )
    assert (second["attempt"], second["outcome"]) == (2, "completed")
    assert second["phases"][0] == "backoff" and second["phases"][-1] == "running"
    assert first["left"] < first["right"] <= second["left"] + 0.5 < second["right"]
    (signal,) = rows["go"]["bars"]
    assert (signal["outcome"], signal["phases"]) == ("completed", ["signal"])
    assert [b["phases"] for b in rows["tl_inner"]["bars"]] == [["child"]]
    # Fan-out items: one collapsed row with a density strip, expanded on click.
    items = [node for node in rows if node.startswith("tl_square[")]
    assert len(items) == 6 and not any(rows[node]["shown"] for node in items)
    assert rows["tl_square"]["density"] > 0 and rows["tl_square"]["bars"][0]["phases"] == ["fanout"]
    page.click('.tl-row.fanout[data-node="tl_square"] .tl-label')
    rows = page.locator("#timeline").evaluate(TIMELINE_PROBES)
    assert all(rows[node]["shown"] for node in items)
    for node in items:
        (item,) = rows[node]["bars"]
        assert (
            item["phases"][-1] == "running"
            and item["left"] >= rows["tl_items"]["bars"][0]["right"] - 0.5
        )
    # A click on a bar shows its exact times, its worker and its error.
    page.click('.tl-row[data-node="tl_flaky"] g.bar[data-attempt="1"] rect.running', force=True)
    detail = page.locator("#tl-detail")
    expect(detail).to_be_visible()
    expect(detail).to_contain_text("attempt 1/3 · retried")
    expect(detail).to_contain_text("worker: ")
    expect(detail).to_contain_text("the first attempt fails")
    expect(detail).to_contain_text(" UTC")
    attempts = page.locator('tr[data-node="tl_flaky"] ol.attempt-list li')
    expect(attempts).to_have_count(2)
    expect(attempts.nth(0)).to_contain_text("attempt 1/3")
    expect(attempts.nth(1)).to_contain_text("attempt 2/3")
    timeline.screenshot(path=str(shots / "timeline.png"))

    page.goto(f"{server}/fleet")
    expect(page.locator('tr[data-status="live"]')).to_have_count(1)
    expect(page.locator("#throughput .y-axis .axis-title")).to_have_text("steps per minute")
    expect(page.locator("#latency .y-axis .axis-title")).to_have_text("seconds")
    page.screenshot(path=str(shots / "fleet.png"), full_page=True)
