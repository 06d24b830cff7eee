"""The run page's timeline and attempt list, from a real run: one bar per attempt in
order, a backoff before a retry, waits drawn as waits, fan-out items collapsed."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable

from starlette.testclient import TestClient

from cyclone_dsl import Client, Worker
from cyclone_dsl.ui.app import create_app
from tests.ui import tour


def test_dump(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(tour)
    handle = client.submit(tour.tour, 2)
    import time

    time.sleep(2.0)
    client.signal(handle.id, "go", {"by": "me"})
    handle.result(timeout=20)
    with TestClient(create_app(client)) as web:
        open("/tmp/d3/run.html", "w").write(web.get(f"/runs/{handle.id}").text)
        open("/tmp/d3/fleet.html", "w").write(web.get("/fleet").text)
        assert web.get(f"/runs/{handle.id}/live").status_code == 200
