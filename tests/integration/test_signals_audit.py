"""Audit of signals and waits: mailbox capacity, payloads, names, races, children, timers."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner

from cyclone_dsl import (
    AlreadyTerminal,
    AsyncClient,
    Client,
    Delivery,
    InvalidArgument,
    InvalidGraph,
    InvalidPayload,
    MailboxFull,
    PayloadTooLarge,
    RunFailed,
    RunNotFound,
    RunState,
    SignalNotDeliverable,
    StepState,
    Worker,
    child,
    for_each,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.cli.main import cli
from tests.waiting import seconds_until, wait_until

gate = threading.Event()


@step(name="sa_echo")
def sa_echo(value: object) -> object:
    return value


@step(name="sa_gate")
def sa_gate(value: object) -> object:
    gate.wait(10)
    return value


@step(name="sa_pair")
def sa_pair(a: object, b: object) -> object:
    return [a, b]


@step(name="sa_items")
def sa_items(n: int) -> list[int]:
    return list(range(n))


# -- build-time refusals ------------------------------------------------------------------------


_names = itertools.count()


def _build(fn: Callable[[Any], Any], name: str) -> None:
    workflow(name=name)(fn).graph  # noqa: B018 - building the graph is the point


@pytest.mark.parametrize(
    "length",
    [
        0,
        -1,
        -0.0,
        timedelta(0),
        timedelta(seconds=-5),
        timedelta(days=365_001),
        float("nan"),
        1e300,
        True,
        "5",
    ],
    ids=[
        "zero",
        "negative",
        "neg_zero",
        "td_zero",
        "td_negative",
        "huge",
        "nan",
        "overflow",
        "bool",
        "str",
    ],
)
def test_timer_of_a_bad_duration_is_refused_at_build(length: Any) -> None:
    def body(x: Any) -> Any:
        return sa_echo(x, after=[wait_timer(length)])

    with pytest.raises(InvalidGraph):
        _build(body, f"sa_bad_timer_{next(_names)}")


def test_a_timer_without_a_duration_is_refused_at_build() -> None:
    def body(x: Any) -> Any:
        return sa_echo(x, after=[wait_timer(None)])  # type: ignore[arg-type]

    with pytest.raises(InvalidGraph):
        _build(body, "sa_timer_none")


@pytest.mark.parametrize("timeout", [0, -0.5, timedelta(days=365_001), float("inf")])
def test_signal_timeout_of_a_bad_duration_is_refused_at_build(timeout: Any) -> None:
    def body(x: Any) -> Any:
        return sa_echo(wait_signal("sa_bt", timeout=timeout))

    with pytest.raises(InvalidGraph):
        _build(body, f"sa_bad_timeout_{next(_names)}")


@pytest.mark.parametrize(
    "make",
    [
        lambda: wait_signal(""),
        lambda: wait_signal("x" * 1025),
        lambda: wait_signal("\u00e9" * 513),  # 1,026 bytes of UTF-8
        lambda: wait_signal(7),  # type: ignore[arg-type]
        lambda: wait_n("sa_n0", 0),
        lambda: wait_n("sa_nneg", -2),
        lambda: wait_n("sa_nbool", True),
        lambda: wait_n("sa_nfloat", 2.0),  # type: ignore[arg-type]
        lambda: wait_any([]),
        lambda: wait_any("sa_str"),
        lambda: wait_any(["sa_dup", "sa_dup"]),
        lambda: wait_any(["sa_ok", ""]),
    ],
    ids=[
        "empty",
        "long",
        "long_utf8",
        "not_str",
        "n_zero",
        "n_negative",
        "n_bool",
        "n_float",
        "any_empty",
        "any_str",
        "any_dup",
        "any_empty_name",
    ],
)
def test_bad_waits_are_refused_at_build(make: Callable[[], Any]) -> None:
    def body(x: Any) -> Any:
        return sa_echo(make())

    with pytest.raises(InvalidGraph):
        _build(body, f"sa_bad_wait_{next(_names)}")


@pytest.mark.parametrize(
    "pair",
    [
        lambda: (wait_signal("sa_same"), wait_signal("sa_same").named("sa_same_2")),
        lambda: (wait_signal("sa_same"), wait_n("sa_same", 2)),
        lambda: (wait_signal("sa_same"), wait_any(["sa_other", "sa_same"])),
        lambda: (wait_any(["sa_same", "sa_x"]), wait_any(["sa_y", "sa_same"])),
    ],
    ids=["signal_signal", "signal_n", "signal_any", "any_any"],
)
def test_one_signal_name_awaited_twice_is_refused_at_build(pair: Callable[[], Any]) -> None:
    def body(x: Any) -> Any:
        a, b = pair()
        return sa_pair(a, b)

    with pytest.raises(InvalidGraph) as refused:
        _build(body, f"sa_twice_{next(_names)}")
    assert any("sa_same" in p for p in refused.value.problems)


def test_a_name_of_exactly_1024_utf8_bytes_works_end_to_end(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    name = "\u00e9" * 512  # 1,024 bytes

    @workflow(name="sa_long_name")
    def long_name(x):  # type: ignore[no-untyped-def]
        return sa_echo(wait_signal(name).named("sa_long"))

    start_worker(sa_echo)
    handle = client.submit(long_name, 0)
    with pytest.raises(InvalidArgument):
        client.signal(handle.id, name + "e", 1)
    assert client.signal(handle.id, name, "ok") is Delivery.CONSUMED
    assert handle.result(timeout=10) == "ok"


# -- client.signal argument checks --------------------------------------------------------------


@workflow(name="sa_one")
def sa_one(x):  # type: ignore[no-untyped-def]
    return sa_echo(wait_signal("sa_one_sig"))


class _NotJson:
    pass


@pytest.mark.parametrize(
    "payload",
    [
        float("nan"),
        float("inf"),
        {1: "int key"},
        {"a": {2, 3}},
        _NotJson(),
        2**64,
        b"bytes",
        ["ok", {"deep": float("-inf")}],
        json.loads("[" * 300 + "]" * 300),
    ],
    ids=["nan", "inf", "int_key", "set", "object", "bigint", "bytes", "nested_inf", "too_deep"],
)
def test_a_payload_that_is_not_json_is_refused_and_nothing_stored(
    client: Client, payload: object
) -> None:
    handle = client.submit(sa_one, 0)
    with pytest.raises(InvalidPayload):
        client.signal(handle.id, "sa_one_sig", payload)  # type: ignore[arg-type]
    assert client.signals_of(handle.id) == []
    assert handle.get().step("sa_one_sig").state is StepState.WAITING_SIGNAL
    assert client.signal(handle.id, "sa_one_sig", "after") is Delivery.CONSUMED


def test_a_payload_over_the_limit_is_refused_and_nothing_stored(client: Client) -> None:
    handle = client.submit(sa_one, 0)
    with pytest.raises(PayloadTooLarge):
        client.signal(handle.id, "sa_one_sig", "x" * (16 * 1024 * 1024 + 1))
    assert client.signals_of(handle.id) == []
    assert handle.get().step("sa_one_sig").state is StepState.WAITING_SIGNAL


@pytest.mark.parametrize(
    "name",
    ["", "x" * 1025, "\u00e9" * 513, 5, None],
    ids=["empty", "long", "long_utf8", "int", "none"],
)
def test_a_bad_signal_name_is_refused_with_invalid_argument(client: Client, name: Any) -> None:
    handle = client.submit(sa_one, 0)
    with pytest.raises(InvalidArgument):
        client.signal(handle.id, name, 1)
    assert client.signals_of(handle.id) == []


def test_odd_but_valid_names_are_not_deliverable_when_no_wait_declares_them(
    client: Client,
) -> None:
    handle = client.submit(sa_one, 0)
    for name in (" ", "sa_one_sig ", "SA_ONE_SIG", "sa_one_sig\n", "\u202e", "%", "*"):
        with pytest.raises(SignalNotDeliverable):
            client.signal(handle.id, name, 1)
    assert client.signals_of(handle.id) == []


@pytest.mark.parametrize(
    "payload",
    [
        None,
        0,
        False,
        "",
        [],
        {},
        -(2**63),
        2**63 - 1,
        1.5,
        "caf\u00e9 \u65e5\u672c \U0001f680 \u202eRTL \u2028",
        {"a": [1, {"b": [None, True, {"c": "d"}]}], "\u00fc": "\u00df"},
        [[[[[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]]]],
        json.loads("[" * 255 + "]" * 255),
        {"big": "y" * 2_000_000},
    ],
    ids=[
        "none",
        "zero",
        "false",
        "empty_str",
        "empty_list",
        "empty_dict",
        "min_int",
        "max_int",
        "float",
        "unicode",
        "nested",
        "deep",
        "deepest",
        "large",
    ],
)
def test_payloads_round_trip_exactly(client: Client, payload: object) -> None:
    handle = client.submit(sa_one, 0)
    assert client.signal(handle.id, "sa_one_sig", payload) is Delivery.CONSUMED  # type: ignore[arg-type]
    wait = handle.get().step("sa_one_sig")
    assert wait.state is StepState.COMPLETED
    assert wait.output == payload
    assert type(wait.output) is type(payload)
    (row,) = client.signals_of(handle.id)
    assert row["payload"] == payload


# -- the mailbox -------------------------------------------------------------------------------


@workflow(name="sa_any_later")
def sa_any_later(x):  # type: ignore[no-untyped-def]
    first = sa_gate(x)
    return sa_echo(wait_any(["sa_al_yes", "sa_al_no"], after=[first]))


def test_wait_any_buffers_one_across_its_names_and_outputs_the_first(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    gate.clear()
    start_worker(sa_echo, sa_gate)
    handle = client.submit(sa_any_later, 0)
    assert client.signal(handle.id, "sa_al_no", {"n": 1}) is Delivery.BUFFERED
    with pytest.raises(MailboxFull) as full:
        client.signal(handle.id, "sa_al_yes", 2)
    assert full.value.capacity == 1
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "sa_al_no", 3)
    gate.set()
    assert handle.result(timeout=10) == {"name": "sa_al_no", "payload": {"n": 1}}
    rows = client.signals_of(handle.id)
    assert [(r["name"], r["payload"], r["consumed_by"]) for r in rows] == [
        ("sa_al_no", {"n": 1}, "any_sa_al_yes_sa_al_no")
    ]


@workflow(name="sa_n_now")
def sa_n_now(x):  # type: ignore[no-untyped-def]
    return sa_echo(wait_n("sa_n_now_sig", 3))


def test_concurrent_senders_to_a_waiting_wait_n_consume_exactly_n(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sa_echo)
    handle = client.submit(sa_n_now, 0)
    outcomes: list[object] = []
    lock = threading.Lock()
    barrier = threading.Barrier(12)

    def send(i: int) -> None:
        barrier.wait()
        try:
            got: object = client.signal(handle.id, "sa_n_now_sig", i)
        except Exception as exc:  # recorded and asserted on
            got = type(exc).__name__
        with lock:
            outcomes.append((i, got))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    consumed = [i for i, got in outcomes if got is Delivery.CONSUMED]
    others = {got for _, got in outcomes if got is not Delivery.CONSUMED}
    assert len(consumed) == 3, outcomes
    assert others <= {Delivery.NOT_STORED, "AlreadyTerminal"}, outcomes
    result = handle.result(timeout=10)
    assert sorted(result) == sorted(consumed)
    rows = client.signals_of(handle.id)
    assert [r["payload"] for r in rows] == result
    assert all(r["consumed_by"] == "sa_n_now_sig" for r in rows)


@workflow(name="sa_n_later")
def sa_n_later(x):  # type: ignore[no-untyped-def]
    first = sa_gate(x)
    return sa_echo(wait_n("sa_n_later_sig", 3, after=[first]))


def test_concurrent_senders_before_activation_buffer_exactly_n(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    gate.clear()
    start_worker(sa_echo, sa_gate)
    handle = client.submit(sa_n_later, 0)
    outcomes: list[object] = []
    lock = threading.Lock()
    barrier = threading.Barrier(10)

    def send(i: int) -> None:
        barrier.wait()
        try:
            got: object = client.signal(handle.id, "sa_n_later_sig", i)
        except MailboxFull:
            got = "full"
        with lock:
            outcomes.append((i, got))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    buffered = [i for i, got in outcomes if got is Delivery.BUFFERED]
    assert len(buffered) == 3, outcomes
    assert sum(1 for _, got in outcomes if got == "full") == 7, outcomes
    stored = client.signals_of(handle.id)
    assert len(stored) == 3 and all(r["consumed_by"] is None for r in stored)
    gate.set()
    assert handle.result(timeout=10) == [r["payload"] for r in stored]


@workflow(name="sa_when_skipped")
def sa_when_skipped(x):  # type: ignore[no-untyped-def]
    first = sa_echo(x)
    return wait_signal("sa_ws_sig", after=[first], when=first.gt(10))


def test_a_signal_for_a_skipped_wait_is_not_stored(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sa_echo)
    handle = client.submit(sa_when_skipped, 1)
    assert handle.result(timeout=10) is None
    assert handle.get().step("sa_ws_sig").state is StepState.SKIPPED
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "sa_ws_sig", 1)
    assert client.signals_of(handle.id) == []


@workflow(name="sa_paused")
def sa_paused(x):  # type: ignore[no-untyped-def]
    return sa_echo(wait_signal("sa_paused_sig"))


def test_a_signal_to_a_waiting_wait_of_a_paused_run_is_consumed_and_downstream_waits(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sa_echo)
    handle = client.submit(sa_paused, 0)
    client.pause(handle.id)
    assert client.signal(handle.id, "sa_paused_sig", "p") is Delivery.CONSUMED
    run = handle.get()
    assert run.state is RunState.PAUSED
    assert run.step("sa_echo").state is StepState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=10) == "p"


# -- signal vs timeout -------------------------------------------------------------------------


@workflow(name="sa_race")
def sa_race(x):  # type: ignore[no-untyped-def]
    got = wait_signal("sa_race_sig", timeout=timedelta(seconds=1))
    sa_echo(got, on_dep_failure="cancel_branch")
    return sa_echo(x)


def test_a_signal_racing_its_timeout_has_exactly_one_outcome(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Signals sent around the wait's deadline, by the database clock: the first well before
    it (it must win), the last well after it (it must lose), the others in the race."""
    start_worker(sa_echo, scan_interval=0.02)
    seen: set[StepState] = set()
    for offset in (-0.8, -0.06, -0.02, 0.0, 0.01, 0.03, 0.08, 0.2):
        handle = client.submit(sa_race, 0)
        deadline = handle.get().step("sa_race_sig").scheduled_at
        assert deadline is not None
        delay = max(0.0, seconds_until(cyclone_dsn, deadline) + offset)
        outcomes: list[object] = []
        lock = threading.Lock()

        def send(
            handle_id: int = handle.id,
            delay: float = delay,
            lock: threading.Lock = lock,
            outcomes: list[object] = outcomes,
        ) -> None:
            time.sleep(delay)
            while True:
                try:
                    got: object = client.signal(handle_id, "sa_race_sig", "s")
                except AlreadyTerminal:
                    got = "terminal"
                with lock:
                    outcomes.append(got)
                if got == "terminal":  # the run ended: nothing more can change
                    return

        threads = [threading.Thread(target=send) for _ in range(4)]
        for t in threads:
            t.start()
        run = handle.wait(timeout=10)
        for t in threads:
            t.join(10)
        wait = run.step("sa_race_sig")
        seen.add(wait.state)
        consumed = [o for o in outcomes if o is Delivery.CONSUMED]
        rows = client.signals_of(handle.id)
        assert set(outcomes) <= {Delivery.CONSUMED, Delivery.NOT_STORED, "terminal"}, outcomes
        if wait.state is StepState.COMPLETED:
            assert len(consumed) == 1 and wait.error_kind is None, outcomes
            assert [r["consumed_by"] for r in rows] == ["sa_race_sig"]
            assert run.step("sa_echo").output == "s"
        else:
            assert wait.state is StepState.DISCARDED and wait.error_kind == "signal_timeout"
            assert consumed == [] and rows == [], outcomes
        assert run.state is RunState.COMPLETED
    assert seen == {StepState.COMPLETED, StepState.DISCARDED}


