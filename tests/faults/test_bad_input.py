"""Hostile and malformed input: a typed error at the API boundary, and nothing written."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Callable
from datetime import timedelta

import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    Debounce,
    InvalidArgument,
    InvalidGraph,
    InvalidPayload,
    PayloadTooLarge,
    RunFilter,
    RunNotFound,
    UnknownKind,
    UnknownWorkflow,
    Worker,
    payload,
    step,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.errors import ScheduleError, SignalNotDeliverable


@step(name="bi_echo")
def echo(x: object) -> object:
    return x


@step(name="bi_huge_output", max_attempts=3)
def huge_output(n: int) -> str:
    return "x" * n


@workflow(name="bi_flow")
def flow(x):  # type: ignore[no-untyped-def]
    return echo(x)


class UnreprKey:
    def __repr__(self) -> str:
        raise RuntimeError("__repr__ is broken")


def deep(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


HOSTILE_INPUTS: list[tuple[object, type[Exception]]] = [
    (float("nan"), InvalidPayload),
    (float("inf"), InvalidPayload),
    ({"a": "nul\x00byte"}, InvalidPayload),
    ("lone \ud800 surrogate", InvalidPayload),
    ({1: "non-string key"}, InvalidPayload),
    ({UnreprKey(): "a key whose repr raises"}, InvalidPayload),
    ({"when": object()}, InvalidPayload),
    ({"bytes": b"raw"}, InvalidPayload),
    ({"set": {1, 2}}, InvalidPayload),
    (deep(100_000), InvalidPayload),
    ("x" * (17 * 1024 * 1024), PayloadTooLarge),
]


@pytest.mark.parametrize(("value", "error"), HOSTILE_INPUTS, ids=lambda v: type(v).__name__)
def test_hostile_inputs_are_refused_before_any_write(
    client: Client, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        client.submit(flow, value)  # type: ignore[arg-type]
    with pytest.raises(error):
        client.enqueue(echo, value)  # type: ignore[arg-type]
    assert client.list_runs() == []


def test_invalid_payload_names_the_json_path(client: Client) -> None:
    with pytest.raises(InvalidPayload) as caught:
        client.submit(flow, {"order": {"lines": [1, float("nan")]}})
    assert caught.value.path == "$.order.lines[1]"


@pytest.mark.parametrize(
    ("value", "path"),
    [
        pytest.param({"a\nb": {"\ud800": 1}}, '$["a\\nb"]["\\ud800"]', id="surrogate-key"),
        pytest.param({"ok": [{"x\x00": 1}]}, '$.ok[0]["x\\u0000"]', id="nul-key"),
        pytest.param({"k" * 500: [1, 2**64]}, "$." + "k" * 200 + "…[1]", id="long-key"),
    ],
)
def test_invalid_payload_paths_are_printable_and_bounded(
    client: Client, value: object, path: str
) -> None:
    """A path names an odd key as a JSON string (a lone surrogate, a NUL or a new line in
    the message could not be logged or stored) and cuts a long one."""
    with pytest.raises(InvalidPayload) as caught:
        client.submit(flow, value)  # type: ignore[arg-type]
    assert caught.value.path == path
    str(caught.value).encode("utf-8")  # no lone surrogate: printable anywhere


def test_checking_a_large_flat_list_stacks_nothing_per_item() -> None:
    """Only containers are stacked by the check, and a path is built only for an error: a
    list of 500,000 numbers (1 MB of JSON) costs far less than a copy per item, which
    was 65 MB (every output is checked so in the worker)."""
    value = [0] * 500_000
    tracemalloc.start()
    try:
        payload.check(value)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000, peak


HOSTILE_NAMES = [
    "'; DROP TABLE cyclone_runs;--",
    'quote " and \\ backslash',
    "%s %(x)s",
    "émoji 🌀 and \u202e rtl",
    "q" * 256,
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_names_are_stored_byte_for_byte(
    client: Client, name: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(echo, queues=[name])
    handle = client.enqueue(echo, name, queue=name, unique_key=name, sequence_key=name)
    assert handle.result(timeout=10) == name
    assert handle.get().step("bi_echo").queue == name
    again = client.submit_once(flow, 1, key=name)
    assert client.submit_once(flow, 2, key=name).id == again.id


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"queue": "q" * 257}, "257 bytes"),
        ({"queue": ""}, "non-empty"),
        ({"priority": 2**40}, "32-bit"),
        ({"priority": "high"}, "32-bit"),
        ({"max_attempts": -1}, "at least 1"),
        ({"timeout": -5}, "positive duration"),
        ({"timeout": "soon"}, "positive duration"),
        ({"retention": timedelta(seconds=-1)}, "positive duration"),
        # Past what timestamp arithmetic holds: the scanner's timeout and retention passes
        # failed for every run while one such step or run existed.
        ({"timeout": float("inf")}, "positive duration"),
        ({"timeout": float("nan")}, "positive duration"),
        ({"timeout": 1e20}, "positive duration"),
        ({"retention": timedelta(days=999_999_999)}, "positive duration"),
    ],
)
def test_bad_options_are_typed_errors(
    client: Client, options: dict[str, object], fragment: str
) -> None:
    with pytest.raises(InvalidArgument, match=fragment):
        client.enqueue(echo, 1, **options)  # type: ignore[arg-type]
    assert client.list_runs() == []


def test_unknown_names_and_ids(client: Client) -> None:
    with pytest.raises(UnknownWorkflow):
        client.submit("no_such_workflow", 1)
    with pytest.raises(UnknownKind, match="no @step or @action named 'no_such_step'"):
        client.enqueue("no_such_step", 1)
    with pytest.raises(UnknownKind, match="is not a @step or @action"):
        client.enqueue(object(), 1)
    with pytest.raises(UnknownWorkflow, match="is not a @workflow"):
        client.submit(echo, 1)
    with pytest.raises(RunNotFound):
        client.get_run(123456789)
    with pytest.raises(RunNotFound):
        client.cancel(123456789)
    with pytest.raises(RunNotFound):
        client.signal(123456789, "x", 1)
    with pytest.raises(InvalidArgument):
        client.submit(flow, 1, deadline=timedelta(seconds=-1))
    with pytest.raises(ScheduleError):
        client.schedule(flow, "61 * * * *")
    with pytest.raises(ScheduleError):
        client.schedule(flow, "* * * * *", location="Not/AZone")
    assert client.list_runs() == []
    assert client.list_schedules() == []


def test_signal_payload_limits(client: Client) -> None:
    handle = client.submit(flow, 1)
    with pytest.raises(InvalidPayload):
        client.signal(handle.id, "x", float("nan"))
    with pytest.raises(SignalNotDeliverable):
        client.signal(handle.id, "x", 1)


def test_an_oversized_output_fails_the_step_without_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(huge_output, max_output_bytes=1000)
    handle = client.enqueue(huge_output, 5000)
    run = handle.wait(timeout=10)
    row = run.step("bi_huge_output")
    assert row.error_kind == "output_limit"
    assert row.attempt == 1
    assert "over the limit of 1000 bytes" in (row.error or "")


FIFTY_MB = 50 * 1024 * 1024


@step(name="bi_wait_then_echo")
def after_signal(x: object) -> object:
    return x


@workflow(name="bi_signalled")
def signalled(x):  # type: ignore[no-untyped-def]
    return after_signal(wait_signal("data"))


def test_fifty_megabyte_input_and_signal_are_refused_before_any_write(client: Client) -> None:
    """A 50 MB input or signal: PayloadTooLarge naming the limit and the size; no row written."""
    big = "x" * FIFTY_MB
    with pytest.raises(PayloadTooLarge) as caught:
        client.submit(flow, big)
    assert "16777216" in str(caught.value).replace(",", "")
    with pytest.raises(PayloadTooLarge):
        client.enqueue(echo, big)
    assert client.list_runs() == []

    handle = client.submit(signalled, 1)
    with pytest.raises(PayloadTooLarge):
        client.signal(handle.id, "data", big)
    assert client.signals_of(handle.id) == []
    assert client.get_run(handle.id).step("data").state == "waiting_signal"


def test_a_fifty_megabyte_output_fails_the_step_and_the_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A step returning 50 MB fails with output_limit (not retried); its run fails, not hangs."""
    start_worker(huge_output)
    handle = client.enqueue(huge_output, FIFTY_MB)
    run = handle.wait(timeout=60)
    assert run.state == "failed"
    row = run.step("bi_huge_output")
    assert (row.state, row.error_kind, row.attempt) == ("discarded", "output_limit", 1)


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"lease": 0}, "lease"),
        ({"lease": float("nan")}, "lease"),
        ({"lease": "30"}, "lease"),
        ({"lease": 10**400}, "lease"),  # raised OverflowError
        ({"poll_interval": -1}, "poll_interval"),
        ({"poll_interval": float("inf")}, "poll_interval"),
        ({"scan_interval": 0}, "scan_interval"),
        ({"grace": -5}, "grace"),
        ({"grace": float("nan")}, "grace"),
        ({"max_reclaims": -1}, "max_reclaims"),
        ({"max_reclaims": 1.5}, "max_reclaims"),
        ({"max_output_bytes": -1}, "max_output_bytes"),
        ({"batch_size": 0}, "batch_size"),
        # Stored in an int column: the worker's registration failed with a raw error.
        ({"concurrency": 2**31}, "concurrency must be an integer from 1 to 2147483647"),
        ({"max_concurrency": 2**31}, "max_concurrency"),
        ({"max_async": 2**31}, "max_async"),
        # A string is iterable: the worker served queues "c", "r", "i"...
        ({"queues": "critical"}, "list of queue names"),
        ({"queues": [""]}, "queue"),
        ({"queues": [5]}, "queue"),
        ({"queues": ["a\x00b"]}, "queue"),
        ({"queues": ["q" * 257]}, "queue"),
        ({"queues": ["q\ud800"]}, "queue"),  # raised UnicodeEncodeError
        # The name is every lease's owner: a NUL failed every claim.
        ({"name": "a\x00b"}, "name"),
        ({"name": 5}, "name"),
        # A limit on a queue the worker does not serve (a typo) held nothing back.
        ({"queue_limits": {"defualt": 2}}, "does not serve"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else "",
)
def test_bad_worker_options_are_typed_errors(
    cyclone_dsn: str, options: dict[str, object], fragment: str
) -> None:
    """Refused before the worker touches the database: a zero scan interval would have
    hammered it, a negative output limit failed every step, an infinite poll interval
    raised in the fetch thread."""
    with pytest.raises(InvalidArgument, match=fragment):
        Worker(cyclone_dsn, [echo], **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [float("nan"), -1, "5", -(10**400)], ids=repr)
