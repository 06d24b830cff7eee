"""Operations in bulk (``cancel_many``, ``retry_many``, ``resume_many``) through the public API.

Each filter criterion is checked to narrow the selection (runs outside it stay as they
were), every dry-run count is compared with what the operation then acts on, a second
call acts on nothing, and bad filters raise InvalidArgument before anything is written.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from cyclone_dsl import (
    AsyncClient,
    BulkResult,
    Client,
    InvalidArgument,
    Permanent,
    RunFilter,
    RunState,
    StepContext,
    Worker,
    child,
    step,
    wait_signal,
    workflow,
)
from tests.waiting import wait_until

#: Tags whose handler call fails; cleared before each test.
FAILING: set[str] = set()
calls: dict[str, int] = {}
calls_lock = threading.Lock()


def _count(tag: str) -> None:
    with calls_lock:
        calls[tag] = calls.get(tag, 0) + 1


@step(name="bk_task", max_attempts=1)
def task(tag: str) -> str:
    _count(tag)
    if tag in FAILING:
        raise Permanent(f"{tag} is set to fail")
    return tag


@step(name="bk_crash", max_attempts=1)
def crash(tag: str) -> str:
    _count(tag)
    if tag in FAILING:
        raise RuntimeError(f"{tag} crashed")
    return tag


@step(name="bk_other_queue", max_attempts=1, queue="bk_other")
def other_queue(tag: str) -> str:
    _count(tag)
    if tag in FAILING:
        raise Permanent(f"{tag} is set to fail")
    return tag


@step(name="bk_after")
def after(value: object) -> str:
    return f"after {value}"


@workflow(name="bk_one")
def one(tag):  # type: ignore[no-untyped-def]
    return task(tag)


@workflow(name="bk_two")
def two(tag):  # type: ignore[no-untyped-def]
    return task(tag)


@workflow(name="bk_crashing")
def crashing(tag):  # type: ignore[no-untyped-def]
    return crash(tag)


@workflow(name="bk_queued")
def queued(tag):  # type: ignore[no-untyped-def]
    return other_queue(tag)


@workflow(name="bk_wait_a")
def wait_a(tag):  # type: ignore[no-untyped-def]
    return after(wait_signal("go"))


@workflow(name="bk_wait_b")
def wait_b(tag):  # type: ignore[no-untyped-def]
    return after(wait_signal("go"))


@workflow(name="bk_parent")
def parent(tag):  # type: ignore[no-untyped-def]
    return after(child(one, tag))


@step(name="bk_flaky", max_attempts=2)
def flaky(tag: str, *, ctx: StepContext) -> str:
    if ctx.attempt == 1:
        raise RuntimeError(f"{tag}: the first attempt fails")
    return tag


@workflow(name="bk_flaky_then_waits")
def flaky_then_waits(tag):  # type: ignore[no-untyped-def]
    return after(wait_signal("go", after=flaky(tag)))


HANDLERS = [task, crash, other_queue, after]


@pytest.fixture(autouse=True)
def _reset() -> None:
    FAILING.clear()
    calls.clear()


def states(client: Client, run_ids: list[int]) -> list[RunState]:
    return [client.get_run(r).state for r in run_ids]


def ended(client: Client, run_ids: list[int], timeout: float = 30) -> None:
    wait_until(
        lambda: all(s.is_terminal for s in states(client, run_ids)),
        timeout=timeout,
        what=f"runs {run_ids} to end",
    )


def failed_runs(client: Client, wf: object, tags: list[str]) -> list[int]:
    """Runs of ``wf``, one per tag, each failed by its step (a worker must be running)."""
    FAILING.update(tags)
    ids = [client.submit(wf, tag).id for tag in tags]
    ended(client, ids)
    assert set(states(client, ids)) == {RunState.FAILED}
    return ids


def check_dry_run_then_act(
    operation: Callable[..., BulkResult], where: RunFilter, expected: list[int]
) -> BulkResult:
    """The dry run counts ``expected``; acting acts on exactly as many; again acts on none."""
    counted = operation(where, dry_run=True)
    assert (counted.matched, counted.acted, counted.dry_run) == (len(expected), 0, True)
    done = operation(where)
    assert (done.matched, done.acted, done.skipped) == (len(expected), len(expected), 0)
    assert done.done and not done.dry_run
    again = operation(where)
    assert (again.matched, again.acted) == (0, 0)
    return done


# -- cancel -------------------------------------------------------------------------------


def test_cancel_many_by_workflow_reaches_running_and_paused_runs_only(client: Client) -> None:
    a = [client.submit(wait_a, i).id for i in range(4)]
    b = [client.submit(wait_b, i).id for i in range(3)]
    client.pause(a[0])
    client.cancel(a[1])
    check_dry_run_then_act(client.cancel_many, RunFilter(workflows="bk_wait_a"), [a[0], *a[2:]])
    assert states(client, a) == [RunState.CANCELLED] * 4
    assert states(client, b) == [RunState.RUNNING] * 3
    assert {s.state for s in client.get_run(a[2]).steps} == {"cancelled"}


def test_cancel_many_by_state(client: Client) -> None:
    runs = [client.submit(wait_a, i).id for i in range(4)]
    client.pause(runs[1])
    client.pause(runs[3])
    check_dry_run_then_act(client.cancel_many, RunFilter(states="paused"), [runs[1], runs[3]])
    assert states(client, runs) == [
        RunState.RUNNING,
        RunState.CANCELLED,
        RunState.RUNNING,
        RunState.CANCELLED,
    ]


def test_cancel_many_by_creation_time(client: Client) -> None:
    runs = [client.submit(wait_a, i).id for i in range(5)]
    created = [client.get_run(r).created_at for r in runs]
    assert created == sorted(created)
    # Runs submitted in one transaction share a created_at: the cut falls between two.
    cut = next(i for i in range(1, 5) if created[i] > created[i - 1])
    check_dry_run_then_act(
        client.cancel_many, RunFilter(workflows="bk_wait_a", since=created[cut]), runs[cut:]
    )
    assert states(client, runs[:cut]) == [RunState.RUNNING] * cut


def test_cancel_many_by_creation_time_until(client: Client) -> None:
    first = client.submit(wait_a, 0).id
    later = wait_until(
        lambda: (
            (r := client.submit(wait_a, 1).id)
            and client.get_run(r).created_at > client.get_run(first).created_at
            and r
        ),
        what="a run created after the first",
    )
    until = client.get_run(later).created_at
    check_dry_run_then_act(client.cancel_many, RunFilter(until=until), [first])
    assert client.get_run(later).state == RunState.RUNNING


def test_cancel_many_reaches_child_runs_and_counts_each_selected_run_once(
    client: Client,
) -> None:
    parents = [client.submit(parent, f"c{i}").id for i in range(2)]
    kids = wait_until(
        lambda: [c["id"] for p in parents for c in client.children_of(p)],
        what="the child runs to start",
    )
    # Only the parents are selected: their child runs end with them.
    done = check_dry_run_then_act(client.cancel_many, RunFilter(workflows="bk_parent"), parents)
    assert done.acted == 2
    assert states(client, kids) == [RunState.CANCELLED] * 2


def test_a_child_run_ended_with_its_parent_in_the_same_batch_is_skipped(client: Client) -> None:
    p = client.submit(parent, "x").id
    kid = wait_until(lambda: client.children_of(p), what="the child run")[0]["id"]
    result = client.cancel_many(RunFilter(states="running"))
    assert (result.matched, result.acted, result.skipped) == (2, 1, 1)
    assert result.skipped_runs[0][0] == kid
    assert "already" in result.skipped_runs[0][1]
    assert states(client, [p, kid]) == [RunState.CANCELLED, RunState.CANCELLED]


# -- resume -------------------------------------------------------------------------------


def test_resume_many_resumes_paused_runs_only(client: Client) -> None:
    a = [client.submit(wait_a, i).id for i in range(3)]
    b = [client.submit(wait_b, i).id for i in range(2)]
    for run_id in [a[0], a[2], b[0]]:
        client.pause(run_id)
    check_dry_run_then_act(client.resume_many, RunFilter(workflows=["bk_wait_a"]), [a[0], a[2]])
    assert states(client, a) == [RunState.RUNNING] * 3
    assert states(client, b) == [RunState.PAUSED, RunState.RUNNING]


# -- retry --------------------------------------------------------------------------------


def test_retry_many_reruns_the_failed_runs_of_a_workflow(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    ones = failed_runs(client, one, ["o1", "o2", "o3"])
    twos = failed_runs(client, two, ["t1"])
    FAILING.clear()
    check_dry_run_then_act(client.retry_many, RunFilter(workflows="bk_one"), ones)
    ended(client, ones)
    assert states(client, ones) == [RunState.COMPLETED] * 3
    assert [client.result(r) for r in ones] == ["o1", "o2", "o3"]
    assert states(client, twos) == [RunState.FAILED]
    # max_attempts=1: the second call ran on a fresh attempt budget.
    assert calls == {"o1": 2, "o2": 2, "o3": 2, "t1": 1}


def test_retry_many_by_error_kind(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(*HANDLERS)
    permanent = failed_runs(client, one, ["p1", "p2"])
    crashed = failed_runs(client, crashing, ["c1"])
    FAILING.clear()
    check_dry_run_then_act(client.retry_many, RunFilter(error_kinds="error"), crashed)
    ended(client, crashed)
    assert states(client, crashed) == [RunState.COMPLETED]
    assert states(client, permanent) == [RunState.FAILED] * 2
    check_dry_run_then_act(client.retry_many, RunFilter(error_kinds=["permanent"]), permanent)


def test_bulk_error_kinds_match_the_runs_list_shows(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A run whose step failed an attempt, then completed, carries the kind in its attempt
    history only: ``list_runs(error_kind=...)`` (and the dashboard) list it, and a bulk
    operation with the same filter (the dashboard's bulk form) acts on what was listed."""
    start_worker(flaky, after)
    flaked = client.submit(flaky_then_waits, "f1")
    waiting = client.submit(wait_a, "w1")
    wait_until(
        lambda: (
            [s.state for s in client.get_run(flaked.id).steps if s.node == "bk_flaky"]
            == ["completed"]
        ),
        what="the flaky step completed on its second attempt",
    )
    assert [r.id for r in client.list_runs(error_kind="error")] == [flaked.id]
    check_dry_run_then_act(client.cancel_many, RunFilter(error_kinds="error"), [flaked.id])
    assert states(client, [flaked.id, waiting.id]) == [RunState.CANCELLED, RunState.RUNNING]


