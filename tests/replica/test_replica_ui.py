"""The dashboard on a read replica: pages read the standby, actions change the primary, the
replica's lag shows, and a replica that is down gives a clear page while actions still work."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from cyclone_dsl import Client, step, wait_signal, workflow
from cyclone_dsl.db.replica import Probe
from cyclone_dsl.ui import replica as ui_replica
from cyclone_dsl.ui.app import CSRF_COOKIE, create_app
from tests.replica.conftest import Pair
from tests.waiting import wait_until


@step(name="replica_echo")
def echo(x: object) -> object:
    return x


@workflow(name="replica_wait")
def waits(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("go"))


#: Every page and read-only endpoint the replica serves (each would fail with a 500 if it
#: wrote: a standby refuses writes).
READ_ROUTES = (
    "/runs",
    "/runs/{id}",
    "/runs/{id}/live",
    "/runs/{id}/steps/replica_echo/output.json",
    "/queues",
    "/fleet",
    "/schedules",
    "/api/counts",
    "/api/stats",
    "/api/runs",
    "/api/runs/{id}",
    "/api/runs/{id}/attempts",
    "/api/workers",
    "/metrics",
)


@pytest.fixture
def primary(live_pair: Pair) -> Iterator[Client]:
    with Client(live_pair.primary_url) as client:
        yield client


@pytest.fixture
def web(live_pair: Pair, primary: Client) -> Iterator[TestClient]:
    with TestClient(create_app(primary, read_dsn=live_pair.replica_url)) as test_client:
        yield test_client


def replica_note(html: str) -> str:
    found = re.search(r"<span[^>]*data-replica[^>]*>([^<]*)</span>", html)
    assert found is not None, "no replica note on the page"
    return found.group(1)


def run_state(html: str) -> str:
    found = re.search(r'id="run-state">(\w+)<', html)
    assert found is not None
    return found.group(1)


def received_not_replayed(pair: Pair) -> None:
    """Wait until the paused replica has received WAL it has not replayed."""
    with Probe(pair.replica_url, name="test-replica") as probe:
        wait_until(lambda: not probe.standby_status().caught_up, what="the replica to receive WAL")


def test_pages_read_the_replica_and_show_its_lag(
    live_pair: Pair, primary: Client, web: TestClient
) -> None:
    first = primary.submit(waits, 1)
    live_pair.caught_up()
    listed = web.get("/runs")
    assert listed.status_code == 200
    assert f'data-run="{first.id}"' in listed.text
    assert re.fullmatch(r"replica (up to date|[\d.]+ m?s behind)", replica_note(listed.text))
    for route in READ_ROUTES:
        response = web.get(route.format(id=first.id))
        assert response.status_code == 200, (route, response.text[:300])

    live_pair.replay(paused=True)
    second = primary.submit(waits, 2)
    received_not_replayed(live_pair)
    behind = web.get("/runs")
    assert f'data-run="{first.id}"' in behind.text
    assert f'data-run="{second.id}"' not in behind.text  # not replayed: the page is the replica's
    assert re.fullmatch(r"replica [\d.]+ (ms|s|min) behind", replica_note(behind.text))
    assert web.get(f"/api/runs/{second.id}").status_code == 404
    assert web.get(f"/runs/{second.id}").status_code == 404
    counted = web.get("/api/counts").json()
    assert counted.get("running", 0) == primary.run_counts()["running"] - 1

    live_pair.replay(paused=False)
    live_pair.caught_up()
    assert f'data-run="{second.id}"' in web.get("/runs").text
    assert web.get(f"/api/runs/{second.id}").status_code == 200


def test_actions_change_the_primary_and_the_next_page_waits_for_the_replica(
    live_pair: Pair, primary: Client, web: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = primary.submit(waits, 1)
    live_pair.caught_up()
    csrf = str(web.get("/runs").cookies.get(CSRF_COOKIE) or web.cookies.get(CSRF_COOKIE))
    # Replayed at once: the page after the action shows it, with no note.
    done = web.post(f"/runs/{handle.id}/pause", data={"csrf": csrf}, follow_redirects=False)
    assert done.status_code == 303
    assert "seen=" in done.headers["location"]
    assert primary.get_run(handle.id).state == "paused"
    after = web.get(done.headers["location"])
    assert run_state(after.text) == "paused"
    assert "data-not-replayed" not in after.text

    # Replay paused: the action still changes the primary, and the page says the replica
    # has not caught up with it instead of passing the old state off as current.
    monkeypatch.setattr(ui_replica, "WAIT_FOR_REPLAY_S", 0.2)
    live_pair.replay(paused=True)
    cancelled = web.post(f"/runs/{handle.id}/cancel", data={"csrf": csrf}, follow_redirects=False)
    assert cancelled.status_code == 303
    assert primary.get_run(handle.id).state == "cancelled"
    stale = web.get(cancelled.headers["location"])
    assert stale.status_code == 200
    assert "data-not-replayed" in stale.text
    assert run_state(stale.text) == "paused"

    live_pair.replay(paused=False)
    fresh = web.get(cancelled.headers["location"])
    assert run_state(fresh.text) == "cancelled"
    assert "data-not-replayed" not in fresh.text


def test_a_replica_that_is_down_gives_a_clear_page_and_actions_still_work(
    live_pair: Pair, primary: Client, web: TestClient
) -> None:
    handle = primary.submit(waits, 1)
    live_pair.caught_up()
    csrf = str(web.get("/runs").cookies.get(CSRF_COOKIE) or web.cookies.get(CSRF_COOKIE))
    live_pair.replica.stop("fast")

    down = web.get("/runs")
    assert down.status_code == 503
    assert "the read replica is unavailable" in down.text
    assert "Traceback" not in down.text
    assert "data-unavailable" in down.text
    api = web.get("/api/counts")
    assert api.status_code == 503 and "read replica is unavailable" in api.json()["error"]

    cancelled = web.post(f"/runs/{handle.id}/cancel", data={"csrf": csrf}, follow_redirects=False)
    assert cancelled.status_code == 303
    assert primary.get_run(handle.id).state == "cancelled"

    live_pair.replica.start()
    live_pair.caught_up()
    back = web.get(f"/runs/{handle.id}")
    assert back.status_code == 200 and run_state(back.text) == "cancelled"


def test_a_replica_down_from_the_start_does_not_stop_the_app(primary: Client) -> None:
    nowhere = "postgresql://postgres@/postgres?host=/nonexistent-cyclone-socket&port=5432"
    with TestClient(create_app(primary, read_dsn=nowhere)) as web:
        page = web.get("/runs")
        assert page.status_code == 503
        assert "cannot connect to socket /nonexistent-cyclone-socket:5432" in page.text
        assert web.get("/metrics").status_code == 503


def test_without_a_read_dsn_nothing_reads_a_replica(live_pair: Pair, primary: Client) -> None:
    live_pair.replay(paused=True)
    handle = primary.submit(waits, 1)
    with TestClient(create_app(primary)) as web:
        page = web.get("/runs")
        assert f'data-run="{handle.id}"' in page.text
        assert "data-replica" not in page.text
        csrf = str(web.cookies.get(CSRF_COOKIE))
        done = web.post(f"/runs/{handle.id}/cancel", data={"csrf": csrf}, follow_redirects=False)
        assert "seen=" not in done.headers["location"]
