"""The run page from a real run: its timeline (one bar per attempt in order, a backoff
before a retry, waits as waits, fan-out items collapsed), its attempt list, skipped and
copied nodes, the fork action, and the runs list's filters."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from starlette.testclient import TestClient

from cyclone_dsl import Client, Worker
from cyclone_dsl.ui import app as ui_app
from cyclone_dsl.ui import timeline
from cyclone_dsl.ui.app import create_app
from tests.ui import tour
from tests.ui.test_ui_api import csrf_of, echo, waits
from tests.waiting import wait_until


def timeline_row(page: str, node: str) -> str:
    start = page.index('<div class="tl-row')
    row = page[page.index(f'data-node="{node}" data-state', start) :]
    return row[: row.index("</div>")]


def bars(row: str) -> list[tuple[str, str, list[str]]]:
    """(outcome, attempt, phases) of each bar of a timeline row, in drawing order."""
    found = []
    for bar in row.split('<g class="bar')[1:]:
        outcome = re.search(r'data-outcome="(\w+)"', bar)
        attempt = re.search(r'data-attempt="(\d+)"', bar)
        phases = re.findall(r'data-phase="(\w+)"', bar)
        assert outcome is not None
        found.append((outcome.group(1), attempt.group(1) if attempt else "", phases))
    return found


@pytest.fixture
def web(client: Client) -> TestClient:
    return TestClient(create_app(client))


def test_the_timeline_and_attempts_of_a_run(
    web: TestClient, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(tour, poll_interval=0.1)
    handle = client.submit(tour.tour, 2)
    wait_until(
        lambda: client.get_run(handle.id).step("tl_flaky").state.value == "completed",
        what="the retried step",
    )
    wait_until(
        lambda: client.get_run(handle.id).step("tl_inner").completed_at is not None,
        what="the child run",
    )
    page = web.get(f"/runs/{handle.id}").text
    assert bars(timeline_row(page, "go")) == [("waiting", "", ["signal"])]
    assert (
        web.get(f"/runs/{handle.id}/live").text.count('id="live-state" data-terminal="false"') == 1
    )
    client.signal(handle.id, "go", {"by": "test"})
    handle.result(timeout=20)
    page = web.get(f"/runs/{handle.id}").text
    assert 'id="live-state" data-terminal="true"' in page

    (first, second) = bars(timeline_row(page, "tl_flaky"))
    assert first == ("retried", "1", ["queued", "running"])
    assert second[:2] == ("completed", "2")
    assert second[2][0] == "backoff" and second[2][-1] == "running"
    starts = re.findall(r'data-start="([^"]+)" data-end="([^"]+)"', timeline_row(page, "tl_flaky"))
    assert starts[0][1] == starts[1][0]  # the retry's bar starts where the failure ended
    assert bars(timeline_row(page, "go")) == [("completed", "", ["signal"])]
    assert bars(timeline_row(page, "tl_inner")) == [("completed", "", ["child"])]
    fan_out = timeline_row(page, "tl_square")
    assert 'data-items="6"' in fan_out and 'class="cell"' in fan_out
    assert bars(fan_out) == [("completed", "", ["fanout"])]
    assert page.count('data-item-of="tl_square" hidden') == 6

    # The attempt list: both attempts, numbered as the CLI numbers them; the completed
    # step's own error cell stays empty (the failure is the first attempt's).
    listed = web.get(f"/api/runs/{handle.id}/attempts").json()
    assert [(a["label"], a["outcome"], a["error_kind"]) for a in listed["tl_flaky"]] == [
        ("attempt 1/3", "retried", "error"),
        ("attempt 2/3", "completed", None),
    ]
    assert all(a["worker"] for a in listed["tl_flaky"])  # the completing one's too
    assert listed["go"] == [] and listed["tl_inner"] == []
    row = page[page.index('<tr id="node-tl_flaky"') :]
    row = row[: row.index("</tr>")]
    cells = row.split("<td>")
    assert "the first attempt fails" not in cells[10] and "the first attempt fails" in cells[11]

    # The runs list: by error kind (an attempt's), and by input text.
    assert f'data-run="{handle.id}"' in web.get("/runs", params={"error_kind": "error"}).text
    assert f'data-run="{handle.id}"' not in web.get("/runs", params={"error_kind": "timeout"}).text


def test_skipped_and_copied_nodes_and_the_fork_action(
    web: TestClient, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(tour)
    source = client.submit(tour.conditional, 1)
    source.result(timeout=20)
    page = web.get(f"/runs/{source.id}").text
    assert '<tr id="node-tl_review" data-node="tl_review" data-state="skipped">' in page
    assert bars(timeline_row(page, "tl_review")) == [("skipped", "", ["skipped"])]
    forked = web.post(f"/runs/{source.id}/fork", data={"csrf": csrf_of(web), "node": "tl_review"})
    assert forked.status_code == 200
    new_id = int(re.findall(r"/runs/(\d+)", str(forked.url))[0])
    assert new_id != source.id and f"forked from run {source.id}" in forked.text
    assert (
        f'fork of <a href="/runs/{source.id}">run {source.id}</a> from node tl_review'
        in forked.text
    )
    copied = forked.text[forked.text.index('<tr id="node-tl_score"') :]
    assert copied.startswith(
        '<tr id="node-tl_score" data-node="tl_score" data-state="completed" data-copied="true">'
    )
    assert (
        f'<a href="/runs/{source.id}#node-tl_score">run {source.id}</a>'
        in copied[: copied.index("</tr>")]
    )
    assert bars(timeline_row(forked.text, "tl_score")) == [("copied", "", ["copied"])]
    assert client.get_run(new_id).forked_from == source.id
    refused = web.post(f"/runs/{source.id}/fork", data={"csrf": csrf_of(web), "node": "nope"})
    assert 'class="flash err"' in refused.text
    assert len(client.list_runs()) == 2


def test_the_runs_list_filters_by_text_and_pages_by_key(
    web: TestClient, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [client.enqueue(echo, {"customer": f"ACME-{i}"}).id for i in range(3)]
    other = client.enqueue(echo, {"customer": "globex"}).id
    keyed = client.submit_once(waits, 1, key="order-Acme-9").id
    listed = web.get("/runs", params={"q": "acme"}).text
    assert all(f'data-run="{i}"' in listed for i in (*ids, keyed))
    assert f'data-run="{other}"' not in listed
    monkeypatch.setattr(ui_app, "PAGE", 2)
    first = web.get("/runs", params={"q": "acme"}).text
    assert re.findall(r'data-run="(\d+)"', first) == [str(keyed), str(ids[2])]
    following = re.search(r'href="/runs\?([^"]+)" rel="next"', first)
    assert following is not None and "q=acme" in following.group(1)
    second = web.get("/runs?" + following.group(1).replace("&amp;", "&")).text
    assert re.findall(r'data-run="(\d+)"', second) == [str(ids[1]), str(ids[0])]


@pytest.mark.parametrize("backoff_ms", [599, 1], ids=["backoff", "immediate retry"])
def test_short_segments_are_widened_inside_their_own_bar(backoff_ms: int) -> None:
    """A segment too short to see is drawn 2 px wide without reaching into another bar: a
    failure that took 1 ms still ends where the retry's bar starts, and a retry's short
    backoff does not start before the failure ended."""
    t0 = datetime(2026, 12, 4, 10, 0, 0, tzinfo=UTC)
    at = lambda ms: t0 + timedelta(milliseconds=ms)  # noqa: E731
    failed = timeline.Bar(
        "attempt 1/3",
        "retried",
        (timeline.Segment("queued", at(0), at(300)), timeline.Segment("running", at(300), at(301))),
        error="boom",
    )
    due = 301 + backoff_ms
    retry = timeline.Bar(
        "attempt 2/3",
        "completed",
        (
            timeline.Segment("backoff", at(301), at(due)),
            timeline.Segment("queued", at(due), at(900)),
            timeline.Segment("running", at(900), at(901)),
        ),
    )
    row = timeline.Row("flaky", "task", "completed", (failed, retry))
    html = timeline._row_html(row, timeline.Scale(t0, at(1000)))
    first, second = (
        [
            (float(x), float(w))
            for x, w in re.findall(r'<rect[^>]* x="([\d.]+)"[^>]* width="([\d.]+)"', g)
        ]
        for g in html.split('<g class="bar')[1:]
    )
    px = timeline.WIDTH / 1000  # per ms
    assert max(x + w for x, w in first) == pytest.approx(301 * px, abs=0.1)
    assert min(x for x, _ in second) == pytest.approx(301 * px, abs=0.1)
    assert max(x + w for x, w in second) == pytest.approx(901 * px, abs=0.1)
    assert all(w >= 2.0 for _, w in first + second)


def test_a_bar_too_short_to_see_is_widened_to_the_left() -> None:
    """An attempt shorter than 2 px in all is drawn 2 px wide, ending where it ended."""
    t0 = datetime(2026, 12, 4, 10, 0, 0, tzinfo=UTC)
    at = lambda ms: t0 + timedelta(milliseconds=ms)  # noqa: E731
    tiny = timeline.Bar(
        "attempt 1/1",
        "completed",
        (
            timeline.Segment("queued", at(500), at(500.5)),
            timeline.Segment("running", at(500.5), at(501)),
        ),
    )
    html = timeline._row_html(
        timeline.Row("quick", "task", "completed", (tiny,)), timeline.Scale(t0, at(1000))
    )
    rects = [
        (float(x), float(w)) for x, w in re.findall(r' x="([\d.]+)"[^>]* width="([\d.]+)"', html)
    ]
    end = 501 * timeline.WIDTH / 1000
    assert min(x for x, _ in rects) == pytest.approx(end - 2.0, abs=0.1)
    assert max(x + w for x, w in rects) == pytest.approx(end, abs=0.1)
