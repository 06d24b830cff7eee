"""Audit: the operations docs as a contract (docs/howto/deploy.md, docs/howto/monitoring.md,
docs/howto/scale.md on one machine, docs/reference/cli.md, docs/reference/errors.md).

Each test runs a concrete claim of those pages that no other test checks: the grants an
application role needs, the connections a worker and a client hold, the database-wide
gauges for paused runs, timers and child runs, the CLI worker's stop on SIGTERM, the log
levels of ``cyclone worker``, what the bulk commands select, and what ``cyclone run``
prints. Time is moved with the ``clock`` fixture, never waited out.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    Client,
    Permanent,
    RunFailed,
    RunHandle,
    RunState,
    StepContext,
    StepState,
    Worker,
    child,
    migrate,
    step,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.migrate import LATEST_SCHEMA_VERSION
from tests.cli.runner import Cli, in_process
from tests.roles import application_role
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
StartWorker = Callable[..., Worker]
Clock = Callable[[datetime | timedelta], None]
GATE = threading.Event()

# -- handlers -------------------------------------------------------------------------------


@step(name="ops_add")
def ops_add(x: int) -> int:
    return x + 1


@step(name="ops_nobody", queue="ops_unserved")
def ops_nobody(x: int) -> int:
    return x


@step(name="ops_child_step", queue="ops_child_q")
def ops_child_step(x: int) -> int:
    return x


@workflow(name="ops_child_flow")
def ops_child_flow(x):  # type: ignore[no-untyped-def]
    return ops_child_step(x)


@workflow(name="ops_parent_flow")
def ops_parent_flow(x):  # type: ignore[no-untyped-def]
    return ops_add(child(ops_child_flow, x))


@workflow(name="ops_timer_flow")
def ops_timer_flow(x):  # type: ignore[no-untyped-def]
    return ops_add(x, after=[wait_timer(timedelta(hours=1))])


@workflow(name="ops_signal_flow")
def ops_signal_flow(x):  # type: ignore[no-untyped-def]
    return ops_add(wait_signal("ops_go"))


@workflow(name="ops_unserved_flow")
def ops_unserved_flow(x):  # type: ignore[no-untyped-def]
    return ops_nobody(x)


@step(name="ops_emit")
def ops_emit(x: int, *, ctx: StepContext) -> int:
    ctx.emit({"x": x})
    ctx.progress(1, 1)
    return x


@step(name="ops_flaky", max_attempts=5)
def ops_flaky(x: int, *, ctx: StepContext) -> int:
    if ctx.attempt == 1:
        raise RuntimeError("ops first attempt fails")
    return x


@step(name="ops_boom", max_attempts=1)
def ops_boom(x: int) -> int:
    raise Permanent(f"ops boom {x}")


@workflow(name="ops_failing_flow")
def ops_failing_flow(x):  # type: ignore[no-untyped-def]
    return ops_boom(x)


@step(name="ops_block")
def ops_block(x: int) -> int:
    logging.getLogger("ops.handler").info("ops info line %s", x)
    logging.getLogger("ops.handler").warning("ops warning line %s", x)
    GATE.wait(120)
    return x


@step(name="ops_block_once", max_reclaims=0)
def ops_block_once(x: int) -> int:
    GATE.wait(120)
    return x


# -- helpers --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _gate() -> Iterator[None]:
    GATE.clear()
    yield
    GATE.set()


@pytest.fixture
def cli(cyclone_dsn: str) -> Cli:
    return in_process(cyclone_dsn)


def schema_of(dsn: str) -> str:
    match = re.search(r"search_path=(\w+)", dsn)
    assert match is not None, dsn
    return match.group(1)


@pytest.fixture
def app_role(cyclone_dsn: str, cyclone_admin_dsn: str) -> Iterator[tuple[str, str]]:
    """(role name, DSN) of a login role with exactly the grants deploy.md lists for the
    application: USAGE on the schema, SELECT, INSERT, UPDATE and DELETE on the tables, and
    USAGE on the sequences."""
    with application_role(cyclone_admin_dsn, schema_of(cyclone_dsn), prefix="ops") as (dsn, role):
        yield role, dsn


def sessions_of(admin_dsn: str, role: str) -> dict[str, int]:
    """The open sessions of ``role``, counted by application name (pid suffix dropped)."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity WHERE usename = %s"
            " GROUP BY application_name",
            (role,),
        ).fetchall()
    return {re.sub(r"-\d+$", "", str(app)): int(n) for app, n in rows}


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        assert match is not None, line
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or "")))
        samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CYCLONE_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


