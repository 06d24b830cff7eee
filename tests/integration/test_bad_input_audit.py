"""Audit: bad input to the public API and hostile handlers.

Client calls given bad arguments are refused with a typed :class:`CycloneError` (usually
:class:`InvalidArgument`) before anything is written, never with a raw TypeError,
struct.error or psycopg error. Names that end in an index (a step's kind, a rate
limit's, a worker's: ``MAX_NAME_BYTES``; a workflow's, a schedule id:
``MAX_WORKFLOW_NAME_BYTES``) are refused over their limit where they are declared; the
longest of each, together, fit every index. Handlers
that misbehave leave their step failed (or the documented outcome), the worker serving,
and the run terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    CycloneError,
    Debounce,
    InvalidArgument,
    RateLimit,
    RunFailed,
    RunState,
    ScheduleError,
    StepContext,
    Worker,
    action,
    schedule,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.durations import MAX_DURATION
from cyclone_dsl.graph.validate import MAX_QUEUE_BYTES
from cyclone_dsl.payload import MAX_NAME_BYTES, MAX_WORKFLOW_NAME_BYTES
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]


def text(size: int, seed: str) -> str:
    """``size`` hex digits that do not compress (PostgreSQL compresses a repetitive text
    before it indexes it, which would hide an entry too long for the index)."""
    digits = "".join(
        hashlib.sha256(f"{seed}{i}".encode()).hexdigest() for i in range(size // 64 + 1)
    )
    return digits[:size]


#: Past what a btree entry holds (2,704 bytes): what reached the indexes before.
LONG = text(3000, "long")

TABLES = (
    "cyclone_runs",
    "cyclone_steps",
    "cyclone_schedules",
    "cyclone_ext_debounce",
    "cyclone_ext_limits",
)


def row_counts(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}  # type: ignore[index]


def nothing_written(dsn: str) -> None:
    assert row_counts(dsn) == dict.fromkeys(TABLES, 0)


# -- client arguments: throughput, purge, stats --------------------------------------------


@pytest.mark.parametrize("buckets", ["30", None, 2.5, True, [30], 0, 1001], ids=repr)
def test_throughput_buckets_other_than_an_int_from_1_to_1000_are_invalid_argument(
    client: Client, buckets: object
) -> None:
    """They raised TypeError ("30", None, [30]) or reached SQL (2.5, True)."""
    with pytest.raises(InvalidArgument, match="buckets must be an integer from 1 to 1000"):
        client.throughput(buckets=buckets)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "states", [None, 5, object(), "failed"], ids=["none", "int", "object", "str"]
)
@pytest.mark.parametrize("method", ["purge", "count_purgeable"])
def test_purge_states_that_are_not_a_collection_of_states_are_invalid_argument(
    client: Client, method: str, states: object
) -> None:
    """They raised TypeError ("not iterable"); a string was read as its letters."""
    with pytest.raises(InvalidArgument, match="states must be a tuple of terminal run states"):
        getattr(client, method)(states=states)


@pytest.mark.parametrize("method", ["stats", "workers"])
def test_live_for_over_the_longest_duration_is_invalid_argument(
    client: Client, method: str
) -> None:
    """A huge one raised struct.error from the interval dumper; the longest is taken."""
    for live_for in (timedelta(days=999_999_999), timedelta.max, MAX_DURATION + timedelta(1)):
        with pytest.raises(InvalidArgument, match="live_for must be a positive duration"):
            getattr(client, method)(live_for=live_for)
    getattr(client, method)(live_for=MAX_DURATION)


# -- names: refused where declared, over their limit -------------------------------------


def _plain(x: Any) -> Any:
    return x


DECLARATIONS = {
    "step": (lambda name: step(name=name)(_plain), MAX_NAME_BYTES),
    "action": (lambda name: action(name=name)(_plain), MAX_NAME_BYTES),
    "rate limit": (
        lambda name: RateLimit(limit=1, per=timedelta(seconds=1), name=name),
        MAX_NAME_BYTES,
    ),
    "worker": (lambda name: Worker("postgresql:///unused", [], name=name), MAX_NAME_BYTES),
    "workflow": (lambda name: workflow(name=name)(_plain), MAX_WORKFLOW_NAME_BYTES),
}


@pytest.mark.parametrize("what", DECLARATIONS)
def test_a_name_over_its_limit_or_with_a_nul_is_refused_where_it_is_declared(what: str) -> None:
    """Each reached an index unchecked (ProgramLimitExceeded at enqueue, submit_once,
    debounce or worker.start; CharacterNotInRepertoire for a rate limit's NUL)."""
    declare, limit = DECLARATIONS[what]
    for name in (text(limit + 1, "over"), LONG):
        with pytest.raises(InvalidArgument, match=f"bytes of UTF-8; the limit is {limit}"):
            declare(name)
    with pytest.raises(InvalidArgument, match="must not contain NUL"):
        declare("a\x00b")


@pytest.mark.parametrize("size", [MAX_WORKFLOW_NAME_BYTES + 1, len(LONG)])
def test_a_schedule_id_over_its_limit_is_a_schedule_error(
    client: Client, cyclone_dsn: str, size: int
) -> None:
    schedule_id = text(size, "schedule")
    limit = f"the limit is {MAX_WORKFLOW_NAME_BYTES}"
    with pytest.raises(ScheduleError, match=limit):
        schedule("0 0 * * *", id=schedule_id)
    with pytest.raises(ScheduleError, match=limit):
        client.schedule(xb_wf, "0 0 * * *", id=schedule_id)
    with pytest.raises(ScheduleError, match=limit):
        client.unschedule(schedule_id)
    nothing_written(cyclone_dsn)


# -- the longest names and keys, together, fit every index ---------------------------------

LONGEST_QUEUE = text(MAX_QUEUE_BYTES, "queue")
#: A key for each limit (flow keys are at most 256 bytes), all different.
LONGEST_JOB = {field: text(256, field) for field in ("a", "b", "c", "d")}


@step(
    name=text(MAX_NAME_BYTES, "kind"),
    queue=LONGEST_QUEUE,
    concurrency=Concurrency(key="a"),
    rate_limit=RateLimit(limit=100, per=timedelta(seconds=1), key="c"),  # named as the kind
)
def xb_longest_step(job: dict[str, str]) -> str:
    return job["a"][:4]


@workflow(name=text(MAX_WORKFLOW_NAME_BYTES, "workflow"), concurrency=Concurrency(key="b"))
def xb_longest_wf(job):  # type: ignore[no-untyped-def]
    return xb_longest_step(job)


def test_the_longest_names_and_keys_together_fit_every_index(
    client: Client, start_worker: StartWorker
) -> None:
    """A gated step's fair key joins its kind, its workflow's name and its rate limit's
    (here the kind), each with a key; a worker's handlers and versions key its name with
    kinds and workflow names; submit keys, debounce keys and schedule ids are indexed too."""
    start_worker(xb_longest_step, queues=[LONGEST_QUEUE], name=text(MAX_NAME_BYTES, "worker"))
    assert client.submit(xb_longest_wf, LONGEST_JOB).result(timeout=20) == LONGEST_JOB["a"][:4]
    keyed = client.submit_once(xb_longest_wf, LONGEST_JOB, key=text(1024, "submit key"))
    assert keyed.result(timeout=20) == LONGEST_JOB["a"][:4]
    debounce = Debounce(delay=timedelta(hours=1), key="d")
    client.submit(xb_longest_wf, LONGEST_JOB, debounce=debounce)
    schedule_id = text(MAX_WORKFLOW_NAME_BYTES, "schedule")
    assert client.schedule(xb_longest_wf, "0 0 * * *", id=schedule_id, input=LONGEST_JOB).id == (
        schedule_id
    )
    unique = client.enqueue(xb_longest_step, LONGEST_JOB, unique_key=text(1024, "unique"))
    assert unique.result(timeout=20) == LONGEST_JOB["a"][:4]


# -- client arguments that are refused (kept as regression checks) --------------------------


@step(name="xb_ok")
def xb_ok(x: Any) -> Any:
    return x


@workflow(name="xb_wf")
def xb_wf(x):  # type: ignore[no-untyped-def]
    return xb_ok(x)


@pytest.mark.parametrize(
    "call",
    [
        lambda c, r: c.fork(r, "a\x00b"),
        lambda c, r: c.fork(r, "xb_ok", input={1: 2}),
        lambda c, r: c.retry(r, "a\udc80"),
        lambda c, r: c.signal(r, "s", {"k": b"bytes"}),
        lambda c, r: c.signal(r, "s\x00"),
        lambda c, r: c.signal(r, text(1025, "signal")),
        lambda c, r: c.events_of(r, after=-1),
        lambda c, r: c.wait(r, timeout=float("nan")),
        lambda c, r: c.list_runs(state=[]),
        lambda c, r: c.list_runs(text="a\x00"),
        lambda c, r: c.unschedule("a\x00"),
        lambda c, r: c.enable_schedule(5),
        lambda c, r: c.set_queue_limit("q\x00", 1),
        lambda c, r: c.set_queue_limit(text(MAX_QUEUE_BYTES + 1, "queue"), 1),
        lambda c, r: c.enqueue(xb_ok, 1, concurrency_key="a\x00"),
        lambda c, r: c.enqueue(xb_ok, 1, unique_key="\ud800"),
        lambda c, r: c.enqueue(xb_ok, 1, unique_key=text(1025, "unique")),
        lambda c, r: c.enqueue(xb_ok, 1, sequence_key=text(1025, "sequence")),
        lambda c, r: c.enqueue(xb_ok, 1, timeout=float("inf")),
        lambda c, r: c.enqueue(xb_ok, 1, retention=10**400),
        lambda c, r: c.enqueue(xb_ok, 1, priority=float("nan")),
        lambda c, r: c.enqueue(xb_ok, 1, queue=text(MAX_QUEUE_BYTES + 1, "queue")),
        lambda c, r: c.submit(xb_wf, 1, deadline=timedelta.max),
        lambda c, r: c.submit_once(xb_wf, 1, key=text(1025, "submit key")),
        lambda c, r: c.submit_many(xb_wf, [1, {1, 2}]),
        lambda c, r: c.submit(xb_wf, 1, debounce=Debounce(delay=timedelta(1), key=lambda i: 1 / 0)),
        lambda c, r: c.submit(xb_wf, 1, debounce=Debounce(delay=timedelta(1), key=lambda i: LONG)),
        lambda c, r: c.schedule(xb_wf, "0 0 30 2 *"),
        lambda c, r: c.schedule(xb_wf, "* * * * *", location="../../etc/passwd"),
        lambda c, r: c.throughput(buckets=True),
        lambda c, r: c.purge(states=None),
        lambda c, r: c.stats(live_for=timedelta.max),
    ],
)
def test_bad_arguments_are_refused_with_a_typed_error_and_write_nothing(
    client: Client, cyclone_dsn: str, call: Callable[[Client, int], object]
) -> None:
    run_id = client.submit(xb_wf, 1).id
    before = row_counts(cyclone_dsn)
    with pytest.raises(CycloneError):
        call(client, run_id)
    assert row_counts(cyclone_dsn) == before


# -- handlers that call back into the client ----------------------------------------------

CLIENT: dict[str, Client] = {}


@pytest.fixture
def shared_client(client: Client) -> Iterator[Client]:
    CLIENT["c"] = client
    yield client
    CLIENT.clear()


@step(name="xb_cancel_self", max_attempts=1)
def xb_cancel_self(x: Any, *, ctx: StepContext) -> str:
    CLIENT["c"].cancel(ctx.run_id)
    return "returned after cancelling its own run"


@step(name="xb_pause_self", max_attempts=1)
def xb_pause_self(x: Any, *, ctx: StepContext) -> int:
    CLIENT["c"].pause(ctx.run_id)
    return x + 1


@step(name="xb_signal_self", max_attempts=1)
def xb_signal_self(x: Any, *, ctx: StepContext) -> int:
    CLIENT["c"].signal(ctx.run_id, "go", {"from": "myself"})
    return x


@step(name="xb_submits_child", max_attempts=1)
def xb_submits_child(x: Any, *, ctx: StepContext) -> int:
    return CLIENT["c"].enqueue(xb_ok, x * 10).id


@step(name="xb_after")
def xb_after(x: Any) -> Any:
    return x


@workflow(name="xb_cancel_wf")
def xb_cancel_wf(x):  # type: ignore[no-untyped-def]
    return xb_after(xb_cancel_self(x))


@workflow(name="xb_pause_wf")
def xb_pause_wf(x):  # type: ignore[no-untyped-def]
    return xb_after(xb_pause_self(x))


@workflow(name="xb_signal_wf")
def xb_signal_wf(x):  # type: ignore[no-untyped-def]
    first = xb_signal_self(x)
    return xb_after(wait_signal("go", after=[first]))


def test_a_handler_that_cancels_its_own_run_ends_it_cancelled_and_the_worker_goes_on(
    shared_client: Client, start_worker: StartWorker
) -> None:
    start_worker(xb_cancel_wf, xb_ok)
    handle = shared_client.submit(xb_cancel_wf, 1)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    run = handle.get()
    assert run.state == RunState.CANCELLED
    assert {s.node: s.output for s in run.steps}.get("xb_after") is None
    assert shared_client.enqueue(xb_ok, 5).result(timeout=20) == 5


def test_a_handler_that_pauses_its_own_run_completes_after_resume(
    shared_client: Client, start_worker: StartWorker
) -> None:
    start_worker(xb_pause_wf)
    handle = shared_client.submit(xb_pause_wf, 1)
    wait_until(
        lambda: (
            handle.get().state == RunState.PAUSED
            and any(
                s.node == "xb_pause_self" and s.state.value == "completed"
                for s in handle.get().steps
            )
        ),
        what="the run paused with its first step completed",
    )
    shared_client.resume(handle.id)
    assert handle.result(timeout=20) == 2


def test_a_handler_that_signals_its_own_run_for_a_later_wait(
    shared_client: Client, start_worker: StartWorker
) -> None:
    start_worker(xb_signal_wf)
    handle = shared_client.submit(xb_signal_wf, 1)
    assert handle.result(timeout=20) == {"from": "myself"}


def test_a_handler_that_enqueues_other_work_from_inside(
    shared_client: Client, start_worker: StartWorker
) -> None:
    start_worker(xb_submits_child, xb_ok)
    child_id = shared_client.enqueue(xb_submits_child, 2).result(timeout=20)
    assert isinstance(child_id, int)
    assert shared_client.result(child_id, timeout=20) == 20


# -- hostile handlers ----------------------------------------------------------------------


@step(name="xb_generator_exit_sync", max_attempts=2)
def xb_generator_exit_sync(x: Any) -> Any:
    raise GeneratorExit


@step(name="xb_generator_exit_async", max_attempts=2)
async def xb_generator_exit_async(x: Any) -> Any:
    await asyncio.sleep(0)
    raise GeneratorExit


def _recurse(n: int) -> int:
    return _recurse(n + 1) + 1


@step(name="xb_recursion_sync", max_attempts=2)
def xb_recursion_sync(x: Any) -> Any:
    return _recurse(0)


@step(name="xb_recursion_async", max_attempts=2)
async def xb_recursion_async(x: Any) -> Any:
    return _recurse(0)


@step(name="xb_stop_iteration_async", max_attempts=2)
async def xb_stop_iteration_async(x: Any) -> Any:
    raise StopIteration


@step(name="xb_stop_iteration_sync", max_attempts=2)
def xb_stop_iteration_sync(x: Any) -> Any:
    raise StopIteration


@step(name="xb_memory_error", max_attempts=2)
def xb_memory_error(x: Any) -> Any:
    raise MemoryError


@step(name="xb_ok_async")
async def xb_ok_async(x: Any) -> Any:
    return x


HOSTILE = [
    xb_generator_exit_sync,
    xb_generator_exit_async,
    xb_recursion_sync,
    xb_recursion_async,
    xb_stop_iteration_async,
    xb_stop_iteration_sync,
    xb_memory_error,
]


def test_hostile_exceptions_fail_their_step_with_every_attempt_and_the_worker_goes_on(
    client: Client, start_worker: StartWorker
) -> None:
    """GeneratorExit, RecursionError, StopIteration (sync and async) and MemoryError each
    spend an attempt like any error; one worker runs them all at once and goes on."""
    start_worker(*HOSTILE, xb_ok, xb_ok_async)
    handles = {handler.name: client.enqueue(handler, 1) for handler in HOSTILE}
    for name, handle in handles.items():
        with pytest.raises(RunFailed):
            handle.result(timeout=20)
        row = handle.get().steps[0]
        assert (row.attempt, row.error_kind) == (2, "error"), name
        assert row.error is not None, name
    assert client.enqueue(xb_ok, 3).result(timeout=20) == 3
    assert client.enqueue(xb_ok_async, 4).result(timeout=20) == 4


@action(name="xb_action_returns_nul")
def xb_action_returns_nul(x: Any) -> Any:
    return "a\x00b"


@step(name="xb_emits_str_subclass", max_attempts=1)
def xb_emits_str_subclass(x: Any, *, ctx: StepContext) -> Any:
    class BadStr(str):
        def __str__(self) -> str:  # a str subclass whose str() raises
            raise RuntimeError("nope")

    ctx.emit({"k": BadStr("v")})
    ctx.progress(1, 2, BadStr("m"))
    return "ok"


def test_an_emit_of_a_str_subclass_is_kept_or_refused_but_never_wedges_the_step(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(xb_emits_str_subclass)
    handle = client.enqueue(xb_emits_str_subclass, 1)
    with contextlib.suppress(RunFailed):
        handle.result(timeout=20)
    assert handle.get().state in (RunState.COMPLETED, RunState.FAILED)


def test_an_action_that_returns_a_nul_string_completes(
    client: Client, start_worker: StartWorker
) -> None:
    """An action's output is not kept: a value jsonb would refuse does not matter."""
    start_worker(xb_action_returns_nul)
    handle = client.enqueue(xb_action_returns_nul, 1)
    handle.wait(timeout=20)
    assert handle.get().state == RunState.COMPLETED


@pytest.mark.parametrize("timeout", [1e10, -1, float("nan"), "5", True])
def test_a_worker_stop_with_a_bad_timeout_is_refused_before_it_stops(
    client: Client, start_worker: Callable[..., Worker], timeout: object
) -> None:
    """Worker.stop(timeout=1e10) raised OverflowError from the thread wait, after it had set
    the worker stopping; a string raised TypeError the same way."""
    worker = start_worker(xb_ok)
    with pytest.raises(InvalidArgument, match="timeout must be a finite number of seconds"):
        worker.stop(timeout=timeout)  # type: ignore[arg-type]
    assert client.enqueue(xb_ok, 7).result(timeout=20) == 7  # still serving
