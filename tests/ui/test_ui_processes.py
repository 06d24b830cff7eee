"""The dashboard with real worker processes: the attempt history across a SIGKILL, and
the fleet page marking a killed worker gone once its beats stop."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from starlette.testclient import TestClient

from cyclone_dsl import Client, Worker
from cyclone_dsl.states import RunState
from cyclone_dsl.ui.app import create_app
from tests.faults import handlers
from tests.faults.conftest import fault_log, read_log, spawn_worker, wait_for

__all__ = ["fault_log", "spawn_worker"]  # fixtures

Spawn = Callable[..., subprocess.Popen[str]]


def worker_of(client: Client, pid: int, live_for: timedelta | None = None) -> dict[str, object]:
    (row,) = [w for w in client.workers(live_for=live_for) if w["pid"] == pid]
    return row


def test_the_attempts_of_a_step_across_a_sigkill_reclaim(
    client: Client, spawn_worker: Spawn, fault_log: Path, start_worker: Callable[..., Worker]
) -> None:
    victim = spawn_worker(CYCLONE_FAULT_SLEEP="30")
    handle = client.enqueue(handlers.work, 1)
    wait_for(lambda: len(read_log(fault_log)) == 1)
    victim_id = worker_of(client, victim.pid)["id"]
    victim.kill()
    victim.wait(10)
    start_worker(handlers, lease=1.0)
    assert handle.wait(timeout=30).state is RunState.COMPLETED
    with TestClient(create_app(client)) as web:
        listed = web.get(f"/api/runs/{handle.id}/attempts").json()["fault_work"]
        assert [(a["number"], a["outcome"]) for a in listed] == [(1, "reclaimed"), (1, "completed")]
        reclaimed, completed = (a["worker"] for a in listed)
        assert reclaimed == victim_id
        assert completed and completed != victim_id  # the worker that completed it
        first, second = listed
        assert first["error_kind"] == "reclaimed" and second["error"] is None
        assert first["started_at"] < first["ended_at"] <= second["started_at"] < second["ended_at"]
        # The page lists both, numbered as the CLI numbers them, and the step has no error.
        page = web.get(f"/runs/{handle.id}").text
        row = page[page.index('<tr id="node-fault_work"') :]
        row = row[: row.index("</tr>")]
        shown = re.findall(r'<li data-attempt="(\d+)" data-outcome="(\w+)"><b>([^<]+)</b>', row)
        assert shown == [("1", "reclaimed", "attempt 1/3"), ("1", "completed", "attempt 1/3")]
        assert f"<code>{victim_id}</code>" in row
        error_cell = row.split("<td>")[10]
        assert "error-text" not in error_cell
        # The timeline draws one bar per attempt, the reclaimed one first.
        timeline = page[page.index('data-node="fault_work" data-state') :]
        bars = re.findall(
            r'data-outcome="(\w+)"[^>]*data-attempt="(\d+)"', timeline.split("</div>")[0]
        )
        assert bars == [("reclaimed", "1"), ("completed", "1")]


def test_the_fleet_page_marks_a_killed_worker_gone(
    client: Client, spawn_worker: Spawn, fault_log: Path
) -> None:
    live_for = timedelta(seconds=1.5)
    beating = {"CYCLONE_FAULT_BEAT": "0.2", "CYCLONE_FAULT_SLEEP": "30"}
    first, second = spawn_worker(**beating), spawn_worker(**beating)
    pids = {first.pid, second.pid}
    wait_for(lambda: {w["pid"] for w in client.workers(live_for=live_for) if w["live"]} >= pids)
    handle = client.enqueue(handlers.work, 1)
    wait_for(lambda: len(read_log(fault_log)) == 1)
    busy_pid = read_log(fault_log)[0][0]
    idle = second if busy_pid == first.pid else first

    def statuses(web: TestClient) -> dict[int, tuple[str, str]]:
        page = web.get("/fleet").text
        rows = re.findall(
            r'<tr data-worker="[^"]*" data-pid="(\d+)" data-status="(\w+)">(.*?)</tr>', page, re.S
        )
        return {
            int(pid): (status, re.findall(r'<td class="slots">([^<]+)</td>', row)[0])
            for pid, status, row in rows
        }

    with TestClient(create_app(client, live_for=live_for)) as web:
        before = statuses(web)
        assert before == {busy_pid: ("live", "1/8"), idle.pid: ("live", "0/8")}
        page = web.get("/fleet").text
        assert "fault_work" in page and "fault_with_child" in page  # kinds and versions
        idle.kill()
        idle.wait(10)
        wait_for(lambda: statuses(web)[idle.pid][0] == "gone", timeout=15)
        assert statuses(web) == {busy_pid: ("live", "1/8"), idle.pid: ("gone", "0/8")}
        api = {w["pid"]: w["status"] for w in web.get("/api/workers").json()}
        assert api == {busy_pid: "live", idle.pid: "gone"}
    client.cancel(handle.id)
