"""Audit of purge and retention: what they delete, what they keep, and how they race."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta

import pytest

from cyclone_dsl import (
    Client,
    Delivery,
    InvalidArgument,
    InvalidTransition,
    RunFailed,
    RunHandle,
    RunNotFound,
    RunState,
    StepState,
    Worker,
    child,
    for_each,
    step,
    wait_signal,
    workflow,
)
from tests.waiting import PROMPT, scanner_passes, wait_until

gate = threading.Event()
failing = threading.Event()


@pytest.fixture(autouse=True)
def _reset_events() -> Iterator[None]:
    gate.clear()
    failing.clear()
    yield
    gate.set()  # a handler still blocked must not hold its worker's stop
    failing.clear()


@step(name="prt_echo")
def echo(x: object) -> object:
    return x


@step(name="prt_gate")
def wait_gate(x: int) -> int:
    gate.wait(20)
    return x


@step(name="prt_boom", max_attempts=1)
def boom(x: int) -> int:
    raise ValueError(f"boom {x}")


@step(name="prt_flaky", max_attempts=1)
def flaky(x: int) -> int:
    if failing.is_set():
        raise ValueError("flaky")
    return x + 100


@step(name="prt_fail_on_two", max_attempts=1)
def fail_on_two(x: int) -> int:
    if x == 2 and failing.is_set():
        raise ValueError("two")
    return x * 10


@step(name="prt_items")
def items(n: int) -> list[int]:
    return list(range(n))


@step(name="prt_pair")
def pair(a: object, b: object) -> list[object]:
    return [a, b]


@workflow(name="prt_child_ok")
def child_ok(x):  # type: ignore[no-untyped-def]
    return echo(x)


@workflow(name="prt_child_flaky")
def child_flaky(x):  # type: ignore[no-untyped-def]
    return flaky(x)


@workflow(name="prt_item_wf")
def item_wf(x):  # type: ignore[no-untyped-def]
    return fail_on_two(x)


@workflow(name="prt_parent_ok_child")
def parent_ok_child(x):  # type: ignore[no-untyped-def]
    c = child(child_ok, x)
    g = wait_gate(x)
    return pair(c, g)


@workflow(name="prt_parent_contained")
def parent_contained(x):  # type: ignore[no-untyped-def]
    c = child(child_flaky, x)
    echo(c, on_dep_failure="cancel_branch")
    return wait_gate(x)


@workflow(name="prt_parent_fails_after_child")
def parent_fails_after_child(x):  # type: ignore[no-untyped-def]
    c = child(child_ok, x)
    return boom(c)


@workflow(name="prt_mid")
def mid(x):  # type: ignore[no-untyped-def]
    return child(child_flaky, x)


@workflow(name="prt_top")
def top(x):  # type: ignore[no-untyped-def]
    return child(mid, x)


@workflow(name="prt_fan_children")
def fan_children(n):  # type: ignore[no-untyped-def]
    fanned = for_each(item_wf, over=items(n))
    return pair(fanned, wait_gate(n))


@workflow(name="prt_fan_steps")
def fan_steps(n):  # type: ignore[no-untyped-def]
    fanned = for_each(fail_on_two, over=items(n))
    return pair(fanned, wait_gate(n))


@workflow(name="prt_approval")
def approval(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("approved"))


@workflow(name="prt_gated_signal")
def gated_signal(x):  # type: ignore[no-untyped-def]
    first = wait_gate(x)
    return echo(wait_signal("go", after=[first]))


@workflow(name="prt_gated_child")
def gated_child(x):  # type: ignore[no-untyped-def]
    return wait_gate(x)


@workflow(name="prt_fail_beside_child")
def fail_beside_child(x):  # type: ignore[no-untyped-def]
    child(gated_child, x)
    return boom(x)


@workflow(name="prt_two_steps")
def two_steps(x):  # type: ignore[no-untyped-def]
    return flaky(echo(x))


HANDLERS = (echo, wait_gate, boom, flaky, fail_on_two, items, pair)
WORKFLOWS = (child_ok, child_flaky, item_wf, mid)


def start(start_worker: Callable[..., Worker], *extra: object, **options: object) -> Worker:
    options.setdefault("lease", 5.0)
    options.setdefault("retention", None)
    return start_worker(*HANDLERS, *WORKFLOWS, *extra, **options)


def run_ids(client: Client) -> set[int]:
    return {r.id for r in client.list_runs(limit=1000)}


HOUR = timedelta(hours=1)
Clock = Callable[[datetime | timedelta], None]


def purge_all(client: Client, count: int, batch_size: int = 1000) -> None:
    """The dry run counts ``count`` runs, one purge deletes them all, and nothing is left."""
    assert client.count_purgeable() == count
    assert client.purge(batch_size=batch_size) == count
    assert run_ids(client) == set()
    assert client.purge() == 0
    assert client.count_purgeable() == 0


def child_id(client: Client, run_id: int) -> int:
    (row,) = client.children_of(run_id)
    return int(row["id"])


# -- 1. a running parent keeps its ended child runs --------------------------------------


def test_purge_keeps_the_completed_child_of_a_running_parent(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, parent_ok_child)
    handle = client.submit(parent_ok_child, 7)
    kid = wait_until(lambda: client.children_of(handle.id), what="the child run")[0]["id"]
    wait_until(
        lambda: client.get_run(kid).state is RunState.COMPLETED, what="the child to complete"
    )
    assert client.count_purgeable() == 0
    assert client.purge() == 0
    assert client.get_run(kid).state is RunState.COMPLETED
    gate.set()
    assert handle.result(timeout=20) == [7, 7]
    assert client.purge() == 2
    assert run_ids(client) == set()
    assert client.purge() == 0


def test_purge_keeps_the_failed_child_of_a_running_parent_and_a_retry_reuses_it(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The child failed, its branch is contained (cancel_branch), the parent still runs:
    the failed child is kept (a retry of the parent's child node retries it in place)."""
    start(start_worker, parent_contained)
    failing.set()
    handle = client.submit(parent_contained, 3)
    kid = wait_until(lambda: client.children_of(handle.id), what="the child run")[0]["id"]
    wait_until(lambda: client.get_run(kid).state is RunState.FAILED, what="the child to fail")
    assert client.purge(states=("failed",)) == 0
    assert client.purge() == 0
    assert client.get_run(kid).state is RunState.FAILED
    gate.set()
    assert handle.result(timeout=20) == 3
    run = handle.get()
    assert run.state is RunState.COMPLETED
    assert run.step("prt_child_flaky").error_kind == "child_failed"
    # The parent completed: its failed child may go now; the parent stays.
    assert client.purge(states=("failed",)) == 1
    assert run_ids(client) == {handle.id}
    # A retry of the contained child node starts a fresh child run, which completes.
    failing.clear()
    client.retry(handle.id, "prt_child_flaky")
    wait_until(
        lambda: handle.get().step("prt_echo").state is StepState.COMPLETED,
        what="the retried branch to complete",
    )
    assert handle.result(timeout=20) == 3
    fresh = child_id(client, handle.id)
    assert fresh != kid
    assert client.get_run(fresh).state is RunState.COMPLETED
    assert handle.get().step("prt_echo").output == 103


