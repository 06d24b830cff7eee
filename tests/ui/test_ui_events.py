"""The run page lists a run's events and each node's latest progress, and refreshes them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from starlette.testclient import TestClient

from cyclone_dsl import Client, StepContext, Worker, step, workflow
from cyclone_dsl.ui import app as ui_app
from cyclone_dsl.ui.app import create_app


@step(name="ui_ev_report")
def report(n: int, ctx: StepContext) -> int:
    for i in range(n):
        ctx.emit({"row": i})
    ctx.progress(n, n * 2, "half way")
    return n


@workflow(name="ui_ev_flow")
def flow(n):  # type: ignore[no-untyped-def]
    return report(n)


def test_the_run_page_shows_events_newest_first_and_the_latest_progress(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(report)
    handle = client.submit(flow, 3)
    handle.wait(timeout=30)
    with TestClient(create_app(client)) as web:
        for url in (f"/runs/{handle.id}", f"/runs/{handle.id}/live"):
            page = web.get(url).text
            seqs = [int(s) for s in page.split('data-seq="')[1:] for s in [s.split('"')[0]]]
            assert seqs == [4, 3, 2, 1]
            assert "&#34;row&#34;: 2" in page
            assert 'data-progress-node="ui_ev_report"' in page
            assert '<progress value="3" max="6">' in page and "half way" in page


def test_the_run_page_lists_only_the_latest_events(
    client: Client, start_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ui_app, "EVENTS_SHOWN", 2)
    start_worker(report)
    handle = client.submit(flow, 5)
    handle.wait(timeout=30)
    with TestClient(create_app(client)) as web:
        page = web.get(f"/runs/{handle.id}").text
    assert page.count("data-seq=") == 2 and 'data-seq="6"' in page
    assert "the latest 2 of 6" in page
