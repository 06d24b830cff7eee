"""Audit of debounced submits (``client.submit(..., debounce=Debounce(...))``) through the
public API: steering the held run inside its window (cancel, pause, resume, retry, fork,
purge), flow limits keyed on the input, the async client, bad arguments, concurrent
submitters, submits racing the claim, and conditions on the run input."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    Concurrency,
    CycloneError,
    Debounce,
    InvalidArgument,
    RateLimit,
    RunState,
    StepState,
    UnknownWorkflow,
    Worker,
    step,
    workflow,
)
from tests.waiting import wait_until

#: When each doc's first step started (monotonic), per doc.
started: dict[str, list[float]] = {}
release = threading.Event()


@pytest.fixture(autouse=True)
def _fresh() -> None:
    started.clear()
    release.clear()


def _started(job: dict[str, Any]) -> None:
    started.setdefault(str(job.get("doc")), []).append(time.monotonic())


@step(name="dba_echo")
def echo(job: dict[str, Any]) -> object:
    _started(job)
    return job


@workflow(name="dba_wf")
def echo_wf(job):  # type: ignore[no-untyped-def]
    return echo(job)


def window(seconds: float) -> Debounce:
    return Debounce(key="doc", delay=timedelta(seconds=seconds))


HOUR_S = 3600.0


# -- steering the held run inside its window -------------------------------------------------


def test_a_submit_after_the_held_run_was_cancelled_opens_a_new_window(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    first = client.submit(echo_wf, {"doc": "c", "n": 1}, debounce=window(0.3))
    client.cancel(first.id)
    second = client.submit(echo_wf, {"doc": "c", "n": 2}, debounce=window(0.3))
    third = client.submit(echo_wf, {"doc": "c", "n": 3}, debounce=window(0.3))
    assert second.created and second.id != first.id
    assert not third.created and third.id == second.id
    start_worker(echo_wf)
    assert third.result(timeout=10) == {"doc": "c", "n": 3}
    assert client.get_run(first.id).state is RunState.CANCELLED
    assert len(client.list_runs()) == 2


def test_pausing_and_resuming_the_held_run_keeps_its_start(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A pause inside the window does not release the hold: the run starts after its delay."""
    start_worker(echo_wf)
    submitted = time.monotonic()
    handle = client.submit(echo_wf, {"doc": "pr", "n": 1}, debounce=window(1.2))
    client.pause(handle.id)
    client.resume(handle.id)
    assert handle.result(timeout=10) == {"doc": "pr", "n": 1}
    assert started["pr"][0] - submitted >= 1.1, "the resumed run started before its delay"


