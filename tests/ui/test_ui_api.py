"""The dashboard's endpoints: pages, JSON API, writes through the Client, and its safety."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator

import pytest
from starlette.testclient import TestClient

from cyclone_dsl import Client, Concurrency, Worker, step, wait_signal, workflow
from cyclone_dsl.ui.app import CSRF_COOKIE, create_app
from tests.ui.geometry import SVG, axis_labels, check_routes, graph_of, parse_svg
from tests.waiting import wait_until


@step(name="ui_echo")
def echo(x: object) -> object:
    return x


@workflow(name="ui_wait")
def waits(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("go"))


@workflow(name="ui_skip")
def skips(x):  # type: ignore[no-untyped-def]
    """Edges that skip rows: top -> bottom passes the mids' row and deep's."""
    top = echo.named("top")(x)
    mids = [echo.named(f"mid{i}")(top) for i in range(3)]
    deep = echo.named("deep")(mids[0])
    return echo.named("bottom")([top, deep, *mids])


@pytest.fixture
def web(client: Client) -> Iterator[TestClient]:
    with TestClient(create_app(client)) as test_client:
        yield test_client


def csrf_of(web: TestClient) -> str:
    web.get("/runs")
    return str(web.cookies.get(CSRF_COOKIE))


def test_pages_render(web: TestClient, client: Client) -> None:
    handle = client.submit(waits, 1)
    assert web.get("/").url.path == "/runs"
    listed = web.get("/runs")
    assert listed.status_code == 200
    assert f'data-run="{handle.id}"' in listed.text
    page = web.get(f"/runs/{handle.id}")
    assert page.status_code == 200
    assert 'data-node="go"' in page.text and 'data-state="waiting_signal"' in page.text
    assert "<svg" in page.text
    assert f'name="csrf" value="{web.cookies.get(CSRF_COOKIE)}"' in page.text
    assert web.get("/queues").status_code == 200
    assert web.get("/schedules").status_code == 200


def test_filters_and_bad_ids(web: TestClient, client: Client) -> None:
    first = client.submit(waits, 1)
    client.cancel(first.id)
    second = client.submit(waits, 2)
    cancelled = web.get("/runs", params={"state": "cancelled"}).text
    assert f'data-run="{first.id}"' in cancelled and f'data-run="{second.id}"' not in cancelled
    assert web.get("/runs", params={"parent": "x"}).status_code == 400
    assert web.get("/runs", params={"since": "yesterday"}).status_code == 400
    assert web.get("/runs", params={"state": "bogus"}).status_code == 400
    assert web.get("/runs/999999").status_code == 404
    assert web.get("/runs/not-a-number").status_code == 404
    assert web.get("/api/runs/999999").status_code == 404


def test_user_data_is_escaped(web: TestClient, client: Client) -> None:
    handle = client.submit(waits, "<script>alert(1)</script>")
    client.signal(handle.id, "go", {"html": "<img src=x onerror=alert(2)>"})
    page = web.get(f"/runs/{handle.id}").text
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in page


def test_writes_need_the_csrf_token(web: TestClient, client: Client) -> None:
    handle = client.submit(waits, 1)
    refused = web.post(f"/runs/{handle.id}/cancel", data={"csrf": "wrong"})
    assert refused.status_code == 403
    assert client.get_run(handle.id).state == "running"
    done = web.post(
        f"/runs/{handle.id}/cancel", data={"csrf": csrf_of(web)}, follow_redirects=False
    )
    assert done.status_code == 303
    assert client.get_run(handle.id).state == "cancelled"


def test_signal_pause_resume_retry_from_forms(web: TestClient, client: Client) -> None:
    handle = client.submit(waits, 1)
    csrf = csrf_of(web)
    sent = web.post(
        f"/runs/{handle.id}/signal", data={"csrf": csrf, "name": "go", "payload": '"yes"'}
    )
    assert "signal &#39;go&#39;: consumed" in sent.text or "consumed" in sent.text
    bad = web.post(f"/runs/{handle.id}/signal", data={"csrf": csrf, "name": "go", "payload": "{"})
    assert "not valid JSON" in bad.text
    web.post(f"/runs/{handle.id}/pause", data={"csrf": csrf})
    assert client.get_run(handle.id).state == "paused"
    again = web.post(f"/runs/{handle.id}/pause", data={"csrf": csrf})
    assert "already paused" in again.text
    web.post(f"/runs/{handle.id}/resume", data={"csrf": csrf})
    assert client.get_run(handle.id).state == "running"
    web.post(f"/runs/{handle.id}/cancel", data={"csrf": csrf})
    retried = web.post(f"/runs/{handle.id}/retry", data={"csrf": csrf, "node": "ui_echo"})
    assert retried.status_code == 200
    assert client.get_run(handle.id).state == "running"


def test_read_only_mode_refuses_writes(client: Client) -> None:
    handle = client.submit(waits, 1)
    with TestClient(create_app(client, read_only=True)) as web:
        page = web.get(f"/runs/{handle.id}").text
        assert "read-only" in page and 'action="/runs/' not in page
        csrf = str(web.cookies.get(CSRF_COOKIE))
        assert web.post(f"/runs/{handle.id}/cancel", data={"csrf": csrf}).status_code == 403
    assert client.get_run(handle.id).state == "running"


def test_token_mode_requires_the_token(client: Client) -> None:
    handle = client.submit(waits, 1)
    with TestClient(create_app(client, token="s3cret")) as web:
        csrf = csrf_of(web)
        assert web.post(f"/runs/{handle.id}/cancel", data={"csrf": csrf}).status_code == 401
        wrong = web.post(f"/runs/{handle.id}/cancel", data={"csrf": csrf, "token": "nope"})
        assert wrong.status_code == 401
        web.post(f"/runs/{handle.id}/cancel", data={"csrf": csrf, "token": "s3cret"})
    assert client.get_run(handle.id).state == "cancelled"


def test_json_api_and_download(web: TestClient, client: Client) -> None:
    handle = client.submit(waits, 1)
    client.signal(handle.id, "go", {"big": "x" * 5000})
    assert web.get("/api/counts").json() == {"running": 1}
    assert web.get("/api/runs").json()[0]["id"] == handle.id
    run = web.get(f"/api/runs/{handle.id}").json()
    assert run["steps"][0]["node"] == "go"
    assert "queues" in web.get("/api/stats").json()
    page = web.get(f"/runs/{handle.id}").text
    assert re.search(r'href="/runs/\d+/steps/go/output.json">download', page)
    downloaded = web.get(f"/runs/{handle.id}/steps/go/output.json")
    assert downloaded.json() == {"big": "x" * 5000}
    assert web.get(f"/runs/{handle.id}/steps/nope/output.json").status_code == 404


def test_schedules_can_be_disabled(web: TestClient, client: Client) -> None:
    client.schedule(waits, "0 * * * *", id="hourly", location="UTC")
    assert "hourly" in web.get("/schedules").text
    web.post("/schedules/hourly/disable", data={"csrf": csrf_of(web)})
    assert client.list_schedules()[0].enabled is False
    web.post("/schedules/hourly/enable", data={"csrf": csrf_of(web)})
    assert client.list_schedules()[0].enabled is True


def test_the_queues_page_shows_unserved_work_and_live_workers(
    web: TestClient, client: Client, start_worker: Callable[..., Worker]
) -> None:
    client.submit(waits, 1)  # waits on a signal: nothing to serve yet
    client.enqueue(echo, 1, queue="nobody")
    page = web.get("/queues").text
    assert "Waiting for a worker with their definition" in page
    assert "<td>nobody</td><td>ui_echo</td>" in page
    assert "no live workers" in page
    worker = start_worker(echo)
    page = web.get("/queues").text
    assert worker.id in page


def test_the_run_graph_draws_skip_level_edges_beside_the_nodes_between(
    web: TestClient, client: Client
) -> None:
    handle = client.submit(skips, 1)
    boxes, edges, skipping = graph_of(parse_svg(web.get(f"/runs/{handle.id}").text, 'class="dag"'))
    assert set(boxes) == {"top", "mid0", "mid1", "mid2", "deep", "bottom"}
    assert len(edges) == 9
    assert skipping == {"top->bottom", "mid0->bottom", "mid1->bottom", "mid2->bottom"}
    assert check_routes(boxes, edges) == []


def test_the_queue_chart_shows_the_current_totals(web: TestClient, client: Client) -> None:
    client.enqueue(echo, 1, queue="nobody")
    client.enqueue(echo, 2, queue="other")
    chart = parse_svg(web.get("/queues").text, 'id="chart"')
    assert axis_labels(chart, "x-axis")[-1] == "now"
    assert axis_labels(chart, "y-axis") == ["0", "1", "2"]
    legend = {
        str(item.get("data-series")): " ".join("".join(item.itertext()).split())
        for item in chart.iter(f"{SVG}g")
        if item.get("class") == "legend-item"
    }
    assert legend == {"available": "available 2", "running": "running 0", "waiting": "waiting 0"}
    time_range = chart.find(f"{SVG}text[@class='time-range']")
    assert time_range is not None
    assert re.fullmatch(r"\d\d:\d\d:\d\d - \d\d:\d\d:\d\d UTC", str(time_range.text))


held_back = threading.Event()


@step(name="ui_keyed", concurrency=Concurrency(key="tenant", limit=1))
def keyed(job: dict[str, str]) -> str:
    held_back.wait(20)
    return job["tenant"]


def test_the_pages_say_what_limits_hold_back(
    web: TestClient, client: Client, start_worker: Callable[..., Worker]
) -> None:
    held_back.clear()
    first = client.enqueue(keyed, {"tenant": "t7"})
    second = client.enqueue(keyed, {"tenant": "t7"})
    client.set_queue_limit("mail", 4)
    start_worker(keyed)
    try:
        wait_until(lambda: first.get().steps[0].state.value == "running", what="the first step")
        queues = web.get("/queues").text
        limits = queues[queues.index('<table class="limits">') :]
        assert "<td>step:ui_keyed</td><td>t7</td><td>1/1</td><td>1</td>" in limits
        assert "<td>queue:mail</td><td>-</td><td>0/4</td>" in limits
        run_page = web.get(f"/runs/{second.id}").text
        assert '<span class="held">waiting for a concurrency slot (t7: 1/1)</span>' in run_page
    finally:
        held_back.set()
    assert second.result(timeout=20) == "t7"


def test_open_pages_polling_the_counts_share_one_read(
    web: TestClient, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every open page asks /api/counts every 2 s, and counting walks every kept run: the
    polls of one dashboard share a read, done again once it is a second old (or twenty
    times what it took)."""
    reads: list[dict[str, int]] = []
    count = client.run_counts

    def counted() -> dict[str, int]:
        reads.append(count())
        return reads[-1]

    monkeypatch.setattr(client, "run_counts", counted)
    client.submit(waits, 1)
    polls = [web.get("/api/counts").json() for _ in range(20)]
    assert polls == [{"running": 1}] * 20
    assert len(reads) == 1
    client.submit(waits, 2)
    wait_until(
        lambda: web.get("/api/counts").json() == {"running": 2}, timeout=5, what="new counts"
    )
    assert len(reads) >= 2
    page = web.get("/runs").text  # a page shows its own read
    assert re.search(r'data-count="running">2<', page)
