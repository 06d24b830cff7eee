"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright).

It runs the flagship example, sends the signal its run waits for from the
page, watches it complete, cancels another run, and checks that an output
holding ``<script>`` renders as text. Screenshots of the main pages go to
``docs/img/``.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from cyclone_dsl import Client, Registry, Worker
from cyclone_dsl.cli import flagship
from cyclone_dsl.ui.app import create_app
from tests.ui.test_ui_api import echo, waits
from tests.waiting import wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: Screenshots go to a temporary folder; CYCLONE_SCREENSHOTS=1 refreshes the ones in docs/img.
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "img"

if CHROMIUM is None and os.environ.get("CI"):
    raise RuntimeError("CI needs Debian's chromium for the browser tests (.ci/run installs it)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")


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


def test_the_flagship_run_is_steered_from_the_browser(
    server: str, client: Client, cyclone_dsn: str, browser_page: object, tmp_path: Path
) -> None:
    from playwright.sync_api import Page, expect

    shots = DOCS_IMAGES if os.environ.get("CYCLONE_SCREENSHOTS") == "1" else tmp_path

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
        page.goto(f"{server}/runs/{other.id}")
        assert page.evaluate("window.hacked === undefined")
        expect(page.locator("p.meta", has_text="input:")).to_contain_text(
            "<script>window.hacked = true</script>"
        )
        page.click("text=Cancel")
        expect(page.locator("#run-state")).to_have_text("cancelled")
        page.goto(f"{server}/queues")
        page.screenshot(path=str(shots / "queues.png"))
    assert echo  # the module's handlers are registered for the other run
