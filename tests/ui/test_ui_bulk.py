"""Bulk actions from the runs list: the count to confirm, then the action, by the filter."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from cyclone_dsl import Client, wait_signal, workflow
from cyclone_dsl.states import RunState
from cyclone_dsl.ui.app import CSRF_COOKIE, create_app


@workflow(name="ui_bulk_a")
def flow_a(x):  # type: ignore[no-untyped-def]
    return wait_signal("go")


@workflow(name="ui_bulk_b")
def flow_b(x):  # type: ignore[no-untyped-def]
    return wait_signal("go")


@pytest.fixture
def web(client: Client) -> Iterator[TestClient]:
    with TestClient(create_app(client)) as test_client:
        yield test_client


def csrf_of(web: TestClient) -> str:
    web.get("/runs")
    return str(web.cookies.get(CSRF_COOKIE))


def test_cancel_the_runs_a_filter_matches_after_confirming_the_count(
    web: TestClient, client: Client
) -> None:
    targets = [client.submit(flow_a, i).id for i in range(3)]
    other = client.submit(flow_b, 0).id
    listed = web.get("/runs", params={"workflow": "ui_bulk_a"})
    assert 'name="workflow" value="ui_bulk_a"' in listed.text  # the bulk form takes the filter
    csrf = str(web.cookies.get(CSRF_COOKIE))
    form = {"csrf": csrf, "action": "cancel", "workflow": "ui_bulk_a"}
    confirm = web.post("/bulk/preview", data=form)
    assert confirm.status_code == 200
    assert 'data-matched="3"' in confirm.text
    # A preview is a dry run: nothing changed yet.
    assert {client.get_run(r).state for r in targets} == {RunState.RUNNING}
    # The confirmation form carries the same filter.
    assert re.search(r'<input type="hidden" name="workflow" value="ui_bulk_a">', confirm.text)
    done = web.post("/bulk/apply", data=form, follow_redirects=False)
    assert done.status_code == 303
    assert "cancel%3A+3+of+3+matching+runs" in done.headers["location"]
    assert {client.get_run(r).state for r in targets} == {RunState.CANCELLED}
    assert client.get_run(other).state is RunState.RUNNING
    again = web.post("/bulk/preview", data=form)
    assert 'data-matched="0"' in again.text  # idempotent: nothing left to cancel


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "needs a filter"),
        ({"q": "abc", "workflow": "ui_bulk_a"}, "do not filter by text"),
        ({"workflow": "ui_bulk_a", "since": "2026-01-01T00:00"}, "timezone"),
        ({"workflow": "ui_bulk_a", "action": "purge"}, "unknown bulk action"),
    ],
)
def test_a_bulk_form_the_filter_cannot_take_is_refused_in_one_line(
    web: TestClient, client: Client, fields: dict[str, str], message: str
) -> None:
    run_id = client.submit(flow_a, 0).id
    data = {"csrf": csrf_of(web), "action": "cancel", **fields}
    refused = web.post("/bulk/preview", data=data, follow_redirects=False)
    assert refused.status_code == 303
    assert "/runs?" in refused.headers["location"]
    shown = web.get(refused.headers["location"]).text
    assert message in shown.replace("&#39;", "'")
    assert client.get_run(run_id).state is RunState.RUNNING


def test_bulk_writes_need_the_csrf_token_and_a_writable_dashboard(client: Client) -> None:
    run_id = client.submit(flow_a, 0).id
    with TestClient(create_app(client)) as web:
        refused = web.post("/bulk/apply", data={"action": "cancel", "workflow": "ui_bulk_a"})
        assert refused.status_code == 403
    with TestClient(create_app(client, read_only=True)) as web:
        assert 'action="/bulk/preview"' not in web.get("/runs").text
        csrf = str(web.cookies.get(CSRF_COOKIE))
        data = {"csrf": csrf, "action": "cancel", "workflow": "ui_bulk_a"}
        assert web.post("/bulk/apply", data=data).status_code == 403
    assert client.get_run(run_id).state is RunState.RUNNING