def test_a_signal_sent_after_the_timeout_but_before_the_scanner_loses_to_the_timeout(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """A wait whose timeout passed but which no scanner has failed yet does not take a
    signal: the timeout came first (docs/concepts/waits.md). The signal is not stored, and
    the call fails the wait there and then: one outcome, the timeout."""
    handle = client.submit(sa_race, 5)
    wait_until(lambda: handle.get().step("sa_race_sig").scheduled_at is not None, what="the wait")
    deadline = handle.get().step("sa_race_sig").scheduled_at
    assert deadline is not None
    time.sleep(seconds_until(cyclone_dsn, deadline) + 0.1)
    assert client.signal(handle.id, "sa_race_sig", "late") is Delivery.NOT_STORED
    assert handle.get().step("sa_race_sig").error_kind == "signal_timeout"  # no worker yet
    start_worker(sa_echo)
    run = handle.wait(timeout=10)
    assert run.step("sa_race_sig").state is StepState.DISCARDED
    assert client.signals_of(handle.id) == []


@workflow(name="sa_n_timeout")
def sa_n_timeout(x):  # type: ignore[no-untyped-def]
    got = wait_n("sa_nt_sig", 3, timeout=timedelta(hours=1))
    return sa_echo(got, on_dep_failure="cancel_branch")


def test_a_partial_quorum_times_out_and_later_signals_are_not_stored(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(sa_echo)
    handle = client.submit(sa_n_timeout, 0)
    assert client.signal(handle.id, "sa_nt_sig", "a") is Delivery.CONSUMED
    clock(datetime.now(UTC) + timedelta(hours=2))  # past the hour-long timeout
    run = handle.wait(timeout=10)
    wait = run.step("sa_nt_sig")
    assert wait.state is StepState.DISCARDED and wait.error_kind == "signal_timeout"
    assert run.step("sa_echo").state is StepState.CANCELLED
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "sa_nt_sig", "b")
    assert [r["payload"] for r in client.signals_of(handle.id)] == ["a"]


# -- child runs --------------------------------------------------------------------------------


@workflow(name="sa_kid")
def sa_kid(x):  # type: ignore[no-untyped-def]
    return sa_echo(wait_signal("sa_kid_sig"))


@workflow(name="sa_fan_kids")
def sa_fan_kids(n):  # type: ignore[no-untyped-def]
    return for_each(sa_kid, over=sa_items(n))


def test_waits_in_fan_out_child_runs_take_signals_sent_to_each_child(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sa_echo, sa_items, sa_fan_kids, sa_kid)
    handle = client.submit(sa_fan_kids, 3)
    kids = wait_until(
        lambda: (k := client.children_of(handle.id)) and len(k) == 3 and k, what="3 child runs"
    )
    with pytest.raises(SignalNotDeliverable):
        client.signal(handle.id, "sa_kid_sig", "to the parent")
    by_node = {k["parent_node_id"]: k["id"] for k in kids}
    for i in (2, 0, 1):
        kid = by_node[f"sa_kid[{i}]"]
        wait_until(
            lambda kid=kid: (
                client.get_run(kid).step("sa_kid_sig").state is StepState.WAITING_SIGNAL
            ),
            what="the child's wait",
        )
        assert client.signal(kid, "sa_kid_sig", f"item {i}") is Delivery.CONSUMED
    assert handle.result(timeout=10) == ["item 0", "item 1", "item 2"]
    for node, kid in by_node.items():
        rows = client.signals_of(kid)
        assert [(r["payload"], r["consumed_by"]) for r in rows] == [
            (f"item {node[-2]}", "sa_kid_sig")
        ]
    assert client.signals_of(handle.id) == []


@workflow(name="sa_parent_same_name")
def sa_parent_same_name(x):  # type: ignore[no-untyped-def]
    mine = wait_signal("sa_kid_sig").named("sa_mine")
    theirs = child(sa_kid, x)
    return sa_pair(mine, theirs)


def test_a_parent_and_its_child_awaiting_the_same_name_each_get_their_own(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sa_echo, sa_pair, sa_kid, sa_parent_same_name)
    handle = client.submit(sa_parent_same_name, 0)
    (kid,) = wait_until(lambda: client.children_of(handle.id), what="the child run")
    assert client.signal(handle.id, "sa_kid_sig", "parent") is Delivery.CONSUMED
    assert client.get_run(kid["id"]).step("sa_kid_sig").state is StepState.WAITING_SIGNAL
    assert client.signal(kid["id"], "sa_kid_sig", "child") is Delivery.CONSUMED
    assert handle.result(timeout=10) == ["parent", "child"]


@workflow(name="sa_parent_of_kid")
def sa_parent_of_kid(x):  # type: ignore[no-untyped-def]
    return child(sa_kid, x)


def test_a_signal_to_the_child_of_a_cancelled_parent_is_refused(client: Client) -> None:
    handle = client.submit(sa_parent_of_kid, 0)
    (kid,) = wait_until(lambda: client.children_of(handle.id), what="the child run")
    client.cancel(handle.id)
    with pytest.raises(AlreadyTerminal):
        client.signal(kid["id"], "sa_kid_sig", 1)
    assert client.signals_of(kid["id"]) == []


@workflow(name="sa_kid_result")
def sa_kid_result(x):  # type: ignore[no-untyped-def]
    return wait_signal("sa_kr_sig")


@workflow(name="sa_parent_deadline")
def sa_parent_deadline(x):  # type: ignore[no-untyped-def]
    return child(sa_kid_result, x)


def test_a_signal_to_the_child_of_a_parent_past_its_deadline_is_refused(
    client: Client,
) -> None:
    handle = client.submit(sa_parent_deadline, 0, deadline=timedelta(seconds=0.3))
    (kid,) = wait_until(lambda: client.children_of(handle.id), what="the child run")
    time.sleep(0.5)  # no worker, so no scanner: the deadline passed and nobody failed the run
    refused = False
    try:
        client.signal(kid["id"], "sa_kr_sig", "late")
    except AlreadyTerminal:
        refused = True
    run = client.get_run(handle.id)
    assert (run.state, refused) == (RunState.FAILED, True)
    assert client.signals_of(kid["id"]) == []
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=5)
    assert failed.value.error_kind == "deadline"