def test_a_bad_wait_timeout_is_a_typed_error(client: Client, timeout: object) -> None:
    """A NaN timeout waited for ever; a string raised a raw TypeError."""
    handle = client.enqueue(echo, 1)  # no worker: the run stays open
    with pytest.raises(InvalidArgument, match="timeout"):
        handle.wait(timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="timeout"):
        handle.result(timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="timeout"):
        next(iter(handle.events(timeout=timeout)))  # type: ignore[arg-type]


def test_a_wait_timeout_past_the_float_range_waits_without_limit(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """An int of 400 digits raised a raw OverflowError; it is as long as infinity."""
    start_worker(echo)
    handle = client.enqueue(echo, 1)
    assert handle.result(timeout=10**400) == 1


@pytest.mark.parametrize("size", [0, -1, 2.5], ids=repr)
def test_a_bad_pool_size_is_a_typed_error(cyclone_dsn: str, size: object) -> None:
    with pytest.raises(InvalidArgument, match="pool_size"):
        Client(cyclone_dsn, pool_size=size)  # type: ignore[arg-type]


@workflow(name="bi_timer")
def long_timer(x):  # type: ignore[no-untyped-def]
    return echo(wait_timer(timedelta(days=999_999_999)))


def test_durations_past_a_thousand_years_are_refused(client: Client, cyclone_dsn: str) -> None:
    """A deadline that far raised the database's DatetimeFieldOverflow."""
    with pytest.raises(InvalidArgument, match="deadline"):
        client.submit(flow, 1, deadline=timedelta(days=999_999_999))
    with pytest.raises(InvalidArgument, match="delay"):
        Debounce(delay=timedelta(days=999_999_999))
    with pytest.raises(InvalidGraph, match="positive duration"):
        client.submit(long_timer, 1)
    with pytest.raises(InvalidArgument, match="lease"):
        Worker(cyclone_dsn, [echo], lease=1e13)
    assert client.list_runs() == []


def test_bad_arguments_of_operations_are_typed_errors(client: Client) -> None:
    """Each raised a raw psycopg error (DataError, UndefinedFunction, InvalidTextRepresentation)
    or a TypeError."""
    handle = client.submit(flow, 1)
    for node in ("a\x00b", 5, ""):
        with pytest.raises(InvalidArgument, match="node"):
            client.retry(handle.id, node)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="workflow"):
        client.list_runs(workflow="a\x00b")
    with pytest.raises(InvalidArgument, match="workflow"):
        client.list_runs(workflow=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="before_id"):
        client.list_runs(before_id="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="older_than"):
        client.purge(older_than=float("nan"))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="older_than"):
        client.count_purgeable(older_than=3600)  # type: ignore[arg-type]
    assert [r.id for r in client.list_runs()] == [handle.id]