def test_retry_many_by_queue(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(*HANDLERS, queues=["default", "bk_other"])
    default = failed_runs(client, one, ["d1"])
    other = failed_runs(client, queued, ["q1", "q2"])
    FAILING.clear()
    check_dry_run_then_act(client.retry_many, RunFilter(queues="bk_other"), other)
    ended(client, other)
    assert states(client, other) == [RunState.COMPLETED] * 2
    assert states(client, default) == [RunState.FAILED]


def test_retry_many_by_end_time(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(*HANDLERS)
    early = failed_runs(client, one, ["e1"])
    ended_at = client.get_run(early[0]).finished_at
    assert ended_at is not None
    late = wait_until(
        lambda: (
            (r := failed_runs(client, one, [f"l{len(calls)}"]))
            and (f := client.get_run(r[0]).finished_at) is not None
            and f > ended_at
            and r
        ),
        what="a run that failed later",
    )
    FAILING.clear()
    late_at = client.get_run(late[0]).finished_at
    assert client.retry_many(RunFilter(ended_until=late_at), dry_run=True).matched == 1
    check_dry_run_then_act(client.retry_many, RunFilter(ended_since=late_at), late)
    ended(client, late)
    assert states(client, early + late) == [RunState.FAILED, RunState.COMPLETED]
    check_dry_run_then_act(client.retry_many, RunFilter(ended_until=late_at), early)
    ended(client, early)
    assert states(client, early) == [RunState.COMPLETED]


def test_retry_many_leaves_cancelled_runs_unless_asked(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    failed = failed_runs(client, one, ["f1"])
    cancelled = [client.submit(wait_a, 0).id]
    client.cancel(cancelled[0])
    FAILING.clear()
    check_dry_run_then_act(client.retry_many, RunFilter(match_all=True), failed)
    check_dry_run_then_act(client.retry_many, RunFilter(states="cancelled"), cancelled)
    assert states(client, cancelled) == [RunState.RUNNING]  # waiting for its signal again


def test_retry_many_skips_a_child_run_and_retries_it_through_its_parent(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS, one)
    FAILING.add("k")
    p = client.submit(parent, "k").id
    ended(client, [p])
    kid = client.children_of(p)[0]["id"]
    assert states(client, [p, kid]) == [RunState.FAILED, RunState.FAILED]
    FAILING.clear()
    result = client.retry_many(RunFilter(workflows="bk_one"))
    assert (result.matched, result.acted, result.skipped) == (1, 0, 1)
    assert result.skipped_runs[0][0] == kid
    assert "retry run" in result.skipped_runs[0][1]
    assert states(client, [p, kid]) == [RunState.FAILED, RunState.FAILED]
    done = client.retry_many(RunFilter(workflows="bk_parent"))
    assert (done.acted, done.skipped) == (1, 0)
    ended(client, [p])
    assert states(client, [p, kid]) == [RunState.COMPLETED, RunState.COMPLETED]


# -- batches and progress -----------------------------------------------------------------


def test_batches_report_progress_and_act_on_every_run(client: Client) -> None:
    runs = [h.id for h in client.submit_many(wait_a, list(range(7)))]
    seen: list[BulkResult] = []
    result = client.cancel_many(
        RunFilter(workflows="bk_wait_a"), batch_size=3, progress=seen.append
    )
    assert [(p.matched, p.acted, p.done) for p in seen] == [
        (3, 3, False),
        (6, 6, False),
        (7, 7, True),
    ]
    assert result == seen[-1]
    assert states(client, runs) == [RunState.CANCELLED] * 7


def test_runs_submitted_after_the_call_started_are_left_alone(client: Client) -> None:
    before = [h.id for h in client.submit_many(wait_a, list(range(4)))]
    late: list[int] = []

    def submit_one_more(progress: BulkResult) -> None:
        if not late:
            late.append(client.submit(wait_a, 99).id)

    result = client.cancel_many(
        RunFilter(workflows="bk_wait_a"), batch_size=2, progress=submit_one_more
    )
    assert result.acted == 4
    assert states(client, before) == [RunState.CANCELLED] * 4
    assert states(client, late) == [RunState.RUNNING]


def test_async_client_bulk_calls_progress_on_the_loop(cyclone_dsn: str) -> None:
    async def main() -> tuple[BulkResult, BulkResult, list[bool]]:
        async with AsyncClient(cyclone_dsn) as aclient:
            for i in range(5):
                await aclient.submit(wait_b, i)
            loop = asyncio.get_running_loop()
            on_loop: list[bool] = []

            def progress(result: BulkResult) -> None:
                on_loop.append(asyncio.get_running_loop() is loop)

            where = RunFilter(workflows="bk_wait_b")
            counted = await aclient.cancel_many(where, dry_run=True)
            done = await aclient.cancel_many(where, batch_size=2, progress=progress)
            return counted, done, on_loop

    counted, done, on_loop = asyncio.run(main())
    assert (counted.matched, done.acted) == (5, 5)
    assert on_loop == [True, True, True]


# -- bad filters --------------------------------------------------------------------------

NOW = datetime.now(UTC)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: RunFilter(), "empty RunFilter"),
        (lambda: RunFilter(states="finished"), "'finished' is not a run state"),
        (lambda: RunFilter(error_kinds="oops"), "'oops' is not an error kind"),
        (lambda: RunFilter(since=datetime(2026, 1, 1)), "timezone-aware"),
        (lambda: RunFilter(ended_until=NOW.replace(tzinfo=None)), "timezone-aware"),
        (lambda: RunFilter(since=NOW, until=NOW - timedelta(1)), "must be before"),
        (lambda: RunFilter(workflows=""), "non-empty string"),
        (lambda: RunFilter(workflows=[3]), "non-empty string"),  # type: ignore[list-item]
        (lambda: RunFilter(workflows="x", match_all=True), "no other criterion"),
    ],
)
def test_a_bad_filter_is_refused_when_built(make: Callable[[], RunFilter], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        make()


def test_a_state_the_operation_does_not_apply_to_is_refused(client: Client) -> None:
    runs = [client.submit(wait_a, i).id for i in range(2)]
    client.cancel(runs[1])
    with pytest.raises(InvalidArgument, match="cancel applies to running and paused runs"):
        client.cancel_many(RunFilter(states=["running", "completed"]))
    with pytest.raises(InvalidArgument, match="resume applies to paused runs"):
        client.resume_many(RunFilter(states="running"), dry_run=True)
    with pytest.raises(InvalidArgument, match="retry applies to failed and cancelled"):
        client.retry_many(RunFilter(states="running"))
    with pytest.raises(InvalidArgument, match="takes a RunFilter"):
        client.cancel_many({"workflows": "bk_wait_a"})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="batch_size"):
        client.cancel_many(RunFilter(workflows="bk_wait_a"), batch_size=0)
    assert states(client, runs) == [RunState.RUNNING, RunState.CANCELLED]
