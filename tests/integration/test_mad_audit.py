"""Audit: several applications share one database (docs/howto/versioning.md, "Two
applications on one database"; docs/howto/deploy.md; docs/concepts/*.md).

Each application is a Registry of its own (its process's definitions), with its own client
and its own worker, as in test_versions.py. What one application's worker, scanner, client
or operator command does must never run, fail or lose the other application's work, and
what waits for the other application's worker must wait, untouched, until one starts.
Time is moved with the ``clock`` fixture, never waited out.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    InvalidTransition,
    Registry,
    RunFilter,
    RunNotFound,
    RunState,
    StepState,
    Worker,
    child,
    schedule,
    step,
    wait_signal,
    wait_timer,
)
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.testing import set_clock_shift
from tests.cli.runner import in_process
from tests.waiting import (
    LONG_POLL,
    PROMPT,
    expire_leases_until,
    scanner_passes,
    wait_idle,
    wait_until,
)

HOUR = timedelta(hours=1)
CALLS: Counter[str] = Counter()
_lock = threading.Lock()
GATES: dict[str, threading.Event] = {}
FAIL: dict[str, bool] = {}

StartWorker = Callable[..., Worker]
Clock = Callable[[timedelta], None]


def gate(name: str) -> threading.Event:
    with _lock:
        return GATES.setdefault(name, threading.Event())


def count(tag: str) -> int:
    with _lock:
        CALLS[tag] += 1
        return CALLS[tag]


@pytest.fixture(autouse=True)
def _fresh(start_worker: StartWorker) -> Iterator[None]:
    CALLS.clear()
    GATES.clear()
    FAIL.clear()
    yield
    set_clock_shift(timedelta(0))
    for event in list(GATES.values()):
        event.set()


# -- application A ------------------------------------------------------------------------------


@step(name="mad_a_double")
def mad_a_double(x: int) -> int:
    count("a_double")
    return x * 2


@step(name="mad_a_kid_step")
def mad_a_kid_step(x: int) -> str:
    count("a_kid")
    return f"A kid {x}"


# Named so that its fair key sorts after application B's ("step:mad_b_lim..."), see below.
@step(name="mad_x_lim", concurrency=Concurrency(key="tenant", limit=1))
def mad_a_lim(job: dict[str, Any]) -> str:
    count("a_lim")
    gate("a_lim").wait(15)
    return "A " + str(job["tenant"])


@step(name="mad_a_hold")
def mad_a_hold(x: int) -> int:
    count("a_hold")
    gate("a_hold").wait(15)
    return x


# -- application B ------------------------------------------------------------------------------


@step(name="mad_b_add")
def mad_b_add(x: int) -> int:
    count("b_add")
    return x + 100


@step(name="mad_b_kid_step")
def mad_b_kid_step(x: int) -> str:
    count("b_kid")
    return f"B kid {x}"


@step(name="mad_b_flaky", max_attempts=1)
def mad_b_flaky(x: int) -> int:
    count("b_flaky")
    if FAIL.get("b_flaky", False):
        raise RuntimeError("mad b flaky fails")
    return x + 1


@step(name="mad_b_job")
def mad_b_job(x: int) -> str:
    count("b_job")
    return f"B job {x}"


@step(name="mad_b_lim", concurrency=Concurrency(key="tenant", limit=1))
def mad_b_lim(job: dict[str, Any]) -> str:
    count("b_lim")
    return "B " + str(job["tenant"])


@step(name="mad_b_echo")
def mad_b_echo(x: object) -> object:
    count("b_echo")
    return x


@step(name="mad_b_slow")
def mad_b_slow(x: int) -> int:
    """Blocks on its first execution only (a worker that stalls); later ones return."""
    if count("b_slow") == 1:
        gate("b_slow").wait(15)
    return x + 7


@step(name="mad_b_keep", retention=timedelta(days=30))
def mad_b_keep(x: int) -> int:
    return x


# -- workflows (built directly: each application's process has only its own) -----------------


def _a_flow(x):  # type: ignore[no-untyped-def]
    return mad_a_double(x)


def _a_kid(x):  # type: ignore[no-untyped-def]
    return mad_a_kid_step(x)


def _b_kid(x):  # type: ignore[no-untyped-def]
    return mad_b_kid_step(x)


A_FLOW = WorkflowDef(_a_flow, "mad_a_flow")
A_KID = WorkflowDef(_a_kid, "mad_kid")  # both applications have a child workflow "mad_kid"
B_KID = WorkflowDef(_b_kid, "mad_kid")


def _a_uses_kid(x):  # type: ignore[no-untyped-def]
    return child(A_KID, x)


def _b_flow(x):  # type: ignore[no-untyped-def]
    return mad_b_add(mad_b_add(x, queue="mad_b_q"))


def _b_parent(x):  # type: ignore[no-untyped-def]
    return child(B_KID, x)


def _b_timer(x):  # type: ignore[no-untyped-def]
    return mad_b_add(x, after=wait_timer(HOUR))


def _b_sig_timeout(x):  # type: ignore[no-untyped-def]
    return mad_b_add(wait_signal("mad_go", timeout=HOUR))


def _b_timer_child(x):  # type: ignore[no-untyped-def]
    return child(B_KID, x, after=wait_timer(HOUR))


def _b_signal_child(x):  # type: ignore[no-untyped-def]
    return child(B_KID, wait_signal("mad_go"))


def _a_orders(x):  # type: ignore[no-untyped-def]
    return mad_a_double(x)


def _b_orders(x):  # type: ignore[no-untyped-def]
    return mad_b_add(mad_b_flaky(x))


def _b_slow_flow(x):  # type: ignore[no-untyped-def]
    return mad_b_slow(x)


def _b_keep_flow(x):  # type: ignore[no-untyped-def]
    return mad_b_keep(x)


def _b_plain_flow(x):  # type: ignore[no-untyped-def]
    return mad_b_add(x)


def _a_hold_flow(x):  # type: ignore[no-untyped-def]
    return mad_a_hold(x)


def _b_hold_flow(x):  # type: ignore[no-untyped-def]
    return mad_b_echo(x)


A_USES_KID = WorkflowDef(_a_uses_kid, "mad_a_uses_kid")
B_FLOW = WorkflowDef(_b_flow, "mad_b_flow")
B_PARENT = WorkflowDef(_b_parent, "mad_b_parent")
B_TIMER = WorkflowDef(_b_timer, "mad_b_timer")
B_SIG_TIMEOUT = WorkflowDef(_b_sig_timeout, "mad_b_sig_timeout")
B_TIMER_CHILD = WorkflowDef(_b_timer_child, "mad_b_timer_child")
B_SIGNAL_CHILD = WorkflowDef(_b_signal_child, "mad_b_signal_child")
A_ORDERS = WorkflowDef(_a_orders, "mad_orders")  # the same workflow name in both applications
B_ORDERS = WorkflowDef(_b_orders, "mad_orders")
B_SLOW = WorkflowDef(_b_slow_flow, "mad_b_slow_flow")
B_KEEP = WorkflowDef(_b_keep_flow, "mad_b_keep_flow")
B_PLAIN = WorkflowDef(_b_plain_flow, "mad_b_plain")
# A workflow limited per customer in each application, by the same field name.
A_CWF = WorkflowDef(_a_hold_flow, "mad_a_cwf", concurrency=Concurrency(key="customer", limit=1))
B_CWF = WorkflowDef(_b_hold_flow, "mad_b_cwf", concurrency=Concurrency(key="customer", limit=1))


def app(*objects: object) -> Registry:
    """One application's registry: these workflows (with their child workflows) and steps."""
    registry = Registry()
    for obj in objects:
        if isinstance(obj, WorkflowDef):
            registry.add_workflow_tree(obj)
        else:
            registry.register(obj)
    return registry


