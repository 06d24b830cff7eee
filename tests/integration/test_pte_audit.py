"""Audit: user values crossing into the database and back (payload.py, the strict JSON codec).

Every place a user value is written (run inputs of ``submit_many``, ``submit_once``,
``submit_tx``, ``enqueue_many``, schedules and forks; step outputs; signal payloads;
child run inputs; exception messages) either keeps the value as the docs say
(docs/concepts/runs-and-steps.md: JSON, ``-0.0`` comes back as ``0.0``, keys in
jsonb's order) or refuses it with a typed error and writes nothing; a handler's bad
output or message fails its step with a readable error and the worker goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import uuid
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, NamedTuple

import psycopg
import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    InvalidPayload,
    PayloadTooLarge,
    Permanent,
    RunFailed,
    RunState,
    ScheduleError,
    StepContext,
    StepState,
    Worker,
    child,
    schedule,
    step,
    wait_any,
    wait_n,
    workflow,
)

StartWorker = Callable[..., Worker]


# ---------------------------------------------------------------------------- handlers


@step(name="pte_echo")
def echo(x: Any) -> Any:
    return x


@step(name="pte_pair")
def pair(a: Any, b: Any) -> Any:
    return [len(str(a)), len(str(b))]


@workflow(name="pte_flow")
def flow(x):  # type: ignore[no-untyped-def]
    return echo(x)


@workflow(name="pte_pair_flow")
def pair_flow(x):  # type: ignore[no-untyped-def]
    return pair(x, x)


# ---------------------------------------------------------------------------- helpers


def counts(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM cyclone_runs), (SELECT count(*) FROM cyclone_steps)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Point:
    x: int
    y: int


class RaisingRepr:
    def __repr__(self) -> str:
        raise RuntimeError("__repr__ is broken")


NOT_JSON: dict[str, Any] = {
    "nul_in_key": {"a\x00b": 1},
    "surrogate_in_key": {"\ud800": 1},
    "surrogate_in_nested_value": {"a": ["ok", "x\udfff"]},
    "tuple_key": {(1, 2): 1},
    "int_key": {1: "one"},
    "bool_key": {True: "one"},
    "none_key": {None: 1},
    "int_2_63": 2**63,
    "int_below_min": -(2**63) - 1,
    "int_2_1000": 2**1000,
    "minus_inf": float("-inf"),
    "decimal": Decimal("1.5"),
    "datetime": datetime(2026, 1, 1, tzinfo=UTC),
    "uuid": uuid.UUID(int=1),
    "enum": Colour.RED,
    "dataclass": Point(1, 2),
    "frozenset": frozenset({1}),
    "bytearray": bytearray(b"ab"),
    "range": range(3),
    "complex": 1j,
    "raising_repr_value": [RaisingRepr()],
    "raising_repr_key": {RaisingRepr(): 1},
    "deep_1000": deep(1000),
    "deep_10000": deep(10_000),
}
NOT_JSON_IDS = sorted(NOT_JSON)


# ---------------------------------------------------------------------------- run inputs


@pytest.mark.parametrize("which", NOT_JSON_IDS)
def test_bulk_once_and_tx_submits_refuse_a_bad_input_by_its_index_and_write_nothing(
    client: Client, cyclone_dsn: str, which: str
) -> None:
    bad = NOT_JSON[which]
    with pytest.raises(InvalidPayload) as caught:
        client.submit_many(flow, [1, {"ok": [2]}, bad])
    assert caught.value.path.startswith("$[2]"), caught.value.path
    with pytest.raises(InvalidPayload) as caught:
        client.enqueue_many(echo, [None, bad])
    assert caught.value.path.startswith("$[1]"), caught.value.path
    with pytest.raises(InvalidPayload):
        client.submit_once(flow, bad, key=f"pte-{which}")
    with psycopg.connect(cyclone_dsn) as conn:
        with pytest.raises(InvalidPayload):
            client.submit_tx(conn, flow, bad)
        with pytest.raises(InvalidPayload):
            client.submit_once_tx(conn, flow, bad, key=f"pte-tx-{which}")
        conn.execute("SELECT 1")  # the caller's transaction is still usable
        conn.commit()
    assert counts(cyclone_dsn) == (0, 0)
    # The refused submit_once took no key: a good input under the same key makes a run.
    assert client.submit_once(flow, 1, key=f"pte-{which}").created


@pytest.mark.parametrize("which", ["nul_in_key", "int_2_63", "dataclass", "deep_1000"])
def test_the_async_client_refuses_the_same_inputs_and_writes_nothing(
    cyclone_dsn: str, which: str
) -> None:
    bad = NOT_JSON[which]

    async def main() -> None:
        async with AsyncClient(cyclone_dsn) as aclient:
            with pytest.raises(InvalidPayload):
                await aclient.submit(flow, bad)
            with pytest.raises(InvalidPayload):
                await aclient.submit_many(flow, [0, bad])
            with pytest.raises(InvalidPayload):
                await aclient.submit_once(flow, bad, key="k")
            with pytest.raises(InvalidPayload):
                await aclient.enqueue(echo, bad)

    asyncio.run(main())
    assert counts(cyclone_dsn) == (0, 0)


# ---------------------------------------------------------------------------- step outputs


@step(name="pte_bad_output", max_attempts=3)
def bad_output(which: str) -> Any:
    return NOT_JSON[which]


@step(name="pte_bad_output_async", max_attempts=3)
async def bad_output_async(which: str) -> Any:
    await asyncio.sleep(0)
    return NOT_JSON[which]


@step(name="pte_bad_output_tx", max_attempts=3, transactional=True)
def bad_output_tx(which: str, *, ctx: StepContext) -> Any:
    ctx.connection.execute("CREATE TABLE pte_written (x int)")
    return NOT_JSON[which]


@step(name="pte_ok")
def ok(x: int) -> int:
    return x + 1


OUTPUT_CASES = [
    "nul_in_key",
    "surrogate_in_key",
    "surrogate_in_nested_value",
    "tuple_key",
    "int_2_1000",
    "decimal",
    "enum",
    "raising_repr_key",
]


@pytest.mark.parametrize("which", OUTPUT_CASES)
def test_a_bad_output_fails_its_step_for_good_with_a_readable_error_and_the_worker_goes_on(
    client: Client, cyclone_dsn: str, start_worker: StartWorker, which: str
) -> None:
    """runs-and-steps.md: an output that is not JSON fails the step for good with
    invalid_output. The error names the JSON path, which may hold the very key the
    database cannot store (a NUL, a lone surrogate): the step must still end."""
    start_worker(bad_output, bad_output_async, bad_output_tx, ok)
    for handler in (bad_output, bad_output_async, bad_output_tx):
        handle = client.enqueue(handler, which)
        with pytest.raises(RunFailed):
            handle.result(timeout=10)
        row = handle.get().steps[0]
        assert (row.state, row.error_kind, row.attempt) == (
            StepState.DISCARDED,
            "invalid_output",
            1,
        ), (handler.name, row.error)
        assert row.error is not None
        row.error.encode("utf-8")
        assert "\x00" not in row.error
        # The reason names the offending value, as InvalidPayload does (not a raw database
        # message about a parameter).
        assert row.error.startswith("the handler returned a value that is not JSON"), row.error
    assert client.enqueue(ok, 1).result(timeout=20) == 2
    with psycopg.connect(cyclone_dsn) as conn:  # the transactional step's write rolled back
        found = conn.execute("SELECT to_regclass('pte_written')").fetchone()
    assert found == (None,)


# ---------------------------------------------------------------------------- schedules, forks


@pytest.mark.parametrize("which", ["nul_in_key", "surrogate_in_key", "int_2_63", "deep_1000"])
def test_a_schedule_of_a_bad_input_is_refused_and_nothing_is_written(
    client: Client, which: str
) -> None:
    with pytest.raises((InvalidPayload, ScheduleError)):
        client.schedule(flow, "0 * * * *", id=f"pte-{which}", input=NOT_JSON[which])
    with pytest.raises((InvalidPayload, ScheduleError)):
        schedule("0 * * * *", id=f"pte-deco-{which}", input=NOT_JSON[which])
    assert client.list_schedules() == []


NINE_MB = 9 * 1024 * 1024


def test_an_input_that_makes_a_step_input_too_large_is_refused_at_every_entry(
    client: Client, cyclone_dsn: str, start_worker: StartWorker
) -> None:
    """pte_pair(x, x) doubles the run input into its step input: 9 MiB in, 18 MiB to the step.
    Every way in refuses it before a write (submit, submit_many, submit_once, schedule, fork)."""
    big = "x" * NINE_MB
    with pytest.raises(PayloadTooLarge):
        client.submit(pair_flow, big)
    with pytest.raises(PayloadTooLarge):
        client.submit_many(pair_flow, [1, big])
    with pytest.raises(PayloadTooLarge):
        client.submit_once(pair_flow, big, key="pte-big")
    with pytest.raises(PayloadTooLarge):
        client.schedule(pair_flow, "0 * * * *", id="pte-big", input=big)
    assert counts(cyclone_dsn) == (0, 0)
    assert client.list_schedules() == []
    start_worker(pair_flow)
    source = client.submit(pair_flow, "small")
    assert source.result(timeout=20) == [5, 5]
    with pytest.raises(PayloadTooLarge):
        client.fork(source.id, "pte_pair", input=big)
    for which in ("nul_in_key", "int_2_63", "dataclass"):
        with pytest.raises(InvalidPayload):
            client.fork(source.id, "pte_pair", input=NOT_JSON[which])
    assert counts(cyclone_dsn) == (1, 1)


# ---------------------------------------------------------------------- values built at run time


@step(name="pte_big")
def big(n: int) -> str:
    return "x" * n


@workflow(name="pte_child_pair")
def child_pair(x):  # type: ignore[no-untyped-def]
    return pair(x, x)


@workflow(name="pte_parent_of_big")
def parent_of_big(n):  # type: ignore[no-untyped-def]
    return child(child_pair, big(n))


@workflow(name="pte_pair_of_outputs")
def pair_of_outputs(n):  # type: ignore[no-untyped-def]
    return pair(big(n), big(n).named("pte_big_b"))


def test_a_child_whose_input_cannot_start_it_fails_its_node_and_the_run_ends(
    client: Client, start_worker: StartWorker
) -> None:
    """A child run whose compiled graph would hold an 18 MiB step input cannot start: its
    node fails (child_failed, fan-out-and-children.md) and the run ends; no hang."""
    start_worker(parent_of_big, child_pair, ok)
    handle = client.submit(parent_of_big, NINE_MB)
    run = handle.wait(timeout=30)
    assert run.state is RunState.FAILED
    node = next(s for s in run.steps if s.state is StepState.DISCARDED)
    assert node.error_kind == "child_failed", node.error
    assert "bytes" in (node.error or "")
    assert client.enqueue(ok, 1).result(timeout=20) == 2


def test_a_step_input_joined_from_two_large_outputs_runs_or_fails_but_ends(
    client: Client, start_worker: StartWorker
) -> None:
    """pte_pair's input is joined at run time from two 9 MiB outputs (18 MiB): the run
    must end (completed, or failed with a typed error), never stay running."""
    start_worker(pair_of_outputs)
    run = client.submit(pair_of_outputs, NINE_MB).wait(timeout=60)
    assert run.state in (RunState.COMPLETED, RunState.FAILED)
    if run.state is RunState.COMPLETED:
        assert run.step("pte_pair").output == [NINE_MB, NINE_MB]


# ---------------------------------------------------------------------------- error messages

HOSTILE_MESSAGE = "bad \x00 nul, \ud800 surrogate " + "y" * 3_000_000 + "\nsecond line"


@step(name="pte_raise_permanent", max_attempts=3)
def raise_permanent(x: int) -> int:
    raise Permanent(HOSTILE_MESSAGE)


@step(name="pte_raise_value_error", max_attempts=2)
def raise_value_error(x: int) -> int:
    raise ValueError(HOSTILE_MESSAGE)


@step(name="pte_raise_async", max_attempts=2)
async def raise_async(x: int) -> int:
    await asyncio.sleep(0)
    raise KeyError(HOSTILE_MESSAGE)


@pytest.mark.parametrize(
    ("handler", "attempts", "kind"),
    [
        (raise_permanent, 1, "permanent"),
        (raise_value_error, 2, "error"),
        (raise_async, 2, "error"),
    ],
    ids=["permanent", "value_error", "async_key_error"],
)
def test_an_exception_with_nul_surrogate_and_megabytes_fails_with_a_bounded_readable_error(
    client: Client, start_worker: StartWorker, handler: Any, attempts: int, kind: str
) -> None:
    start_worker(handler, ok)
    handle = client.enqueue(handler, 1)
    with pytest.raises(RunFailed) as caught:
        handle.result(timeout=20)
    str(caught.value).encode("utf-8")
    row = handle.get().steps[0]
    assert (row.state, row.error_kind, row.attempt) == (StepState.DISCARDED, kind, attempts)
    assert row.error is not None and row.panic_stack is not None
    assert "bad " in row.error and len(row.error) <= 2000, len(row.error)
    assert len(row.panic_stack) <= 64 * 1024
    for text in (row.error, row.panic_stack, *(a.error or "" for a in row.attempts)):
        text.encode("utf-8")
        assert "\x00" not in text
    assert len(row.attempts) == attempts
    assert client.enqueue(ok, 1).result(timeout=20) == 2


# ---------------------------------------------------------------------------- JSON look-alikes


class Level(enum.IntEnum):
    HIGH = 3


class Mood(enum.StrEnum):
    GOOD = "good"


class Pt(NamedTuple):
    x: int
    y: int


@step(name="pte_types")
def types_of(x: Any) -> Any:
    return {k: [type(v).__name__, v] for k, v in x.items()}


def test_json_look_alikes_reach_the_next_step_as_plain_json(
    client: Client, start_worker: StartWorker
) -> None:
    """An IntEnum, a str Enum, a named tuple, an OrderedDict pass as JSON: the handler gets
    the plain value (int, str, list, dict), as JSON keeps them."""
    start_worker(types_of)
    value: Any = {
        "level": Level.HIGH,
        "mood": Mood.GOOD,
        "point": Pt(1, 2),
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
        "zero": -0.0,
        "flag": True,
    }
    got = client.enqueue(types_of, value).result(timeout=20)
    assert got == {
        "level": ["int", 3],
        "mood": ["str", "good"],
        "point": ["list", [1, 2]],
        "ordered": ["dict", {"a": 2, "b": 1}],
        "zero": ["float", 0.0],
        "flag": ["bool", True],
    }


# (The check's cost in memory: tests/faults/test_bad_input.py.)


# ---------------------------------------------------------------------------- signals into quorums


@workflow(name="pte_quorum")
def quorum(x):  # type: ignore[no-untyped-def]
    votes = wait_n("pte_vote", 3)
    first = wait_any(["pte_yes", "pte_no"])
    return pair(votes, first)


def test_quorum_and_any_waits_keep_payloads_as_json_and_refuse_bad_ones_whole(
    client: Client,
) -> None:
    """wait_n stores a partial quorum and reads it back before the next signal: numbers come
    back as documented (a big float stays a float, -0.0 as 0.0); a refused payload stores
    nothing and the waits still wait."""
    handle = client.submit(quorum, None)
    client.signal(handle.id, "pte_vote", 1e20)
    for which in ("nul_in_key", "surrogate_in_key", "int_2_63", "tuple_key"):
        with pytest.raises(InvalidPayload):
            client.signal(handle.id, "pte_vote", NOT_JSON[which])
        with pytest.raises(InvalidPayload):
            client.signal(handle.id, "pte_no", NOT_JSON[which])
    client.signal(handle.id, "pte_vote", {"k": -0.0, "big": 2**63 - 1})
    client.signal(handle.id, "pte_vote", ["é", None])
    client.signal(handle.id, "pte_no", {"why": "\u2028"})
    run = handle.get()
    votes = run.step("pte_vote").output
    assert votes == [1e20, {"k": 0.0, "big": 2**63 - 1}, ["é", None]]
    assert isinstance(votes[0], float)
    assert run.step("any_pte_yes_pte_no").output == {"name": "pte_no", "payload": {"why": "\u2028"}}
    assert len(client.signals_of(handle.id)) == 4