#: Strings no text column can store: PostgreSQL refuses a NUL, and a lone surrogate has
#: no UTF-8 at all.
UNSTORABLE = ["a\x00b", "a\ud800"]


def _node_named(name: str) -> Callable[[Client], object]:
    def submit(client: Client) -> object:
        @workflow(name=f"bi_node_{len(name)}_{ord(name[1])}")
        def flow(x):  # type: ignore[no-untyped-def]
            return echo.named(name)(x)

        return client.submit(flow, 1)

    return submit


def _signal_named(name: str) -> Callable[[Client], object]:
    def submit(client: Client) -> object:
        @workflow(name=f"bi_signal_{ord(name[1])}")
        def flow(x):  # type: ignore[no-untyped-def]
            return echo(wait_signal(name))

        return client.submit(flow, 1)

    return submit


UNSTORABLE_CALLS: dict[str, Callable[[str], Callable[[Client], object]]] = {
    "step name": lambda s: lambda c: step(name=s)(lambda x: x),
    "workflow name": lambda s: lambda c: workflow(name=s)(lambda x: echo(x)),
    "node id": _node_named,
    "signal name": _signal_named,
    "retry node": lambda s: lambda c: c.retry(1, s),
    "runs filter": lambda s: lambda c: c.list_runs(workflow=s),
    "worker name": lambda s: lambda c: Worker(c.dsn, [echo], name=s),
}