def app_a() -> Registry:
    return app(A_FLOW, A_USES_KID, A_ORDERS, A_CWF, mad_a_lim, mad_a_hold)


def app_b() -> Registry:
    return app(
        B_FLOW,
        B_PARENT,
        B_TIMER,
        B_SIG_TIMEOUT,
        B_TIMER_CHILD,
        B_SIGNAL_CHILD,
        B_ORDERS,
        B_SLOW,
        B_KEEP,
        B_PLAIN,
        B_CWF,
        mad_b_job,
        mad_b_lim,
    )


def untouched(c: Client, run_id: int) -> list[tuple[str, StepState, int, int]]:
    """(node, state, attempt, reclaims) of each non-terminal step of a run."""
    return [
        (s.node, s.state, s.attempt, s.reclaims)
        for s in c.get_run(run_id).steps
        if s.state not in (StepState.COMPLETED, StepState.CANCELLED)
    ]


def unserved_kinds(c: Client) -> set[tuple[str, str]]:
    return {(u["workflow"], u["kind"]) for u in c.stats()["unserved"]}


def test_the_two_applications_definitions_differ_where_the_tests_need_them_to() -> None:
    assert A_ORDERS.def_version != B_ORDERS.def_version
    assert A_KID.def_version != B_KID.def_version


