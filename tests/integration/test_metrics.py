"""Prometheus metrics: a worker's /metrics agrees with the database's own counts after a load,
the database-wide gauges match what is stored, and importing cyclone_dsl stays free of
prometheus_client."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from cyclone_dsl import Client, Permanent, StepContext, Worker, step, wait_signal, workflow
from cyclone_dsl.errors import InvalidArgument
from cyclone_dsl.ui.app import create_app
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
RUNS = 300
blocker = threading.Event()


@step(name="mx_first")
def first(n: int) -> int:
    return n


@step(name="mx_second", max_attempts=2)
async def second(n: int, *, ctx: StepContext) -> int:
    if n % 50 == 7:
        raise Permanent("fails for good")
    if n % 25 == 0 and ctx.attempt == 1:
        raise RuntimeError("fails once")
    return n + 1


@workflow(name="mx_pair")
def pair(n):  # type: ignore[no-untyped-def]
    return second(first(n))


@step(name="mx_blocked")
def blocked(n: int) -> int:
    blocker.wait(20)
    return n


@workflow(name="mx_waits")
def waits(n):  # type: ignore[no-untyped-def]
    return first(wait_signal("go"))


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of a scrape, by (name, sorted labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse(response.read().decode())


def total(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def db_count(dsn: str, query: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query).fetchone()  # type: ignore[arg-type]
        assert row is not None
        return int(row[0])


def test_counters_agree_with_the_database_after_a_load(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    client.submit_many(pair, list(range(RUNS)))
    workers = [
        start_worker(pair, metrics_port=0, metrics_host="127.0.0.1", concurrency=8, max_async=8)
        for _ in range(2)
    ]
    ports = [w.metrics_port for w in workers]
    assert all(ports) and ports[0] != ports[1]

    def ended() -> bool:
        for port in ports:  # scraped while the load runs: the text parses every time
            scrape(port)
        counts = client.run_counts()
        return sum(counts.values()) == RUNS and not counts.get("running")

    wait_until(ended, timeout=60, what="every run ended")
    completed = db_count(
        cyclone_dsn, "SELECT count(*) FROM cyclone_steps WHERE state = 'completed'"
    )
    retried = db_count(
        cyclone_dsn, "SELECT count(*) FROM cyclone_ext_attempts WHERE outcome = 'retried'"
    )
    failed = db_count(
        cyclone_dsn, "SELECT count(*) FROM cyclone_ext_attempts WHERE outcome = 'failed'"
    )
    runs_ended = db_count(
        cyclone_dsn, "SELECT count(*) FROM cyclone_runs WHERE finished_at IS NOT NULL"
    )
    assert (retried, failed, runs_ended) == (12, 6, RUNS)  # n % 25 == 0, n % 50 == 7

    def summed(name: str, **labels: str) -> float:
        return sum(total(scrape(port), name, **labels) for port in ports)

    # The counters move just after each commit: wait for the last ones.
    wait_until(
        lambda: summed("cyclone_steps_completed_total") == completed,
        what="the completed counters to reach the database's count",
    )
    samples = [scrape(port) for port in ports]

    def both(name: str, **labels: str) -> float:
        return sum(total(s, name, **labels) for s in samples)

    assert both("cyclone_steps_completed_total", kind="mx_first") == RUNS
    assert both("cyclone_steps_retried_total") == retried
    assert both("cyclone_steps_retried_total", queue="default", kind="mx_second") == retried
    assert both("cyclone_steps_failed_total") == failed
    assert both("cyclone_steps_fenced_total") == 0
    claimed = completed + retried + failed
    assert both("cyclone_steps_claimed_total") == claimed
    assert both("cyclone_step_handler_seconds_count") == claimed
    assert both("cyclone_step_claim_to_start_seconds_count") == claimed
    assert both("cyclone_run_duration_seconds_count") == runs_ended
    assert both("cyclone_run_duration_seconds_count", workflow="mx_pair", state="failed") == failed
    assert all(total(s, "cyclone_worker_listener_connected") == 1 for s in samples)
    # 8 slots for the sync handlers and 8 for the async ones (which start at their cap).
    assert all(total(s, "cyclone_worker_slots") == 16 for s in samples)
    assert all(total(s, "cyclone_worker_slots_in_use") == 0 for s in samples)
    assert all(total(s, "cyclone_database_gauges_up") == 1 for s in samples)
    # Labels stay bounded: queue and kind, never a run or a step.
    labels = {name for s in samples for (_, ls) in s for name, _ in ls}
    assert labels <= {"queue", "kind", "workflow", "state", "le"}


def test_a_step_cancelled_while_it_runs_counts_as_fenced(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    blocker.clear()
    worker = start_worker(blocked, metrics_port=0, metrics_host="127.0.0.1")
    assert worker.metrics_port is not None
    port = worker.metrics_port
    handle = client.enqueue(blocked, 1)
    wait_until(
        lambda: total(scrape(port), "cyclone_worker_slots_in_use") == 1, what="the handler runs"
    )
    client.cancel(handle.id)
    wait_until(
        lambda: total(scrape(port), "cyclone_steps_fenced_total", kind="mx_blocked") == 1,
        what="the cancelled step counted as fenced",
    )
    blocker.set()
    wait_until(
        lambda: total(scrape(port), "cyclone_worker_slots_in_use") == 0, what="its slot is free"
    )
    samples = scrape(port)
    assert total(samples, "cyclone_steps_completed_total") == 0
    assert total(samples, "cyclone_step_handler_seconds_count") == 1


def test_the_dashboard_serves_the_database_wide_gauges(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    client.submit_many(pair, [1, 2, 3])
    client.submit_many(waits, [1, 2])
    client.enqueue(first, 5, queue="other")
    with TestClient(create_app(client)) as web:
        response = web.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        samples = parse(response.text)
    steps = {
        (dict(ls)["queue"], dict(ls)["state"]): v
        for (n, ls), v in samples.items()
        if n == "cyclone_queue_steps"
    }
    assert steps == {
        ("default", "available"): 3,
        ("default", "pending"): 5,
        ("default", "waiting_signal"): 2,
        ("other", "available"): 1,
    }
    assert total(samples, "cyclone_runs_open", state="running") == 6
    assert total(samples, "cyclone_runs_waiting") == 2
    assert total(samples, "cyclone_database_gauges_up") == 1
    oldest = {
        dict(ls)["queue"]: v
        for (n, ls), v in samples.items()
        if n == "cyclone_queue_oldest_runnable_age_seconds"
    }
    assert set(oldest) == {"default", "other"} and all(v >= 0 for v in oldest.values())
    # The same figures are in each worker's /metrics.
    worker = start_worker(blocked, metrics_port=0, metrics_host="127.0.0.1", queues=["none"])
    assert worker.metrics_port is not None
    from_worker = scrape(worker.metrics_port)
    assert total(from_worker, "cyclone_queue_steps", queue="default", state="pending") == 5


def test_metrics_port_is_checked(cyclone_dsn: str) -> None:
    for port in (-1, 70000, True, "9100"):
        with pytest.raises(InvalidArgument, match="metrics_port"):
            Worker(cyclone_dsn, [first], metrics_port=port)  # type: ignore[arg-type]


def test_importing_cyclone_does_not_import_prometheus_client() -> None:
    code = (
        "import sys, cyclone_dsl, cyclone_dsl.worker.worker, cyclone_dsl.observability, "
        "cyclone_dsl.ui.app, cyclone_dsl.cli.commands\n"
        "from cyclone_dsl import Worker\n"
        "assert 'prometheus_client' not in sys.modules, 'imported'\n"
        "import cyclone_dsl.observability.metrics\n"
        "assert 'prometheus_client' in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_the_grafana_dashboard_uses_only_exported_metrics(
    start_worker: Callable[..., Worker],
) -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana" / "cyclone.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {
        re.sub(r"_(total|bucket|count|sum)$", "", name)
        for expr in exprs
        for name in re.findall(r"cyclone_[a-z_]+", expr)
    }
    worker = start_worker(first, metrics_port=0, metrics_host="127.0.0.1")
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        exported = {f.name for f in text_string_to_metric_families(response.read().decode())}
    assert used and used <= exported, used - exported