def test_a_submit_while_the_held_run_is_paused_joins_it(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    first = client.submit(echo_wf, {"doc": "p", "n": 1}, debounce=window(0.3))
    client.pause(first.id)
    second = client.submit(echo_wf, {"doc": "p", "n": 2}, debounce=window(0.3))
    client.resume(first.id)
    start_worker(echo_wf)
    try:
        assert (second.id, second.created) == (first.id, False)
        assert client.result(first.id, timeout=10) == {"doc": "p", "n": 2}
        assert len(client.list_runs()) == 1
    finally:  # (before the fix both runs ran, the paused one with its first input)
        wait_until(
            lambda: all(r.state is RunState.COMPLETED for r in client.list_runs()),
            what="every run to end",
        )


def test_a_deadline_given_while_the_held_run_is_paused_counts_from_the_resume(
    client: Client,
) -> None:
    """A pause stops a deadline's clock: one set during the pause starts at the resume."""
    first = client.submit(echo_wf, {"doc": "pd", "n": 1}, debounce=window(30))
    client.pause(first.id)
    time.sleep(0.5)
    second = client.submit(
        echo_wf, {"doc": "pd", "n": 2}, debounce=window(30), deadline=timedelta(minutes=10)
    )
    assert (second.id, second.created) == (first.id, False)
    time.sleep(0.5)
    client.resume(first.id)
    run = first.get()
    assert run.state is RunState.RUNNING and run.deadline_at is not None
    left = run.deadline_at - run.updated_at  # updated_at: the resume
    assert timedelta(minutes=10) - timedelta(seconds=0.2) < left <= timedelta(minutes=10), left
    client.cancel(first.id)


def test_a_purged_window_run_gives_the_next_submit_a_new_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    first = client.submit(echo_wf, {"doc": "g", "n": 1}, debounce=window(0.3))
    client.cancel(first.id)
    assert client.purge(states=(RunState.CANCELLED,)) == 1
    second = client.submit(echo_wf, {"doc": "g", "n": 2}, debounce=window(0.3))
    assert second.created and second.id != first.id
    start_worker(echo_wf)
    assert second.result(timeout=10) == {"doc": "g", "n": 2}


def test_a_retried_cancelled_run_that_never_started_is_joined_and_held(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A cancelled run reopened by a retry had no step claimed: the next submit of its key
    joins it, and it starts once, after the delay, with the last input."""
    first = client.submit(echo_wf, {"doc": "rt", "n": 1}, debounce=window(0.8))
    client.cancel(first.id)
    client.retry(first.id, "dba_echo")
    joined = client.submit(echo_wf, {"doc": "rt", "n": 2}, debounce=window(0.8))
    joined_at = time.monotonic()
    assert (joined.id, joined.created) == (first.id, False)
    start_worker(echo_wf)
    assert joined.result(timeout=10) == {"doc": "rt", "n": 2}
    assert len(started["rt"]) == 1
    assert started["rt"][0] - joined_at >= 0.7
    assert len(client.list_runs()) == 1


def test_a_fork_of_the_held_run_is_not_in_its_window(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The fork is a run of its own (with the source's input then); the window stays the
    source's, which takes the next submit's input."""
    source = client.submit(echo_wf, {"doc": "f", "n": 1}, debounce=window(0.5))
    fork = client.fork(source.id, "dba_echo")
    joined = client.submit(echo_wf, {"doc": "f", "n": 2}, debounce=window(0.5))
    assert (joined.id, joined.created) == (source.id, False)
    assert fork.id != source.id
    start_worker(echo_wf)
    assert fork.result(timeout=10) == {"doc": "f", "n": 1}
    assert source.result(timeout=10) == {"doc": "f", "n": 2}
    assert client.get_run(fork.id).forked_from == source.id


# -- flow limits keyed on the input ------------------------------------------------------------


@step(name="dba_blocking")
def blocking(job: dict[str, Any]) -> object:
    _started(job)
    if job.get("block"):
        release.wait(20)
    return job


@workflow(name="dba_run_limited", concurrency=Concurrency(key="tenant", limit=1))
def run_limited(job):  # type: ignore[no-untyped-def]
    return blocking(job)


@step(name="dba_step_limited", concurrency=Concurrency(key="tenant", limit=1))
def step_limited(job: dict[str, Any]) -> object:
    _started(job)
    if job.get("block"):
        release.wait(20)
    return job


@workflow(name="dba_step_limited_wf")
def step_limited_wf(job):  # type: ignore[no-untyped-def]
    return step_limited(job)


@pytest.mark.parametrize("wf", [run_limited, step_limited_wf], ids=["run_limit", "step_limit"])
def test_a_later_input_moves_the_run_to_its_concurrency_key(
    client: Client, start_worker: Callable[..., Worker], wf: Any
) -> None:
    start_worker(wf, concurrency=4)
    blocker = client.submit(wf, {"doc": "blk", "tenant": "t1", "block": True})
    wait_until(lambda: "blk" in started, what="the blocker to start")
    # Opened on the busy key, moved to a free one: runs without waiting for t1.
    client.submit(wf, {"doc": "d", "tenant": "t1", "n": 1}, debounce=window(0.3))
    moved = client.submit(wf, {"doc": "d", "tenant": "t2", "n": 2}, debounce=window(0.3))
    assert moved.result(timeout=10) == {"doc": "d", "tenant": "t2", "n": 2}
    # Opened on a free key, moved to the busy one: waits for t1. (Opened for an hour: no
    # claim can take it on t3 before the second submit, however late that comes; the
    # second submit's window is its own.)
    client.submit(wf, {"doc": "e", "tenant": "t3", "n": 1}, debounce=window(HOUR_S))
    queued = client.submit(wf, {"doc": "e", "tenant": "t1", "n": 2}, debounce=window(0.3))
    reasons = wait_until(lambda: client.why_waiting(queued.id), what="the queued run's reason")
    assert "(t1: 1/1" in next(iter(reasons.values()))
    assert "e" not in started
    release.set()
    assert blocker.result(timeout=10)["doc"] == "blk"
    assert queued.result(timeout=10) == {"doc": "e", "tenant": "t1", "n": 2}


@step(name="dba_rated", rate_limit=RateLimit(limit=1, per=timedelta(seconds=60), key="tenant"))
def rated(job: dict[str, Any]) -> object:
    _started(job)
    return job


@workflow(name="dba_rated_wf")
def rated_wf(job):  # type: ignore[no-untyped-def]
    return rated(job)


def test_a_later_input_moves_the_run_to_its_rate_key(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(rated_wf)
    assert client.submit(rated_wf, {"doc": "x", "tenant": "t1"}).result(timeout=10)
    client.submit(rated_wf, {"doc": "d", "tenant": "t1", "n": 1}, debounce=window(0.3))
    moved = client.submit(rated_wf, {"doc": "d", "tenant": "t2", "n": 2}, debounce=window(0.3))
    assert moved.result(timeout=10) == {"doc": "d", "tenant": "t2", "n": 2}
    # Opened for an hour on a free key: no claim takes it before the move to t1.
    client.submit(rated_wf, {"doc": "e", "tenant": "t3", "n": 1}, debounce=window(HOUR_S))
    limited = client.submit(rated_wf, {"doc": "e", "tenant": "t1", "n": 2}, debounce=window(0.3))
    reasons = wait_until(lambda: client.why_waiting(limited.id), what="the rate limit's reason")
    assert "t1: 1/1 in the window" in reasons["dba_rated"]
    assert "e" not in started


# -- the async client ------------------------------------------------------------------------


def test_the_async_client_debounces(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    async def scenario() -> tuple[list[tuple[int, bool]], object]:
        async with AsyncClient(cyclone_dsn) as aclient:
            handles = [
                await aclient.submit(echo_wf, {"doc": "a", "n": n}, debounce=window(0.3))
                for n in range(3)
            ]
            with pytest.raises(InvalidArgument):
                await aclient.submit(echo_wf, {"n": 9}, debounce=window(0.3))
            with pytest.raises(InvalidArgument):
                await aclient.submit(echo_wf, {"doc": "a"}, debounce="doc")  # type: ignore[arg-type]
            # Started once the submits are made: no claim closes the window between two
            # of them, however slowly a loaded machine makes them.
            await asyncio.to_thread(start_worker, echo_wf)
            return [(h.id, h.created) for h in handles], await handles[0].result(timeout=10)

    shape, result = asyncio.run(scenario())
    run_id = shape[0][0]
    assert shape == [(run_id, True), (run_id, False), (run_id, False)]
    assert result == {"doc": "a", "n": 2}
    assert len(client.list_runs()) == 1


# -- bad arguments -----------------------------------------------------------------------------

ONE_S = timedelta(seconds=1)

BAD_SUBMITS: dict[str, Callable[[Client], object]] = {
    "key field missing": lambda c: c.submit(echo_wf, {"n": 1}, debounce=Debounce(ONE_S, "doc")),
    "key a float": lambda c: c.submit(echo_wf, {"doc": 1.5}, debounce=Debounce(ONE_S, "doc")),
    "key null": lambda c: c.submit(echo_wf, {"doc": None}, debounce=Debounce(ONE_S, "doc")),
    "key a bool": lambda c: c.submit(echo_wf, {"doc": True}, debounce=Debounce(ONE_S, "doc")),
    "key a list": lambda c: c.submit(echo_wf, {"doc": ["a"]}, debounce=Debounce(ONE_S, "doc")),
    "key with NUL": lambda c: c.submit(
        echo_wf, {"doc": "a" + chr(0)}, debounce=Debounce(ONE_S, "doc")
    ),
    "key too long": lambda c: c.submit(
        echo_wf, {"doc": "x" * 257}, debounce=Debounce(ONE_S, "doc")
    ),
    "key a huge int": lambda c: c.submit(
        echo_wf, {"doc": 10**300}, debounce=Debounce(ONE_S, "doc")
    ),
    "input not an object": lambda c: c.submit(echo_wf, [1], debounce=Debounce(ONE_S, "doc")),
    "key function raises": lambda c: c.submit(
        echo_wf, {"doc": "a"}, debounce=Debounce(ONE_S, lambda job: job["nope"])
    ),
    "key function returns None": lambda c: c.submit(
        echo_wf, {"doc": "a"}, debounce=Debounce(ONE_S, lambda job: None)
    ),
    "zero delay": lambda c: c.submit(echo_wf, {"doc": "a"}, debounce=Debounce(timedelta(0), "doc")),
    "negative delay": lambda c: c.submit(
        echo_wf, {"doc": "a"}, debounce=Debounce(timedelta(seconds=-1), "doc")
    ),
    "delay a number": lambda c: c.submit(
        echo_wf,
        {"doc": "a"},
        debounce=Debounce(5, "doc"),  # type: ignore[arg-type]
    ),
    "delay over 1000 years": lambda c: c.submit(
        echo_wf, {"doc": "a"}, debounce=Debounce(timedelta(days=366_001), "doc")
    ),
    "key spec an int": lambda c: c.submit(
        echo_wf,
        {"doc": "a"},
        debounce=Debounce(ONE_S, 5),  # type: ignore[arg-type]
    ),
    "key spec empty": lambda c: c.submit(echo_wf, {"doc": "a"}, debounce=Debounce(ONE_S, "")),
    "debounce a string": lambda c: c.submit(
        echo_wf,
        {"doc": "a"},
        debounce="doc",  # type: ignore[arg-type]
    ),
    "debounce a timedelta": lambda c: c.submit(
        echo_wf,
        {"doc": "a"},
        debounce=ONE_S,  # type: ignore[arg-type]
    ),
    "on a step": lambda c: c.submit(echo, {"doc": "a"}, debounce=Debounce(ONE_S, "doc")),
    "unknown workflow": lambda c: c.submit("nope", {"doc": "a"}, debounce=Debounce(ONE_S, "doc")),
    "negative deadline": lambda c: c.submit(
        echo_wf, {"doc": "a"}, deadline=-ONE_S, debounce=Debounce(ONE_S, "doc")
    ),
    "lone surrogate in the input": lambda c: c.submit(
        echo_wf, {"doc": "a", "x": chr(0xD800)}, debounce=Debounce(ONE_S, "doc")
    ),
}


@pytest.mark.parametrize("case", list(BAD_SUBMITS))
def test_a_bad_debounced_submit_raises_a_typed_error_and_writes_nothing(
    client: Client, case: str
) -> None:
    with pytest.raises((InvalidArgument, UnknownWorkflow)) as raised:
        BAD_SUBMITS[case](client)
    assert isinstance(raised.value, CycloneError)
    assert client.list_runs() == []


def test_the_longest_delay_and_deadline_hold_the_run(client: Client) -> None:
    longest = Debounce(timedelta(days=365_000), "doc")
    first = client.submit(echo_wf, {"doc": "l", "n": 1}, debounce=longest, deadline=longest.delay)
    second = client.submit(echo_wf, {"doc": "l", "n": 2}, debounce=longest)
    assert (second.id, second.created) == (first.id, False)
    run = client.get_run(first.id)
    assert run.input == {"doc": "l", "n": 2}
    assert run.steps[0].state is StepState.AVAILABLE


# -- concurrent submitters and the claim -------------------------------------------------------


def test_two_clients_submitting_one_key_concurrently_make_one_run_with_the_last_input(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    barrier = threading.Barrier(2)
    handles: list[Any] = []
    lock = threading.Lock()

    def submitter(k: int) -> None:
        with Client(cyclone_dsn) as own:
            barrier.wait()
            for n in range(15):
                handle = own.submit(echo_wf, {"doc": "t", "k": k, "n": n}, debounce=window(1))
                with lock:
                    handles.append(handle)

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({h.id for h in handles}) == 1
    assert sorted(h.created for h in handles) == [False] * 29 + [True]
    run_id = handles[0].id
    before = client.get_run(run_id).input
    assert before["n"] == 14  # the last committed submit is one submitter's last
    start_worker(echo_wf)
    assert client.result(run_id, timeout=10) == before
    assert client.get_run(run_id).steps[0].input == before


def test_submits_racing_the_claim_never_change_a_started_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A window of 30 ms and submits 0 to 50 ms apart, with a worker claiming: every run ran
    with the input it shows, and the last submit's run ran with the last input."""
    start_worker(echo_wf, concurrency=8)
    handles = []
    for n in range(120):
        handles.append(
            client.submit(
                echo_wf, {"doc": "r", "n": n}, debounce=Debounce(timedelta(milliseconds=30), "doc")
            )
        )
        time.sleep(0.001 * (n % 50))
    for run_id in {h.id for h in handles}:
        run = client.wait(run_id, timeout=20)
        assert run.state is RunState.COMPLETED
        assert client.result(run_id) == run.input
    assert handles[-1].result(timeout=10) == {"doc": "r", "n": 119}
    assert len(started["r"]) == len({h.id for h in handles})


# -- conditions on the run input ---------------------------------------------------------------


@step(name="dba_fast")
def fast_step(job: dict[str, Any]) -> object:
    return ["fast", job["n"]]


@step(name="dba_slow")
def slow_step(job: dict[str, Any]) -> object:
    return ["slow", job["n"]]


@step(name="dba_pick")
def pick(outs: list[Any]) -> object:
    return outs


@workflow(name="dba_branch_later")
def branch_later_wf(job):  # type: ignore[no-untyped-def]
    first = echo(job)
    fast = fast_step(job, when=job.at("fast").truthy(), after=[first])
    slow = slow_step(job, otherwise=fast, after=[first])
    return pick([fast, slow])


def test_a_condition_after_the_first_step_follows_the_last_input(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    first = client.submit(
        branch_later_wf, {"doc": "bl", "fast": True, "n": 1}, debounce=window(0.3)
    )
    last = client.submit(
        branch_later_wf, {"doc": "bl", "fast": False, "n": 2}, debounce=window(0.3)
    )
    assert (last.id, last.created) == (first.id, False)
    start_worker(branch_later_wf)
    assert last.result(timeout=10) == [None, ["slow", 2]]


@workflow(name="dba_branch")
def branch_wf(job):  # type: ignore[no-untyped-def]
    fast = fast_step(job, when=job.at("fast").truthy())
    slow = slow_step(job, otherwise=fast)
    return pick([fast, slow])


def test_a_workflow_starting_with_conditional_steps_is_refused_with_the_reason(
    client: Client,
) -> None:
    """Its branch would be judged on the first submit's input, not on the last one's."""
    with pytest.raises(InvalidArgument, match="starts with a conditional step") as refused:
        client.submit(branch_wf, {"doc": "b", "fast": True, "n": 1}, debounce=window(0.3))
    assert "when= or otherwise=" in str(refused.value)
    assert client.list_runs() == []  # nothing written