@pytest.mark.parametrize("text", UNSTORABLE, ids=["nul", "lone surrogate"])
@pytest.mark.parametrize("call", list(UNSTORABLE_CALLS))
def test_names_no_text_column_can_store_are_typed_errors(
    client: Client, call: str, text: str
) -> None:
    """Each was accepted, or raised UnicodeEncodeError or psycopg's DataError, some only at
    a later submit or at the worker's start."""
    with pytest.raises((InvalidArgument, InvalidGraph)):
        UNSTORABLE_CALLS[call](text)(client)
    assert client.list_runs() == []


FLAG_CALLS: dict[str, Callable[[Client], object]] = {
    "cancel_many dry_run": lambda c: c.cancel_many(RunFilter(match_all=True), dry_run="no"),  # type: ignore[arg-type]
    "resume_many dry_run": lambda c: c.resume_many(RunFilter(match_all=True), dry_run="no"),  # type: ignore[arg-type]
    "retry_many dry_run": lambda c: c.retry_many(RunFilter(match_all=True), dry_run="no"),  # type: ignore[arg-type]
    "retry force": lambda c: c.retry(1, "n", force="no"),  # type: ignore[arg-type]
    "fork current_definition": lambda c: c.fork(1, "n", current_definition="no"),  # type: ignore[arg-type]
    "enable_schedule enabled": lambda c: c.enable_schedule("s", enabled="no"),  # type: ignore[arg-type]
    "schedule enabled": lambda c: c.schedule(flow, "* * * * *", enabled="no"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("call", list(FLAG_CALLS))
def test_a_flag_that_is_not_a_bool_is_refused(client: Client, call: str) -> None:
    """A truthy string went for True: force="no" replayed, dry_run="no" acted."""
    with pytest.raises((InvalidArgument, ScheduleError), match="must be True or False"):
        FLAG_CALLS[call](client)


@step(name="bi_typed_work")
def typed_work(x: int) -> int:
    return x


def test_events_of_refuses_a_limit_past_the_bigint_range_with_a_typed_error(
    client: Client, cyclone_dsn: str
) -> None:
    """It reached the database: a raw NumericValueOutOfRange ("bigint out of range")."""
    handle = client.enqueue(typed_work, 1)
    with pytest.raises(InvalidArgument, match="limit"):
        client.events_of(handle.id, limit=2**63)

    async def from_async() -> None:
        async with AsyncClient(cyclone_dsn) as aclient:
            with pytest.raises(InvalidArgument, match="limit"):
                await aclient.events_of(handle.id, limit=2**63)

    asyncio.run(from_async())


def test_purge_refuses_a_batch_size_past_the_bigint_range_with_a_typed_error(
    client: Client, cyclone_dsn: str
) -> None:
    """The same for purge's batch size."""
    with pytest.raises(InvalidArgument, match="batch_size"):
        client.purge(batch_size=2**63)

    async def from_async() -> None:
        async with AsyncClient(cyclone_dsn) as aclient:
            with pytest.raises(InvalidArgument, match="batch_size"):
                await aclient.purge(batch_size=2**63)

    asyncio.run(from_async())


def test_throughput_refuses_a_window_that_is_not_a_timedelta_with_a_typed_error(
    client: Client, cyclone_dsn: str
) -> None:
    """Seconds as a number raised a raw TypeError from the range check."""
    with pytest.raises(InvalidArgument, match="window"):
        client.throughput(window=5)  # type: ignore[arg-type]

    async def from_async() -> None:
        async with AsyncClient(cyclone_dsn) as aclient:
            with pytest.raises(InvalidArgument, match="window"):
                await aclient.throughput(window=5)  # type: ignore[arg-type]

    asyncio.run(from_async())