# -- timers --------------------------------------------------------------------------------------


@workflow(name="sa_timer_and_signal")
def sa_timer_and_signal(x):  # type: ignore[no-untyped-def]
    t = wait_timer(timedelta(hours=1)).named("sa_tas_timer")
    s = wait_signal("sa_tas_sig")
    return sa_pair(t, s)


def test_a_timer_and_a_signal_in_parallel_branches_join(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(sa_pair)
    handle = client.submit(sa_timer_and_signal, 0)
    assert client.signal(handle.id, "sa_tas_sig", {"v": 1}) is Delivery.CONSUMED
    assert handle.get().step("sa_pair").state is StepState.PENDING
    clock(datetime.now(UTC) + timedelta(hours=2))  # past the hour-long timer: it fires
    assert handle.result(timeout=10) == [None, {"v": 1}]
    run = handle.get()
    joined, timer = run.step("sa_pair"), run.step("sa_tas_timer")
    assert joined.started_at is not None and joined.started_at >= timer.scheduled_at
    # and the other way round: the timer first, the signal later
    handle = client.submit(sa_timer_and_signal, 1)
    wait_until(
        lambda: handle.get().step("sa_tas_timer").state is StepState.WAITING_TIMER,
        what="the timer to wait",
    )
    clock(datetime.now(UTC) + timedelta(hours=4))  # past this run's timer, an hour after the last
    wait_until(
        lambda: handle.get().step("sa_tas_timer").state is StepState.COMPLETED, what="the timer"
    )
    assert handle.get().state is RunState.RUNNING
    assert client.signal(handle.id, "sa_tas_sig", "late") is Delivery.CONSUMED
    assert handle.result(timeout=10) == [None, "late"]


@workflow(name="sa_tiny_timer")
def sa_tiny_timer(x):  # type: ignore[no-untyped-def]
    return sa_echo(x, after=[wait_timer(timedelta(microseconds=1))])


@workflow(name="sa_huge_timer")
def sa_huge_timer(x):  # type: ignore[no-untyped-def]
    return sa_echo(x, after=[wait_timer(timedelta(days=365_000))])


def test_the_shortest_and_longest_timers_are_accepted(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sa_echo)
    assert client.submit(sa_tiny_timer, 3).result(timeout=10) == 3
    handle = client.submit(sa_huge_timer, 4)
    timer = handle.get().step("timer")
    assert timer.state is StepState.WAITING_TIMER
    assert timer.scheduled_at is not None and timer.scheduled_at.year > 3000
    client.cancel(handle.id)
    assert handle.get().state is RunState.CANCELLED


# -- what signals_of reports, and the other ways in ------------------------------------------


@workflow(name="sa_report")
def sa_report(x):  # type: ignore[no-untyped-def]
    first = sa_gate(x)
    a = wait_signal("sa_rep_a")
    b = wait_n("sa_rep_b", 2, after=[first])
    return sa_pair(a, b)


def test_signals_of_reports_the_mailbox_in_delivery_order(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    gate.clear()
    start_worker(sa_gate, sa_pair)
    handle = client.submit(sa_report, 0)
    assert client.signals_of(handle.id) == []
    with pytest.raises(RunNotFound):
        client.signals_of(10**12)
    assert client.signal(handle.id, "sa_rep_b", "b1") is Delivery.BUFFERED
    assert client.signal(handle.id, "sa_rep_a", "a1") is Delivery.CONSUMED
    assert client.signal(handle.id, "sa_rep_a", "a2") is Delivery.NOT_STORED
    rows = client.signals_of(handle.id)
    assert [(r["name"], r["payload"], r["consumed_by"]) for r in rows] == [
        ("sa_rep_b", "b1", None),
        ("sa_rep_a", "a1", "sa_rep_a"),
    ]
    assert rows[0]["consumed_at"] is None and rows[1]["consumed_at"] is not None
    assert rows[0]["id"] < rows[1]["id"]
    gate.set()
    wait_until(
        lambda: handle.get().step("sa_rep_b").state is StepState.WAITING_SIGNAL,
        what="the quorum wait",
    )
    assert client.signal(handle.id, "sa_rep_b", "b2") is Delivery.CONSUMED
    assert handle.result(timeout=10) == ["a1", ["b1", "b2"]]
    rows = client.signals_of(handle.id)
    assert [(r["name"], r["consumed_by"]) for r in rows] == [
        ("sa_rep_b", "sa_rep_b"),
        ("sa_rep_a", "sa_rep_a"),
        ("sa_rep_b", "sa_rep_b"),
    ]
    assert all(r["consumed_at"] >= r["created_at"] for r in rows)


def test_async_client_signal_delivers_and_raises_typed_errors(
    client: Client, cyclone_dsn: str
) -> None:
    handle = client.submit(sa_n_now, 0)

    async def go() -> list[Delivery]:
        async with AsyncClient(cyclone_dsn) as aclient:
            with pytest.raises(SignalNotDeliverable):
                await aclient.signal(handle.id, "sa_nope", 1)
            with pytest.raises(InvalidPayload):
                await aclient.signal(handle.id, "sa_n_now_sig", {"x": float("nan")})
            with pytest.raises(InvalidArgument):
                await aclient.signal(handle.id, "", 1)
            sent = await asyncio.gather(
                *(aclient.signal(handle.id, "sa_n_now_sig", i) for i in range(5))
            )
            with pytest.raises(RunNotFound):
                await aclient.signal(10**12, "sa_n_now_sig", 1)
            return list(sent)

    sent = asyncio.run(go())
    assert sorted(sent) == sorted([Delivery.CONSUMED] * 3 + [Delivery.NOT_STORED] * 2)
    assert handle.get().step("sa_n_now_sig").state is StepState.COMPLETED
    assert len(handle.get().step("sa_n_now_sig").output) == 3


def test_the_cli_signal_command(client: Client, cyclone_dsn: str) -> None:
    runner = CliRunner()
    handle = client.submit(sa_one, 0)

    def cyclone(*args: str) -> Any:
        return runner.invoke(cli, ["--dsn", cyclone_dsn, *args])

    bad = cyclone("signal", str(handle.id), "sa_one_sig", "{not json")
    assert bad.exit_code != 0
    nan = cyclone("signal", str(handle.id), "sa_one_sig", "NaN")
    assert nan.exit_code != 0
    unknown = cyclone("signal", str(handle.id), "sa_nope", "1")
    assert unknown.exit_code != 0
    empty = cyclone("signal", str(handle.id), "", "1")
    assert empty.exit_code != 0
    assert client.signals_of(handle.id) == []
    ok = cyclone("signal", str(handle.id), "sa_one_sig", '{"k": ["\\u00e9", null]}', "--json")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output) == {"delivery": "consumed"}
    assert handle.get().step("sa_one_sig").output == {"k": ["\u00e9", None]}
    again = cyclone("signal", str(handle.id), "sa_one_sig", "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.output) == {"delivery": "not_stored"}


def test_the_cli_signal_command_sends_a_negative_number(client: Client, cyclone_dsn: str) -> None:
    handle = client.submit(sa_one, 0)
    result = CliRunner().invoke(
        cli, ["--dsn", cyclone_dsn, "signal", str(handle.id), "sa_one_sig", "--", "-1"]
    )
    assert result.exit_code == 0, result.output
    assert handle.get().step("sa_one_sig").output == -1


# -- names the default node id cannot carry ----------------------------------------------------


def _random_name(seed: int) -> str:
    # Incompressible, so PostgreSQL cannot shrink it to fit an index entry.
    state = seed
    letters = []
    for _ in range(1024):
        state = (state * 1103515245 + 12345) % 2**31
        letters.append("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[state % 52])
    return "sa_" + "".join(letters)[3:]


SA_LONG_NAMES = [_random_name(seed) for seed in (1, 2, 3)]


@workflow(name="sa_any_long_names")
def sa_any_long_names(x):  # type: ignore[no-untyped-def]
    return sa_echo(wait_any(SA_LONG_NAMES))


def test_wait_any_of_long_valid_names_is_refused_at_build_or_works(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    assert all(len(n.encode()) == 1024 for n in SA_LONG_NAMES)
    try:
        sa_any_long_names.graph  # noqa: B018
    except InvalidGraph:
        return  # refused when built, with a typed error: fine
    start_worker(sa_echo)
    handle = client.submit(sa_any_long_names, 0)
    assert client.signal(handle.id, SA_LONG_NAMES[1], 5) is Delivery.CONSUMED
    assert handle.result(timeout=10) == {"name": SA_LONG_NAMES[1], "payload": 5}


def test_a_signal_name_with_brackets_needs_a_node_id(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    def unnamed(x: Any) -> Any:
        return sa_echo(wait_signal("sa_br[0]"))

    with pytest.raises(InvalidGraph):
        _build(unnamed, "sa_brackets_unnamed")

    @workflow(name="sa_brackets_named")
    def named(x):  # type: ignore[no-untyped-def]
        return sa_echo(wait_signal("sa_br[0]").named("sa_br"))

    start_worker(sa_echo)
    handle = client.submit(named, 0)
    assert client.signal(handle.id, "sa_br[0]", "b") is Delivery.CONSUMED
    assert handle.result(timeout=10) == "b"


# -- waits that end without their signal, and come back ----------------------------------------


@workflow(name="sa_retry_quorum")
def sa_retry_quorum(x):  # type: ignore[no-untyped-def]
    return sa_echo(wait_n("sa_rq_sig", 2, timeout=timedelta(hours=1)))


def test_an_operator_retry_of_a_timed_out_quorum_starts_it_afresh(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(sa_echo)
    handle = client.submit(sa_retry_quorum, 0)
    assert client.signal(handle.id, "sa_rq_sig", "old") is Delivery.CONSUMED
    # Past its hour-long timeout; the retried wait's fresh hour counts from the moved clock.
    clock(datetime.now(UTC) + timedelta(hours=2))
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "dep_failed" or failed.value.node == "sa_rq_sig"
    client.retry(handle.id, "sa_rq_sig")
    wait = handle.get().step("sa_rq_sig")
    assert wait.state is StepState.WAITING_SIGNAL and wait.output is None
    assert client.signal(handle.id, "sa_rq_sig", "new1") is Delivery.CONSUMED
    assert client.signal(handle.id, "sa_rq_sig", "new2") is Delivery.CONSUMED
    assert handle.result(timeout=10) == ["new1", "new2"]


@step(name="sa_boom", max_attempts=1)
def sa_boom(x: object) -> object:
    raise RuntimeError("sa boom")


@workflow(name="sa_cut_off")
def sa_cut_off(x):  # type: ignore[no-untyped-def]
    cut = sa_echo(sa_boom(x), on_dep_failure="cancel_branch")
    got = wait_signal("sa_co_sig", after=[cut])
    sa_echo(got)
    return sa_pair(x, x)


def test_a_signal_for_a_wait_cut_off_by_a_contained_failure_is_not_stored(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(sa_cut_off, 1)
    # Sent before any worker runs: a worker started first could fail sa_boom and cut the
    # wait off before the signal came (then it is not stored at all).
    assert client.signal(handle.id, "sa_co_sig", "early") is Delivery.BUFFERED
    start_worker(sa_echo, sa_boom, sa_pair)
    assert handle.result(timeout=10) == [1, 1]
    assert handle.get().step("sa_co_sig").state is StepState.CANCELLED
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "sa_co_sig", "late")
    rows = client.signals_of(handle.id)
    assert [(r["payload"], r["consumed_by"]) for r in rows] == [("early", None)]


@workflow(name="sa_paused_pending")
def sa_paused_pending(x):  # type: ignore[no-untyped-def]
    first = sa_gate(x)
    return sa_echo(wait_signal("sa_pp_sig", after=[first]))


def test_a_signal_buffered_while_paused_is_consumed_on_resume(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    gate.clear()
    start_worker(sa_echo, sa_gate)
    handle = client.submit(sa_paused_pending, 0)
    wait_until(lambda: handle.get().step("sa_gate").state is StepState.RUNNING, what="sa_gate")
    client.pause(handle.id)
    gate.set()
    wait_until(
        lambda: handle.get().step("sa_gate").state is StepState.COMPLETED, what="sa_gate done"
    )
    assert handle.get().step("sa_pp_sig").state is StepState.PAUSED
    assert client.signal(handle.id, "sa_pp_sig", "while paused") is Delivery.BUFFERED
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "sa_pp_sig", "second")
    client.resume(handle.id)
    assert handle.result(timeout=10) == "while paused"
    assert [r["consumed_by"] for r in client.signals_of(handle.id)] == ["sa_pp_sig"]


@workflow(name="sa_any_race")
def sa_any_race(x):  # type: ignore[no-untyped-def]
    return sa_echo(wait_any(["sa_ar_a", "sa_ar_b"]))


def test_concurrent_senders_of_both_names_to_a_wait_any_have_one_winner(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sa_echo)
    handle = client.submit(sa_any_race, 0)
    outcomes: list[tuple[str, int, object]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def send(name: str, i: int) -> None:
        barrier.wait()
        try:
            got: object = client.signal(handle.id, name, i)
        except AlreadyTerminal:  # the winner's run already ended
            got = "terminal"
        with lock:
            outcomes.append((name, i, got))

    threads = [
        threading.Thread(target=send, args=(name, i))
        for i, name in enumerate(["sa_ar_a", "sa_ar_b"] * 4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    winners = [(name, i) for name, i, got in outcomes if got is Delivery.CONSUMED]
    assert len(winners) == 1, outcomes
    losers = {got for _, _, got in outcomes if got is not Delivery.CONSUMED}
    assert losers <= {Delivery.NOT_STORED, "terminal"}, outcomes
    (name, i) = winners[0]
    assert handle.result(timeout=10) == {"name": name, "payload": i}
    (row,) = client.signals_of(handle.id)
    assert (row["name"], row["payload"], row["consumed_by"]) == (name, i, "any_sa_ar_a_sa_ar_b")


def test_signal_refuses_a_run_id_that_is_not_one(client: Client) -> None:
    handle = client.submit(sa_one, 0)
    with pytest.raises(InvalidArgument):
        client.signal(handle, "sa_one_sig", 1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        client.signal(True, "sa_one_sig", 1)
    with pytest.raises(RunNotFound):
        client.signal(2**63, "sa_one_sig", 1)
    with pytest.raises(RunNotFound):
        client.signal(-5, "sa_one_sig", 1)
    assert client.signals_of(handle.id) == []