# -- 2. a failed parent and its ended child runs go in one purge ---------------------------


def test_one_purge_takes_a_failed_parent_with_a_completed_child(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, parent_fails_after_child)
    handle = client.submit(parent_fails_after_child, 1)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    kid = child_id(client, handle.id)
    assert client.get_run(kid).state is RunState.COMPLETED
    purge_all(client, 2, batch_size=1)


def test_one_purge_takes_a_failed_three_level_chain(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, top)
    failing.set()
    handle = client.submit(top, 1)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    assert len(run_ids(client)) == 3
    purge_all(client, 3)


def test_purge_of_failed_only_leaves_a_cancelled_child_that_a_later_purge_takes(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A parent that fails while its child runs cancels the child; purging failed runs
    only takes the parent, the cancelled child stays (as asked) and cannot be retried."""

    start(start_worker, fail_beside_child, gated_child)
    handle = client.submit(fail_beside_child, 1)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    kid = child_id(client, handle.id)
    wait_until(lambda: client.get_run(kid).is_terminal, what="the child to end")
    assert client.get_run(kid).state is RunState.CANCELLED
    assert client.purge(states=("failed",)) == 1
    assert run_ids(client) == {kid}
    with pytest.raises(InvalidTransition):
        client.retry(kid, "prt_gate")
    assert client.purge() == 1
    assert run_ids(client) == set()


# -- 3. fan-outs ---------------------------------------------------------------------------


def test_purge_keeps_fan_out_child_runs_while_the_parent_runs(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, fan_children)
    handle = client.submit(fan_children, 4)
    wait_until(
        lambda: [c["state"] for c in client.children_of(handle.id)] == ["completed"] * 4,
        what="four completed child runs",
    )
    assert client.purge() == 0
    assert client.count_purgeable() == 0
    gate.set()
    assert handle.result(timeout=20) == [[0, 10, 20, 30], 4]
    purge_all(client, 5)


def test_one_purge_takes_a_failed_fan_out_parent_and_all_its_children(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, fan_children)
    failing.set()
    gate.set()
    handle = client.submit(fan_children, 4)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    wait_until(
        lambda: all(c["state"] != "running" for c in client.children_of(handle.id)),
        what="every child run to end",
    )
    total = len(run_ids(client))
    assert total >= 2
    purge_all(client, total, batch_size=2)


def test_purge_while_a_step_fan_out_runs_then_a_retry_after_the_purge_of_others(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, fan_steps, child_ok)
    failing.set()
    handle = client.submit(fan_steps, 4)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    other = client.submit(child_ok, 1)
    assert other.result(timeout=20) == 1
    # Only the completed run goes; the failed fan-out run stays and can be retried.
    assert client.purge(states=("completed",)) == 1
    assert run_ids(client) == {handle.id}
    failing.clear()
    gate.set()
    client.retry(handle.id, "prt_fail_on_two")
    assert handle.result(timeout=20) == [[0, 10, 20, 30], 4]


# -- 4. signals ----------------------------------------------------------------------------


def test_a_waiting_run_is_not_purged_and_a_purged_run_takes_no_signal(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, approval)
    handle = client.submit(approval, 1)
    wait_until(
        lambda: any(s.state is StepState.WAITING_SIGNAL for s in handle.get().steps),
        what="the wait",
    )
    assert client.purge() == 0
    assert client.signal(handle.id, "approved", {"ok": True}) is Delivery.CONSUMED
    assert handle.result(timeout=20) == {"ok": True}
    assert client.purge() == 1
    with pytest.raises(RunNotFound):
        client.signal(handle.id, "approved", 1)
    with pytest.raises(RunNotFound):
        client.get_run(handle.id)


def test_buffered_signals_go_with_their_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, gated_signal)
    old = client.submit(gated_signal, 1)
    assert client.signal(old.id, "go", "old") is Delivery.BUFFERED
    assert len(client.signals_of(old.id)) == 1
    client.cancel(old.id)
    assert client.purge() == 1
    for gone in (lambda: client.signal(old.id, "go", "late"), lambda: client.signals_of(old.id)):
        with pytest.raises(RunNotFound):
            gone()
    new = client.submit(gated_signal, 2)
    gate.set()
    wait_until(
        lambda: any(s.state is StepState.WAITING_SIGNAL for s in new.get().steps),
        what="the new run to wait for its signal",
    )
    assert client.signals_of(new.id) == []
    assert client.signal(new.id, "go", "new") is Delivery.CONSUMED
    assert new.result(timeout=20) == "new"


# -- 5. purge racing retry and fork --------------------------------------------------------

ROUNDS = 12


def _race(action: Callable[[], object], client: Client) -> tuple[object, int]:
    """Run ``action`` and a purge at once; return what the action gave (or raised) and
    how many runs the purge deleted."""
    barrier = threading.Barrier(2)
    out: dict[str, object] = {}

    def act() -> None:
        barrier.wait()
        try:
            out["action"] = action()
        except Exception as exc:
            out["action"] = exc

    def purge() -> None:
        barrier.wait()
        try:
            out["purge"] = client.purge(states=("failed",))
        except Exception as exc:
            out["purge"] = exc

    threads = [threading.Thread(target=act), threading.Thread(target=purge)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    purged = out["purge"]
    assert isinstance(purged, int), f"purge raised {purged!r}"
    return out["action"], purged


def _failed(client: Client, wf: object, x: int) -> RunHandle:
    """A new run of ``wf`` that failed (pa_flaky fails while ``failing`` is set)."""
    failing.set()
    handle = client.submit(wf, x)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    failing.clear()
    return handle


def test_purge_racing_retry_of_a_failed_run(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, two_steps)
    with Client(cyclone_dsn) as other:
        for i in range(ROUNDS):
            h = _failed(client, two_steps, i)
            got, purged = _race(functools.partial(other.retry, h.id, "prt_flaky"), client)
            if isinstance(got, RunNotFound):
                assert purged == 1
                with pytest.raises(RunNotFound):
                    client.get_run(h.id)
            else:
                assert got is None, f"retry raised {got!r}"
                assert purged == 0
                assert h.result(timeout=20) == i + 100
                assert len(h.get().steps) == 2
                assert client.purge() == 1
            assert run_ids(client) == set()


def _race_parent_retry(client: Client, other: Client, i: int) -> tuple[RunHandle, int, object, int]:
    """Fail a run of prt_mid (its child run fails), then race a retry of its child node
    against a purge of failed runs."""
    h = _failed(client, mid, i)
    kid = child_id(client, h.id)
    got, purged = _race(lambda: other.retry(h.id, "prt_child_flaky"), client)
    return h, kid, got, purged


def test_purge_racing_retry_of_a_failed_parent_with_a_failed_child(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Either the retry wins (both runs kept, the parent completes) or the purge does
    (RunNotFound): never a raw error, a half-deleted run or a child that cannot go. Before,
    the purge could return with the child left behind: its batch skipped the child run,
    which the losing retry held for a moment (in a few rounds of 40)."""
    start(start_worker, mid)
    with Client(cyclone_dsn) as other:
        for i in range(40):
            h, kid, got, purged = _race_parent_retry(client, other, i)
            if isinstance(got, RunNotFound):
                assert purged == 2  # the parent, then the child the retry held a moment
                for gone in (h.id, kid):
                    with pytest.raises(RunNotFound):
                        client.get_run(gone)
            else:
                assert got is None, f"retry raised {got!r}"
                assert purged == 0
                assert h.result(timeout=20) == i + 100
                kept = client.get_run(kid)
                assert kept.state is RunState.COMPLETED
                assert kept.steps
                assert client.purge() == 2
            assert run_ids(client) == set()


def test_purge_racing_fork_of_a_failed_run(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, two_steps)
    with Client(cyclone_dsn) as other:
        for i in range(ROUNDS):
            h = _failed(client, two_steps, i)
            got, purged = _race(functools.partial(other.fork, h.id, "prt_flaky"), client)
            assert purged in (0, 1)
            if isinstance(got, RunNotFound):
                assert purged == 1
            else:
                assert isinstance(got, RunHandle), f"fork raised {got!r}"
                assert got.result(timeout=20) == i + 100
                run = got.get()
                assert run.forked_from == h.id
                assert run.step("prt_echo").state is StepState.COMPLETED
                assert run.step("prt_echo").output == i
            if purged == 0:
                assert client.get_run(h.id).state is RunState.FAILED
            client.purge()
            assert run_ids(client) == set()


# -- 6. submit keys ------------------------------------------------------------------------


def test_purge_frees_a_submit_key(client: Client, start_worker: Callable[..., Worker]) -> None:
    start(start_worker)
    first = client.submit_once(child_ok, 1, key="pa-key")
    assert first.created
    assert first.result(timeout=20) == 1
    again = client.submit_once(child_ok, 2, key="pa-key")
    assert not again.created and again.id == first.id
    assert client.purge(states=("failed",)) == 0
    assert client.submit_once(child_ok, 3, key="pa-key").id == first.id
    assert client.purge() == 1
    fresh = client.submit_once(child_ok, 4, key="pa-key")
    assert fresh.created and fresh.id != first.id
    assert fresh.result(timeout=20) == 4
    assert client.get_run(fresh.id).submit_key == "pa-key"


# -- 7. retention --------------------------------------------------------------------------


def test_retention_keeps_the_child_of_a_running_parent_then_takes_both(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    # A retention of an hour, passed by moving the clock (one of seconds could take the
    # parent before its result is read); a lease longer than the moves keeps the parent's
    # running step its own.
    worker = start(start_worker, parent_ok_child, retention=HOUR, lease=4 * 3600.0)
    handle = client.submit(parent_ok_child, 5)
    kid = wait_until(lambda: client.children_of(handle.id), what="the child run")[0]["id"]
    wait_until(
        lambda: client.get_run(kid).state is RunState.COMPLETED, what="the child to complete"
    )
    clock(2 * HOUR)  # past the child's retention
    scanner_passes(worker, 2)
    assert client.get_run(kid).state is RunState.COMPLETED
    gate.set()
    assert handle.result(timeout=20) == [5, 5]
    clock(4 * HOUR)  # past the parent's retention too
    wait_until(lambda: run_ids(client) == set(), timeout=15, what="retention to take both runs")


def test_retention_takes_a_failed_chain_over_its_passes(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start(start_worker, top, retention=HOUR)
    failing.set()
    handle = client.submit(top, 1)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    clock(2 * HOUR)
    wait_until(lambda: run_ids(client) == set(), timeout=15, what="retention to take the chain")


def test_one_retention_pass_takes_a_failed_chain_of_child_runs(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """A child run is kept while its parent exists: a pass that stopped at its first short
    batch deleted the parent and left each level of children to a later pass."""
    start(start_worker, top, scanners=False)
    failing.set()
    handle = client.submit(top, 1)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    assert len(run_ids(client)) == 3
    time.sleep(1.1)  # past the 1 s retention below
    scan = subprocess.run(
        [
            *(sys.executable, "-m", "cyclone_dsl.cli", "--dsn", cyclone_dsn),
            *("scan", "--once", "--retention", "1s"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert scan.returncode == 0, scan.stderr
    assert run_ids(client) == set()


# -- 8. bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"states": ("running",)},
        {"states": ("paused",)},
        {"states": ()},
        {"states": ("completed", "bogus")},
        {"older_than": timedelta(seconds=-1)},
        {"older_than": 60},
        {"batch_size": 0},
        {"batch_size": -5},
        {"batch_size": True},
    ],
)
def test_purge_refuses_bad_arguments_with_a_typed_error(
    client: Client, kwargs: dict[str, object]
) -> None:
    with pytest.raises(InvalidArgument):
        client.purge(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "retention", [timedelta(seconds=-1), timedelta(0), 0, -5, float("nan"), "7d", timedelta.max]
)
def test_worker_refuses_a_retention_that_is_not_a_duration(
    cyclone_dsn: str, retention: object
) -> None:
    with pytest.raises(InvalidArgument, match="retention must be a positive duration"):
        Worker(cyclone_dsn, [echo], retention=retention)  # type: ignore[arg-type]


def test_worker_retention_in_seconds_applies(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """lease=, poll_interval= and a step's retention= take seconds: so does a worker's."""
    worker = start(start_worker, retention=3600.0)  # an hour, passed by moving the clock
    handle = client.submit(child_ok, 1)
    assert handle.result(timeout=20) == 1
    clock(timedelta(minutes=30))  # kept: not past 3600 seconds
    scanner_passes(worker, 2)
    assert run_ids(client) == {handle.id}
    clock(2 * HOUR)
    wait_until(lambda: run_ids(client) == set(), timeout=PROMPT, what="retention to take the run")


@pytest.mark.parametrize(
    "older_than", [timedelta(days=365_001), timedelta(days=3_000_000), timedelta.max]
)
def test_purge_refuses_an_older_than_past_the_timestamp_range(
    client: Client, start_worker: Callable[..., Worker], older_than: timedelta
) -> None:
    """A typed refusal, never a raw database error; nothing is deleted."""
    start(start_worker)
    handle = client.submit(child_ok, 1)
    assert handle.result(timeout=20) == 1
    for call in (client.count_purgeable, client.purge):
        with pytest.raises(InvalidArgument, match="older_than must be a timedelta from 0"):
            call(older_than=older_than)
    assert client.count_purgeable(older_than=timedelta(days=365_000)) == 0
    assert run_ids(client) == {handle.id}