MODULE = "tests.integration.test_ops_docs_audit"


def spawn_worker(dsn: str, *args: str, verbose: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cyclone_dsl.cli",
            "--dsn",
            dsn,
            *(["-v"] if verbose else []),
            "worker",
            MODULE,
            "--processes",
            "1",
            "--poll-interval",
            "0.2",
            *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )


def enqueued_and_running(client: Client, blocking: Any, value: int) -> RunHandle:
    """Enqueue a blocking step and wait until a worker runs it."""
    handle = client.enqueue(blocking, value)
    wait_until(
        lambda: client.get_run(handle.id).steps[0].state == StepState.RUNNING,
        what="the worker to run the blocking handler",
    )
    return handle


def finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the worker did not exit within {timeout}s: {err[-2000:]}")
    return proc.returncode, out, err


# -- monitoring.md: the database-wide gauges ------------------------------------------------


def test_ops_gauges_count_paused_runs_timers_child_runs_and_only_due_work(
    client: Client, clock: Clock
) -> None:
    """monitoring.md: cyclone_queue_steps by queue and state (``paused`` among them),
    cyclone_runs_open by state (running, paused), cyclone_runs_waiting counts runs waiting on
    a signal, a timer or a child run, and the oldest runnable age is that of the oldest
    *due* available step, 0 when there is none."""
    from starlette.testclient import TestClient

    from cyclone_dsl.ui.app import create_app

    timer = client.submit(ops_timer_flow, 1)
    parent = client.submit(ops_parent_flow, 2)
    signalled = client.submit(ops_signal_flow, 3)
    paused = client.submit(ops_unserved_flow, 4)
    client.pause(paused.id)
    later = datetime.now(UTC) + timedelta(hours=2)
    client.enqueue(ops_add, 5, queue="ops_future", scheduled_at=later)
    client.enqueue(ops_add, 6, queue="ops_due")
    clock(timedelta(minutes=10))

    with TestClient(create_app(client)) as web:
        answer = web.get("/metrics")
    assert answer.status_code == 200, answer.text
    samples = parse_metrics(answer.text)

    def value(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    assert value("cyclone_database_gauges_up") == 1
    steps = {
        (dict(ls)["queue"], dict(ls)["state"]): v
        for (n, ls), v in samples.items()
        if n == "cyclone_queue_steps"
    }
    assert steps == {
        ("default", "waiting_timer"): 1,
        ("default", "waiting_child"): 1,
        ("default", "waiting_signal"): 1,
        ("default", "pending"): 3,
        ("ops_child_q", "available"): 1,
        ("ops_unserved", "paused"): 1,
        ("ops_future", "available"): 1,
        ("ops_due", "available"): 1,
    }, steps
    # The parent, the child run, the timer's, the signal's and the two enqueued: running.
    assert value("cyclone_runs_open", state="running") == 6
    assert value("cyclone_runs_open", state="paused") == 1
    assert value("cyclone_runs_waiting") == 3  # the timer's, the parent's, the signal's
    assert value("cyclone_queue_oldest_runnable_age_seconds", queue="ops_future") == 0
    due_age = value("cyclone_queue_oldest_runnable_age_seconds", queue="ops_due")
    assert due_age is not None and 590 <= due_age <= 700, due_age
    assert {client.get_run(h.id).state for h in (timer, parent, signalled)} == {RunState.RUNNING}


# -- deploy.md: the application role's grants -----------------------------------------------


def test_ops_an_application_role_with_the_documented_grants_runs_the_whole_life_cycle(
    app_role: tuple[str, str], cyclone_dsn: str, clock: Clock
) -> None:
    """deploy.md: the application's role (clients, workers, the dashboard) needs USAGE on
    the schema, SELECT/INSERT/UPDATE/DELETE on the tables and USAGE on their sequences; on a
    current schema ``migrate()`` creates nothing, so that role may call it on every start."""
    _, dsn = app_role
    assert migrate(dsn) == LATEST_SCHEMA_VERSION
    with Client(dsn) as client:
        worker = Worker(
            dsn,
            [ops_add, ops_emit, ops_flaky, ops_signal_flow, ops_timer_flow, ops_failing_flow],
            poll_interval=0.5,
            scan_interval=0.5,
            grace=5.0,
            metrics_port=0,
            metrics_host="127.0.0.1",
            retention=timedelta(seconds=1),
        )
        with worker:
            assert client.submit(ops_signal_flow, 1).id > 0
            assert [w for w in client.workers() if w["live"]]
            waiting = client.list_runs()[0]
            client.signal(waiting.id, "ops_go", 41)
            assert client.result(waiting.id, timeout=30) == 42
            assert client.enqueue(ops_emit, 3).result(timeout=30) == 3
            assert client.enqueue(ops_flaky, 4).result(timeout=30) == 4  # a retry
            failed = client.submit(ops_failing_flow, 5)
            with pytest.raises(RunFailed):
                failed.result(timeout=30)
            client.retry(failed.id, "ops_boom")  # a retry resets the steps
            timer = client.submit(ops_timer_flow, 6)
            clock(timedelta(hours=2))  # the scanner fires the timer
            assert timer.result(timeout=30) == 7
            paused = client.submit(ops_signal_flow, 7)
            client.pause(paused.id)
            client.resume(paused.id)
            client.cancel(paused.id)
            client.schedule(ops_add, "* * * * *", id="ops_every_minute", input=1)
            client.enable_schedule("ops_every_minute", False)
            client.set_queue_limit("default", 5)
            client.set_queue_limit("default", None)
            assert client.stats()["kinds"] is not None
            assert client.gauges() is not None
            assert client.events_of(client.list_runs(limit=100)[-1].id) is not None
            clock(timedelta(days=30))  # retention deletes the ended runs in the scanner
            wait_until(
                lambda: client.list_runs(state=RunState.COMPLETED) == [],
                what="the worker's retention to delete the completed runs",
            )
            assert client.purge(older_than=timedelta(0)) >= 0
            client.unschedule("ops_every_minute")
        assert worker.metrics_port is not None


# -- scale.md: connections per worker process and per client --------------------------------


def test_ops_a_worker_and_a_client_hold_the_connections_the_table_lists(
    app_role: tuple[str, str], cyclone_admin_dsn: str
) -> None:
    """scale.md: a worker process holds a pool of up to 5, 1 for heartbeats, 1 for LISTEN
    and 1 for step events from the first event; a Client holds up to pool_size (4) plus one
    while any of its wait()/result()/events() calls is in progress, all sharing it."""
    role, dsn = app_role
    seen: list[dict[str, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(sessions_of(cyclone_admin_dsn, role))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with (
            Client(dsn) as client,
            Worker(dsn, [ops_emit, ops_add], concurrency=20, poll_interval=0.5),
        ):
            handles = [client.enqueue(ops_emit, i) for i in range(60)]
            handles += [client.enqueue(ops_add, i) for i in range(60)]
            results: list[object] = []
            lock = threading.Lock()

            def wait_some(part: list[Any]) -> None:
                for handle in part:
                    got = handle.result(timeout=60)
                    with lock:
                        results.append(got)

            threads = [threading.Thread(target=wait_some, args=(handles[i::8],)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(90)
            assert len(results) == len(handles)
    finally:
        stop.set()
        sampler.join(10)
    assert seen
    worst: dict[str, int] = {}
    for snapshot in seen:
        for app, n in snapshot.items():
            worst[app] = max(worst.get(app, 0), n)
    worker_side = {
        k: v for k, v in worst.items() if not k.startswith(("cyclone-client", "cyclone-wait"))
    }
    assert worst["cyclone-worker"] >= 1 and worst["cyclone-emit"] == 1, worst
    assert worst.get("cyclone-client", 0) <= 4, worst
    assert worst.get("cyclone-wait", 0) <= 1, worst
    assert worker_side.get("cyclone-worker", 0) <= 5, worst
    assert worker_side.get("cyclone-heartbeat", 0) <= 1, worst
    assert worker_side.get("cyclone-listen", 0) <= 1, worst
    assert worker_side.get("cyclone-emit", 0) <= 1, worst
    peak = max(
        sum(
            n
            for app, n in snapshot.items()
            if not app.startswith(("cyclone-client", "cyclone-wait"))
        )
        for snapshot in seen
    )
    assert peak <= 8, (peak, worst)


# -- deploy.md: a CLI worker's stop --------------------------------------------------------


def test_ops_sigterm_releases_the_held_step_after_the_grace_and_logs_warnings_only(
    cyclone_dsn: str, client: Client
) -> None:
    """deploy.md: on SIGTERM no new claims; running handlers get --grace seconds; leases
    still held are then released, so another worker starts those steps at once.
    monitoring.md: without -v only warnings and errors are printed."""
    GATE.clear()
    proc = spawn_worker(cyclone_dsn, "--grace", "1", "--lease", "300")
    try:
        handle = enqueued_and_running(client, ops_block, 1)
        proc.send_signal(signal.SIGTERM)
        code, _, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    step_row = client.get_run(handle.id).steps[0]
    # released: available again at once, not left running until its 300 s lease expires
    assert step_row.state == StepState.AVAILABLE, (step_row, err)
    assert step_row.lease_owner is None
    assert step_row.attempt == 0  # the attempt is not consumed
    assert code == 0, err
    assert "ops warning line 1" in err
    assert "ops info line 1" not in err, err


def test_ops_a_second_signal_exits_at_once_and_the_lease_is_reclaimed_later(
    cyclone_dsn: str, client: Client, cli: Cli, clock: Clock
) -> None:
    """deploy.md: a second signal exits immediately (leases then expire and are reclaimed).
    monitoring.md: ``-v`` logs at INFO."""
    GATE.clear()
    proc = spawn_worker(cyclone_dsn, "--grace", "60", "--lease", "5", verbose=True)
    try:
        handle = enqueued_and_running(client, ops_block, 2)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, _, err = finish(proc, timeout=20)  # far below the 60 s grace
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "ops info line 2" in err, err
    assert client.get_run(handle.id).steps[0].state == StepState.RUNNING  # still leased
    clock(timedelta(seconds=40))
    # cli.md: ``cyclone workers`` lists live workers, ``--all`` stopped and silent ones too
    assert json.loads(cli("workers", "--json").stdout) == []
    every = json.loads(cli("workers", "--all", "--json").stdout)
    assert len(every) == 1 and every[0]["live"] is False, every
    done = cli("scan", "--once")
    assert done.returncode == 0, done.stderr
    step_row = client.get_run(handle.id).steps[0]
    assert step_row.state == StepState.AVAILABLE, step_row
    assert step_row.reclaims == 1
    assert step_row.attempt == 0 or step_row.attempt == 1, step_row


def test_ops_cyclone_scan_keeps_a_steps_max_reclaims_of_zero(
    cyclone_dsn: str, client: Client, cli: Cli, clock: Clock
) -> None:
    """A step declaring ``max_reclaims=0`` fails at its first expired lease, whichever
    scanner finds it. ``cyclone scan`` took only the kinds' limits that were true, and
    gave such a step its default of 3 reclaims."""
    GATE.clear()
    proc = spawn_worker(cyclone_dsn, "--lease", "5")
    try:
        handle = enqueued_and_running(client, ops_block_once, 2)
    finally:
        proc.kill()  # its lease stays, to expire
        proc.wait(timeout=20)
    clock(timedelta(seconds=40))
    done = cli("scan", "--once", "-m", MODULE)
    assert done.returncode == 0, done.stderr
    step_row = client.get_run(handle.id).steps[0]
    assert (step_row.state, step_row.error_kind) == (StepState.DISCARDED, "reclaim_limit"), step_row


@pytest.mark.parametrize("command", ["scan", "worker"])
def test_ops_max_reclaims_option_sets_the_default_of_steps_without_their_own(
    cyclone_dsn: str, client: Client, cli: Cli, clock: Clock, command: str
) -> None:
    """``--max-reclaims N`` is, for the command line, the Python ``Worker(max_reclaims=N)``:
    the reclaims a step that declares no ``max_reclaims`` of its own gets. Both the scanner
    alone and a worker's own scanner took 3, whatever the Python workers said."""
    GATE.clear()
    holder = spawn_worker(cyclone_dsn, "--lease", "1")
    try:
        handle = enqueued_and_running(client, ops_block, 3)
    finally:
        holder.kill()  # its lease stays, to expire (a worker process sees no moved clock)
        holder.wait(timeout=20)
    if command == "scan":
        clock(timedelta(seconds=40))
        done = cli("scan", "--once", "--max-reclaims", "0", "-m", MODULE)
        assert done.returncode == 0, done.stderr
    else:
        scanning = spawn_worker(cyclone_dsn, "--max-reclaims", "0", "--queues", "ops_none")
        try:
            wait_until(
                lambda: client.get_run(handle.id).steps[0].state == StepState.DISCARDED,
                what="the worker's scanner to end the step at its first expired lease",
            )
        finally:
            scanning.kill()
            scanning.wait(timeout=20)
    step_row = client.get_run(handle.id).steps[0]
    assert (step_row.state, step_row.error_kind) == (StepState.DISCARDED, "reclaim_limit"), step_row


@pytest.mark.parametrize("command", ["scan", "worker"])
def test_ops_max_reclaims_option_refuses_a_negative_count(cli: Cli, command: str) -> None:
    done = (
        cli(command, MODULE, "--max-reclaims", "-1")
        if command == "worker"
        else cli(command, "--max-reclaims", "-1")
    )
    assert done.returncode == 2, done.stderr
    assert "--max-reclaims" in done.stderr, done.stderr


# -- cli.md: what the commands print and select ---------------------------------------------


def test_ops_cyclone_run_shows_the_attempt_as_ctx_attempt_counts_it(
    cli: Cli, client: Client, start_worker: StartWorker
) -> None:
    """cli.md: ``cyclone run ID`` shows every node with its attempt (``attempt 2/5``,
    counted from 1 as ``ctx.attempt``); ``--json`` has each step's failed attempts."""
    start_worker(ops_flaky)
    handle = client.enqueue(ops_flaky, 9)
    assert handle.result(timeout=30) == 9
    shown = cli("run", str(handle.id))
    assert shown.returncode == 0, shown.stderr
    assert "attempt 2/5" in shown.stdout, shown.stdout
    data = json.loads(cli("run", str(handle.id), "--json").stdout)
    (row,) = data["steps"]
    assert len(row["attempts"]) == 1, row
    assert "ops first attempt fails" in json.dumps(row["attempts"][0])


def test_ops_cancel_many_takes_the_child_runs_and_retry_many_takes_only_failed_runs(
    cli: Cli, client: Client, start_worker: StartWorker
) -> None:
    """cli.md: cancel-many cancels every running or paused run the filter selects, child
    runs included; retry-many retries every failed run (``--state cancelled``: cancelled
    runs too)."""
    parent = client.submit(ops_parent_flow, 1)
    (kid,) = client.list_runs(parent_run_id=parent.id)
    other = client.submit(ops_signal_flow, 2)
    done = cli("cancel-many", "--workflow", "ops_parent_flow", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    assert client.get_run(parent.id).state == RunState.CANCELLED
    assert client.get_run(kid.id).state == RunState.CANCELLED, "the child run is included"
    assert client.get_run(other.id).state == RunState.RUNNING

    start_worker(ops_failing_flow)
    failed = client.submit(ops_failing_flow, 3)
    with pytest.raises(RunFailed):
        failed.result(timeout=30)
    dry = json.loads(cli("retry-many", "--all", "--dry-run", "--json").stdout)
    assert dry["matched"] == 1, dry  # the failed run, not the cancelled ones
    both = json.loads(
        cli("retry-many", "--state", "cancelled", "--state", "failed", "--dry-run", "--json").stdout
    )
    assert both["matched"] >= 2, both


# -- ui.md: the attempts of a node ----------------------------------------------------------


@step(name="ops_slow", timeout=1.0, max_attempts=2)
def ops_slow(x: int) -> int:
    GATE.wait(120)
    return x


def test_ops_a_lease_released_by_a_stopping_worker_is_in_the_attempt_history(
    client: Client, start_worker: StartWorker
) -> None:
    """ui.md (Attempts): each node lists the attempt history, "every execution that did not
    complete the step: retried, failed, timeout, reclaimed after its worker died, released
    by a stopping worker, replayed", then its latest attempt; /api/runs/<id>/attempts
    returns the same list."""
    from starlette.testclient import TestClient

    from cyclone_dsl.ui.app import create_app

    GATE.clear()
    worker = start_worker(ops_block, grace=0.2)
    handle = client.enqueue(ops_block, 3)
    wait_until(
        lambda: client.get_run(handle.id).steps[0].state == StepState.RUNNING,
        what="the handler to run",
    )
    worker.stop()
    step_row = client.get_run(handle.id).steps[0]
    assert step_row.state == StepState.AVAILABLE  # released at once
    with TestClient(create_app(client)) as web:
        listed = web.get(f"/api/runs/{handle.id}/attempts").json()["ops_block"]
    outcomes = [a["outcome"] for a in listed]
    assert "released" in outcomes, (
        f"the released execution is missing from the attempts: {listed}; "
        f"history rows: {step_row.attempts}"
    )


def test_ops_a_timed_out_execution_is_listed_as_a_timeout_attempt(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """ui.md (Attempts): a timed-out execution is in the attempt history (``timeout``)."""
    from starlette.testclient import TestClient

    from cyclone_dsl.ui.app import create_app

    start_worker(ops_slow)
    handle = client.enqueue(ops_slow, 4)
    wait_until(
        lambda: client.get_run(handle.id).steps[0].state == StepState.RUNNING,
        what="the handler to run",
    )
    clock(timedelta(minutes=5))
    wait_until(
        lambda: client.get_run(handle.id).steps[0].attempts, what="the timeout to be recorded"
    )
    with TestClient(create_app(client)) as web:
        listed = web.get(f"/api/runs/{handle.id}/attempts").json()["ops_slow"]
    first = listed[0]
    assert (first["number"], first["error_kind"]) == (1, "timeout"), listed


def test_ops_removing_a_schedule_keeps_the_runs_it_fired(
    cli: Cli, client: Client, clock: Clock
) -> None:
    """cli.md: ``cyclone schedules rm ID`` deletes the schedule; the runs it fired stay."""
    added = cli(
        "schedules",
        "add",
        "ops_add",
        "* * * * *",
        "--id",
        "ops_minutely",
        "-m",
        "tests.integration.test_ops_docs_audit",
        "--input",
        "1",
        "--json",
    )
    assert added.returncode == 0, added.stderr
    clock(timedelta(minutes=3))
    fired = cli("scan", "--once")
    assert fired.returncode == 0, fired.stderr
    runs = client.list_runs(workflow="ops_add")
    assert runs, "the scan fired the schedule"
    gone = cli("schedules", "rm", "ops_minutely")
    assert gone.returncode == 0, gone.stderr
    assert cli("schedules").stdout.strip() == "no schedules"
    assert [r.id for r in client.list_runs(workflow="ops_add")] == [r.id for r in runs]


def test_ops_stats_of_a_queue_whose_only_work_is_not_due_yet(
    cli: Cli, client: Client, cyclone_dsn: str
) -> None:
    """deploy.md: the oldest available age counts from the earliest ``scheduled_at`` of
    the available steps, due or not, as the schema reference's views do (negative when
    all of it is scheduled later); the gauge counts due work only (None, read as 0)."""
    later = datetime.now(UTC) + timedelta(hours=1)
    client.enqueue(ops_add, 1, queue="ops_later", scheduled_at=later)
    (gauge,) = [g for g in client.gauges() if g["gauge"] == "steps" and g["queue"] == "ops_later"]
    assert gauge["oldest_s"] is None  # the metric then reads 0
    data = json.loads(cli("stats", "--json").stdout)
    (queue,) = [q for q in data["queues"] if q["queue"] == "ops_later"]
    assert -3600 <= queue["oldest_available_s"] < -3500
    with psycopg.connect(cyclone_dsn) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM oldest_available_age) FROM cyclone_v_queues "
            "WHERE queue = 'ops_later'"
        ).fetchone()
    assert row is not None and -3600 <= float(row[0]) < -3500