# -- (1) one application's worker never takes the other's work ------------------------------


def test_a_worker_of_one_application_leaves_all_of_the_others_work_waiting(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    """A worker of A serving the same queues as B claims none of B's steps (kinds A does not
    know, a queue A serves too, a child run B started, standalone work), spends no attempt;
    B's worker then drains all of it."""
    with (
        Client(cyclone_dsn, registry=app_a()) as a_client,
        Client(cyclone_dsn, registry=app_b()) as b_client,
    ):
        b_flow = b_client.submit("mad_b_flow", 1)
        b_parent = b_client.submit("mad_b_parent", 2)
        b_job = b_client.enqueue("mad_b_job", 3)
        b_job_q = b_client.enqueue("mad_b_job", 4, queue="mad_b_q")
        a_worker = start_worker(registry=app_a(), queues=["default", "mad_b_q"])
        assert a_client.submit("mad_a_flow", 5).result(timeout=20) == 10
        assert a_client.submit("mad_a_uses_kid", 6).result(timeout=20) == "A kid 6"
        scanner_passes(a_worker)
        (kid,) = b_client.children_of(b_parent.id)
        assert b_client.get_run(kid["id"]).def_version == B_KID.def_version
        for run_id in (b_flow.id, kid["id"], b_job.id, b_job_q.id):
            for node, state, attempt, reclaims in untouched(b_client, run_id):
                assert (state, attempt, reclaims) in (
                    (StepState.AVAILABLE, 0, 0),
                    (StepState.PENDING, 0, 0),
                ), (run_id, node, state)
        assert CALLS["b_add"] == CALLS["b_kid"] == CALLS["b_job"] == 0
        unserved = unserved_kinds(a_client)
        assert ("mad_kid", "mad_b_kid_step") in unserved
        assert ("mad_b_flow", "mad_b_add") in unserved
        assert ("mad_b_job", "mad_b_job") in unserved
        start_worker(registry=app_b(), queues=["default", "mad_b_q"])
        assert b_flow.result(timeout=20) == 201
        assert b_parent.result(timeout=20) == "B kid 2"
        assert b_job.result(timeout=20) == "B job 3"
        assert b_job_q.result(timeout=20) == "B job 4"
        assert CALLS["a_kid"] == 1  # A's own child only: B's "mad_kid" ran B's handler
        assert unserved_kinds(a_client) == set()


# -- (2) one workflow name, two definitions -----------------------------------------------------


def test_one_workflow_name_in_two_applications_submit_retry_replay_and_fork_keep_each_apart(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    with (
        Client(cyclone_dsn, registry=app_a()) as a_client,
        Client(cyclone_dsn, registry=app_b()) as b_client,
    ):
        start_worker(registry=app_a())
        start_worker(registry=app_b())
        a_run = a_client.submit("mad_orders", 5)
        FAIL["b_flaky"] = True
        b_run = b_client.submit("mad_orders", 5)
        assert a_run.result(timeout=20) == 10
        wait_until(lambda: b_run.get().state is RunState.FAILED, what="B's run to fail")
        assert a_client.get_run(a_run.id).def_version == A_ORDERS.def_version
        assert b_client.get_run(b_run.id).def_version == B_ORDERS.def_version
        FAIL["b_flaky"] = False
        # A's client retries B's run: the retry needs no definition, and B's handlers run.
        a_client.retry(b_run.id, "mad_b_flaky")
        assert b_run.result(timeout=20) == 106
        # A's client replays B's node: B's handlers run again, not A's.
        before = (CALLS["a_double"], CALLS["b_flaky"], CALLS["b_add"])
        a_client.retry(b_run.id, "mad_b_flaky", force=True)
        assert b_run.result(timeout=20) == 106
        assert (CALLS["a_double"], CALLS["b_flaky"], CALLS["b_add"]) == (
            before[0],
            before[1] + 1,
            before[2] + 1,
        )
        # A's client cannot fork B's run with A's definition by accident.
        runs_before = len(a_client.list_runs(workflow="mad_orders"))
        with pytest.raises(InvalidTransition, match="current_definition"):
            a_client.fork(b_run.id, "mad_b_flaky")
        assert len(a_client.list_runs(workflow="mad_orders")) == runs_before
        fork = b_client.fork(b_run.id, "mad_b_add")
        assert fork.result(timeout=20) == 106
        assert b_client.get_run(fork.id).def_version == B_ORDERS.def_version
        # A's run replayed by B's client runs A's handler.
        a_calls = CALLS["a_double"]
        b_client.retry(a_run.id, "mad_a_double", force=True)
        assert a_run.result(timeout=20) == 10
        assert CALLS["a_double"] == a_calls + 1


# -- (4) one application's scanner and the other's timers, waits, deadlines, leases ----------


def test_a_scanner_of_one_application_applies_the_others_timers_waits_and_deadlines(
    cyclone_dsn: str, start_worker: StartWorker, clock: Clock
) -> None:
    """What needs no handler (a timer, a signal timeout, a deadline) A's scanner applies to
    B's runs as docs say; what needs B's code (the next step, a child run of B's "mad_kid",
    which A defines otherwise) waits for B's worker."""
    with (
        Client(cyclone_dsn, registry=app_a()) as a_client,
        Client(cyclone_dsn, registry=app_b()) as b_client,
    ):
        timer = b_client.submit("mad_b_timer", 1)
        sig_timeout = b_client.submit("mad_b_sig_timeout", 2)
        past_deadline = b_client.submit("mad_b_flow", 3, deadline=HOUR)
        timer_child = b_client.submit("mad_b_timer_child", 4)
        signal_child = b_client.submit("mad_b_signal_child", 5)
        a_worker = start_worker(registry=app_a())
        # A's client (which has its own "mad_kid") signals B's run whose next node is a child.
        a_client.signal(signal_child.id, "mad_go", 50)
        clock(2 * HOUR)
        wait_until(
            lambda: timer.get().step("mad_b_add").state is StepState.AVAILABLE,
            what="A's scanner to fire B's timer",
        )
        wait_until(
            lambda: timer_child.get().step("mad_kid").state is StepState.WAITING_CHILD,
            what="B's timer before a child to fire",
        )
        wait_until(lambda: sig_timeout.get().state is RunState.FAILED, what="the signal timeout")
        wait_until(lambda: past_deadline.get().state is RunState.FAILED, what="the deadline")
        scanner_passes(a_worker)
        assert sig_timeout.get().step("mad_go").error_kind == "signal_timeout"
        assert any(s.error_kind == "deadline" for s in past_deadline.get().steps)
        # Nobody started B's child runs with A's "mad_kid", and no B step was claimed.
        assert b_client.children_of(timer_child.id) == []
        assert b_client.children_of(signal_child.id) == []
        assert timer.get().step("mad_b_add").attempt == 0
        assert CALLS["a_kid"] == CALLS["b_add"] == CALLS["b_kid"] == 0
        start_worker(registry=app_b())
        assert timer.result(timeout=20) == 101
        assert timer_child.result(timeout=20) == "B kid 4"
        assert signal_child.result(timeout=20) == "B kid 50"
        for parent in (timer_child, signal_child):
            (kid,) = b_client.children_of(parent.id)
            assert b_client.get_run(kid["id"]).def_version == B_KID.def_version
        assert CALLS["a_kid"] == 0


def test_a_scanner_of_one_application_reclaims_the_others_expired_lease_without_failing_it(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    """B's worker stalls in a handler (no scanner of its own); A's scanner reclaims the
    expired lease: the step goes back to B (not failed, no attempt spent), A never runs it."""
    with Client(cyclone_dsn, registry=app_b()) as b_client:
        start_worker(registry=app_a())
        start_worker(registry=app_b(), scanners=False)
        run = b_client.submit("mad_b_slow_flow", 1)
        wait_until(lambda: CALLS["b_slow"] >= 1, what="B's handler to start")
        expire_leases_until(
            lambda: run.get().step("mad_b_slow").reclaims >= 1,
            what="A's scanner to reclaim B's lease",
        )
        set_clock_shift(timedelta(0))
        assert run.result(timeout=20) == 8
        st = run.get().step("mad_b_slow")
        assert (st.state, st.attempt, st.error_kind) == (StepState.COMPLETED, 0, None)
        assert [a.outcome for a in st.attempts] == ["reclaimed"]


# -- (3) operator calls scoped per workflow or queue ------------------------------------------


def test_bulk_operations_scoped_by_workflow_or_queue_never_touch_the_other_application(
    cyclone_dsn: str,
) -> None:
    with (
        Client(cyclone_dsn, registry=app_a()) as a_client,
        Client(cyclone_dsn, registry=app_b()) as b_client,
    ):
        a_runs = [a_client.submit("mad_a_flow", i).id for i in range(2)]
        b_runs = [b_client.submit("mad_b_flow", i).id for i in range(2)]

        def states(ids: list[int]) -> list[RunState]:
            return [a_client.get_run(i).state for i in ids]

        # B's first step is in queue mad_b_q; A's steps and B's second are in default.
        assert a_client.cancel_many(RunFilter(queues="mad_b_q"), dry_run=True).matched == 2
        for run_id in a_runs + b_runs:
            a_client.pause(run_id)
        assert a_client.resume_many(RunFilter(workflows="mad_a_flow")).acted == 2
        assert states(a_runs) == [RunState.RUNNING] * 2
        assert states(b_runs) == [RunState.PAUSED] * 2
        assert a_client.resume_many(RunFilter(queues="mad_b_q")).acted == 2
        assert states(b_runs) == [RunState.RUNNING] * 2
        assert a_client.cancel_many(RunFilter(workflows="mad_b_flow")).acted == 2
        assert states(a_runs) == [RunState.RUNNING] * 2
        assert states(b_runs) == [RunState.CANCELLED] * 2
        retried = a_client.retry_many(RunFilter(queues="mad_b_q", states=["cancelled"]))
        assert (retried.matched, retried.acted) == (2, 2)
        assert states(b_runs) == [RunState.RUNNING] * 2
        cancelled = a_client.cancel_many(RunFilter(queues="default", workflows="mad_a_flow"))
        assert (cancelled.matched, cancelled.acted) == (2, 2)
        assert states(a_runs) == [RunState.CANCELLED] * 2
        assert states(b_runs) == [RunState.RUNNING] * 2
        for run_id in b_runs:
            assert untouched(b_client, run_id) == [
                ("mad_b_add", StepState.AVAILABLE, 0, 0),
                ("mad_b_add_2", StepState.PENDING, 0, 0),
            ]


def test_cli_commands_scoped_by_workflow_act_on_one_application_and_report_both(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    cli = in_process(cyclone_dsn)
    with (
        Client(cyclone_dsn, registry=app_a()) as a_client,
        Client(cyclone_dsn, registry=app_b()) as b_client,
    ):
        a_done = a_client.submit("mad_a_flow", 1)
        a_open = a_client.submit("mad_a_cwf", {"customer": "c1"})
        b_runs = [b_client.submit("mad_b_flow", i).id for i in range(2)]
        start_worker(registry=app_a())
        assert a_done.result(timeout=20) == 2
        wait_until(lambda: CALLS["a_hold"] >= 1, what="A's held step to run")
        listed = cli("runs", "--workflow", "mad_b_flow", "--json")
        assert listed.returncode == 0, listed.stderr
        assert sorted(r["id"] for r in json.loads(listed.stdout)) == sorted(b_runs)
        stats = cli("stats", "--json")
        assert stats.returncode == 0, stats.stderr
        unserved = json.loads(stats.stdout)["unserved"]
        assert {(u["workflow"], u["kind"]) for u in unserved} == {("mad_b_flow", "mad_b_add")}
        workers = cli("workers", "--json")
        assert workers.returncode == 0, workers.stderr
        (listed_worker,) = json.loads(workers.stdout)
        assert "mad_b_flow" not in json.dumps(listed_worker)
        cancelled = cli("cancel-many", "--workflow", "mad_b_flow", "--yes", "--json")
        assert cancelled.returncode == 0, cancelled.stderr
        assert [a_client.get_run(i).state for i in b_runs] == [RunState.CANCELLED] * 2
        assert a_open.get().state is RunState.RUNNING
        assert a_client.get_run(a_done.id).state is RunState.COMPLETED
        gate("a_hold").set()
        assert a_open.result(timeout=20) == {"customer": "c1"}


def test_cyclone_scan_without_modules_fires_timers_and_leaves_the_next_step_and_children(
    cyclone_dsn: str, clock: Clock, start_worker: StartWorker
) -> None:
    """`cyclone scan` without -m (it has no application's code) applies B's timer; B's child
    run waits for B's worker, which starts it with B's definition."""
    cli = in_process(cyclone_dsn)
    with Client(cyclone_dsn, registry=app_b()) as b_client:
        timer = b_client.submit("mad_b_timer", 1)
        timer_child = b_client.submit("mad_b_timer_child", 2)
        clock(2 * HOUR)
        scanned = cli("scan", "--once", "--retention", "none")
        assert scanned.returncode == 0, scanned.stderr
        assert timer.get().step("mad_b_add").state is StepState.AVAILABLE
        assert timer_child.get().step("mad_kid").state is StepState.WAITING_CHILD
        assert b_client.children_of(timer_child.id) == []
        start_worker(registry=app_b())
        assert timer.result(timeout=20) == 101
        assert timer_child.result(timeout=20) == "B kid 2"


# -- retention: one application's scanner and the other's kept runs --------------------------


def test_a_short_retention_in_one_application_keeps_the_others_runs_with_a_step_retention(
    cyclone_dsn: str, clock: Clock, start_worker: StartWorker
) -> None:
    """deploy.md: a step's own retention= wins over the retention of the worker that scans.
    A's scanner (retention 1 s) deletes A's ended run and B's run without a step retention
    (documented: the shortest retention among scanners wins), never B's 30-day run."""
    with (
        Client(cyclone_dsn, registry=app_a()) as a_client,
        Client(cyclone_dsn, registry=app_b()) as b_client,
    ):
        start_worker(registry=app_b(), scanners=False)
        kept = b_client.submit("mad_b_keep_flow", 1)
        plain = b_client.submit("mad_b_plain", 2)
        assert kept.result(timeout=20) == 1
        assert plain.result(timeout=20) == 102
        a_worker = start_worker(registry=app_a(), retention=timedelta(seconds=1))
        a_run = a_client.submit("mad_a_flow", 3)
        assert a_run.result(timeout=20) == 6
        clock(2 * HOUR)

        def gone(run_id: int) -> bool:
            try:
                a_client.get_run(run_id)
            except RunNotFound:
                return True
            return False

        wait_until(lambda: gone(a_run.id) and gone(plain.id), what="the retention pass")
        scanner_passes(a_worker)
        assert kept.get().state is RunState.COMPLETED


# -- (5) schedules of two applications --------------------------------------------------------


def _a_report(x):  # type: ignore[no-untyped-def]
    return mad_a_double(x)


def _b_report(x):  # type: ignore[no-untyped-def]
    return mad_b_add(x)


# Both applications have a workflow "mad_report", each with a schedule of its own id.
A_REPORT = schedule("0 3 * * *", id="mad_a_nightly", location="UTC", input=1)(
    WorkflowDef(_a_report, "mad_report")
)
B_REPORT = schedule("0 3 * * *", id="mad_b_nightly", location="UTC", input=2)(
    WorkflowDef(_b_report, "mad_report")
)


def test_a_workers_start_leaves_the_other_applications_schedule_and_never_fires_it(
    cyclone_dsn: str, clock: Clock, start_worker: StartWorker
) -> None:
    with Client(cyclone_dsn, registry=app(B_REPORT)) as b_client:
        assert b_client.register_schedules() == ["mad_b_nightly"]
        b_client.enable_schedule("mad_b_nightly", False)
        b_client.enable_schedule("mad_b_nightly", True)
        (before,) = b_client.list_schedules()
        a_worker = start_worker(registry=app(A_REPORT))
        by_id = {s.id: s for s in b_client.list_schedules()}
        assert sorted(by_id) == ["mad_a_nightly", "mad_b_nightly"]
        after = by_id["mad_b_nightly"]
        assert (after.kind, after.def_version, after.enabled, after.input, after.next_run_at) == (
            before.kind,
            B_REPORT.def_version,
            True,
            2,
            before.next_run_at,
        )
        clock(timedelta(days=1, hours=1))
        wait_until(
            lambda: {s.id: s for s in b_client.list_schedules()}["mad_a_nightly"].last_run_id,
            what="A's schedule to fire",
        )
        scanner_passes(a_worker)
        b_sched = {s.id: s for s in b_client.list_schedules()}["mad_b_nightly"]
        assert b_sched.last_run_id is None
        assert b_sched.enabled
        runs = b_client.list_runs(workflow="mad_report")
        assert [r.def_version for r in runs] == [A_REPORT.def_version]
        start_worker(registry=app(B_REPORT))
        wait_until(
            lambda: {s.id: s for s in b_client.list_schedules()}["mad_b_nightly"].last_run_id,
            what="B's worker to fire B's schedule",
        )
        b_run = {s.id: s for s in b_client.list_schedules()}["mad_b_nightly"].last_run_id
        assert b_run is not None
        assert b_client.result(b_run, timeout=20) == 102
        assert b_client.get_run(b_run).def_version == B_REPORT.def_version


A_SAME_ID = schedule("0 4 * * *", id="mad_nightly", location="UTC", input=3)(
    WorkflowDef(_a_report, "mad_a_report")
)
B_SAME_ID = schedule("0 4 * * *", id="mad_nightly", location="UTC", input=4)(
    WorkflowDef(_b_report, "mad_b_report")
)


def test_one_schedule_id_in_two_applications_is_taken_over_by_the_last_start(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    """The audit's record of what happens (schedules.md: registration upserts by id; a
    deploy may move a schedule to another target): B's schedule "mad_nightly" is replaced,
    without a word, by A's of the same id when A's worker starts; B's worker takes it back
    at its next start. Neither application is told."""
    with Client(cyclone_dsn, registry=app(B_SAME_ID)) as b_client:
        b_client.register_schedules()
        (before,) = b_client.list_schedules()
        assert (before.kind, before.input) == ("mad_b_report", 4)
        start_worker(registry=app(A_SAME_ID))
        (after,) = b_client.list_schedules()
        assert (after.kind, after.input, after.enabled) == ("mad_a_report", 3, True)
        start_worker(registry=app(B_SAME_ID))
        (again,) = b_client.list_schedules()
        assert (again.kind, again.input) == ("mad_b_report", 4)


# -- (6) flow control with the same key names -------------------------------------------------


def test_limits_with_the_same_key_field_in_two_applications_are_counted_apart(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    """flow-control.md: a step's Concurrency caps the steps of that kind and key, a
    workflow's the runs of that workflow and key: A holding tenant t1 (a step slot) and
    customer c1 (a run slot) holds back nothing of B's with the same key values."""
    with (
        Client(cyclone_dsn, registry=app_a()) as a_client,
        Client(cyclone_dsn, registry=app_b()) as b_client,
    ):
        start_worker(registry=app_a())
        start_worker(registry=app_b())
        a_step = a_client.enqueue("mad_x_lim", {"tenant": "t1"})
        a_run = a_client.submit("mad_a_cwf", {"customer": "c1"})
        wait_until(lambda: CALLS["a_lim"] >= 1 and CALLS["a_hold"] >= 1, what="A's holders")
        b_steps = [b_client.enqueue("mad_b_lim", {"tenant": "t1"}) for _ in range(2)]
        b_runs = [b_client.submit("mad_b_cwf", {"customer": "c1"}) for _ in range(2)]
        assert [h.result(timeout=PROMPT) for h in b_steps] == ["B t1", "B t1"]
        assert [h.result(timeout=PROMPT) for h in b_runs] == [{"customer": "c1"}] * 2
        assert a_client.why_waiting(a_step.id) == {}
        gate("a_lim").set()
        gate("a_hold").set()
        assert a_step.result(timeout=20) == "A t1"
        assert a_run.result(timeout=20) == {"customer": "c1"}


def test_the_others_limited_backlog_without_a_worker_does_not_hold_back_limited_work(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    """B's workers are down with limited work queued under 300 keys in a shared queue (an
    outage, a deploy). A runs a fleet as deploy.md advises: one worker with the scanner,
    the claimer with --no-scanners, polling once a minute (scale.md: with LISTEN, a long
    poll_interval delays nothing). A's limited step, whose key sorts after B's, must start
    when it is enqueued (guarantees.md, "Work starts when it can, not at a poll"):
    flow-control.md admits a poll per ~60 keys only for keys *at their limit*; B's keys are
    free, just not A's to claim."""
    with (
        Client(cyclone_dsn, registry=app_a()) as a_client,
        Client(cyclone_dsn, registry=app_b()) as b_client,
    ):
        start_worker(registry=app_a(), queues=["mad_other_q"])  # A's scanner
        claimer = start_worker(
            registry=app_a(), queues=["mad_lim_q"], poll_interval=LONG_POLL, scanners=False
        )
        wait_idle(cyclone_dsn, claimer, listeners=2)
        b_client.enqueue_many(
            "mad_b_lim", [{"tenant": f"b{i:03}"} for i in range(300)], queue="mad_lim_q"
        )
        wait_idle(cyclone_dsn, claimer, listeners=2)  # A's claims walked part of B's keys
        gate("a_lim").set()
        handle = a_client.enqueue("mad_x_lim", {"tenant": "zz"}, queue="mad_lim_q")
        assert handle.result(timeout=PROMPT) == "A zz"
