"""Audit: AsyncClient parity with Client on the result / wait / signal / events
surface, through the public API on a real PostgreSQL.

Each scenario runs the same call on the sync client and on the async client (on twin
runs for writes) and compares what each gave: values, error types and their fields, and
what the database holds afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    Delivery,
    Permanent,
    RunFailed,
    RunState,
    StepContext,
    Worker,
    child,
    step,
    wait_n,
    wait_signal,
    workflow,
)
from tests.waiting import wait_until, waits_in_flight

# -- definitions ------------------------------------------------------------------------------


@step(name="xap_echo")
def xap_echo(value: object) -> object:
    return value


@step(name="xap_emit")
def xap_emit(value: object, ctx: StepContext) -> object:
    ctx.emit({"v": value})
    return value


@step(name="xap_boom", max_attempts=1)
def xap_boom(value: object) -> object:
    raise ValueError(f"boom {value}")


@step(name="xap_perm", max_attempts=3)
def xap_perm(value: object) -> object:
    raise Permanent(f"no {value}")


@step(name="xap_bad_out", max_attempts=1)
def xap_bad_out(value: object) -> object:
    return {1, 2}  # not JSON


@step(name="xap_slow", max_attempts=1, timeout=1)
def xap_slow(value: object) -> object:
    time.sleep(4)
    return value


@workflow(name="xap_ok")
def xap_ok(x):  # type: ignore[no-untyped-def]
    return xap_echo(x)


@workflow(name="xap_fail")
def xap_fail(x):  # type: ignore[no-untyped-def]
    return xap_echo.named("after_boom")(xap_boom(x))


@workflow(name="xap_perm_wf")
def xap_perm_wf(x):  # type: ignore[no-untyped-def]
    return xap_perm(x)


@workflow(name="xap_bad_out_wf")
def xap_bad_out_wf(x):  # type: ignore[no-untyped-def]
    return xap_bad_out(x)


@workflow(name="xap_slow_wf")
def xap_slow_wf(x):  # type: ignore[no-untyped-def]
    return xap_slow(x)


@workflow(name="xap_contained")
def xap_contained(x):  # type: ignore[no-untyped-def]
    broken = xap_boom(x)
    return xap_echo.named("cut")(broken, on_dep_failure="cancel_branch")


@workflow(name="xap_skipped")
def xap_skipped(x):  # type: ignore[no-untyped-def]
    return xap_echo.named("maybe")(x, when=x.gt(5))


@workflow(name="xap_noresult")
def xap_noresult(x):  # type: ignore[no-untyped-def]
    xap_echo(x)


@workflow(name="xap_parent")
def xap_parent(x):  # type: ignore[no-untyped-def]
    return xap_echo.named("tail")(child(xap_fail, x))


@workflow(name="xap_gate")
def xap_gate(x):  # type: ignore[no-untyped-def]
    return wait_signal("xap_go")


@workflow(name="xap_gate_to")
def xap_gate_to(x):  # type: ignore[no-untyped-def]
    return wait_signal("xap_go", timeout=60)


@workflow(name="xap_later_gate")
def xap_later_gate(x):  # type: ignore[no-untyped-def]
    first = xap_echo(x)
    return wait_signal("xap_go", after=[first])


@workflow(name="xap_quorum")
def xap_quorum(x):  # type: ignore[no-untyped-def]
    return wait_n("xap_go", 2)


@workflow(name="xap_cond_gate")
def xap_cond_gate(x):  # type: ignore[no-untyped-def]
    return wait_signal("xap_go", when=x.gt(5))


@workflow(name="xap_emit_gate")
def xap_emit_gate(x):  # type: ignore[no-untyped-def]
    first = xap_emit(x)
    return wait_signal("xap_go", after=[first])


STEPS = [xap_echo, xap_emit, xap_boom, xap_perm, xap_bad_out, xap_slow]


# -- helpers ----------------------------------------------------------------------------------


def described(exc_or_value: object) -> object:
    """What a call gave, comparable across the clients."""
    if isinstance(exc_or_value, RunFailed):
        e = exc_or_value
        return ("RunFailed", e.state, e.node, e.error, e.error_kind)
    if isinstance(exc_or_value, BaseException):
        return (type(exc_or_value).__name__,)
    return ("ok", exc_or_value)


def sync_outcome(call: Callable[[], object]) -> object:
    try:
        return described(call())
    except Exception as exc:
        return described(exc)


async def async_outcome(call: Callable[[], Awaitable[object]]) -> object:
    try:
        return described(await call())
    except Exception as exc:
        return described(exc)


@pytest.fixture
def aclient_factory(cyclone_dsn: str) -> Iterator[Callable[[], AsyncClient]]:
    made: list[AsyncClient] = []

    def make() -> AsyncClient:
        a = AsyncClient(cyclone_dsn)
        made.append(a)
        return a

    yield make
    for a in made:
        asyncio.run(a.close())


def ended(client: Client, run_id: int) -> Any:
    return wait_until(
        lambda: client.get_run(run_id) if client.get_run(run_id).state.is_terminal else None,
        what=f"run {run_id} to end",
    )


# -- result() / wait() for runs that end in each state ----------------------------------------


def test_result_and_wait_agree_for_every_end_state(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, xap_fail, concurrency=8)
    runs: dict[str, int] = {
        "completed": client.submit(xap_ok, {"a": [1, 2.5, None]}).id,
        "error": client.submit(xap_fail, 1).id,
        "permanent": client.submit(xap_perm_wf, 1).id,
        "invalid_output": client.submit(xap_bad_out_wf, 1).id,
        "contained": client.submit(xap_contained, 1).id,
        "skipped": client.submit(xap_skipped, 1).id,
        "not_skipped": client.submit(xap_skipped, 9).id,
        "noresult": client.submit(xap_noresult, 1).id,
        "child_failed": client.submit(xap_parent, 1).id,
        "cancelled": client.submit(xap_gate, 1).id,
    }
    client.cancel(runs["cancelled"])
    for run_id in runs.values():
        ended(client, run_id)

    sync_results = {k: sync_outcome(lambda r=r: client.result(r, 20)) for k, r in runs.items()}
    sync_zero = {k: sync_outcome(lambda r=r: client.result(r, 0)) for k, r in runs.items()}
    sync_handle = {k: sync_outcome(lambda r=r: client.handle(r).result()) for k, r in runs.items()}
    sync_waits = {k: client.wait(r, 20) for k, r in runs.items()}

    async def check() -> tuple[dict[str, object], ...]:
        async with AsyncClient(cyclone_dsn) as a:
            res = {k: await async_outcome(lambda r=r: a.result(r, 20)) for k, r in runs.items()}
            zero = {k: await async_outcome(lambda r=r: a.result(r, 0)) for k, r in runs.items()}
            hres = {
                k: await async_outcome(lambda r=r: a.handle(r).result()) for k, r in runs.items()
            }
            # many at once
            many = await asyncio.gather(
                *(a.result(r, 20) for r in runs.values()), return_exceptions=True
            )
            waits = {k: await a.wait(r, 20) for k, r in runs.items()}
            return res, zero, hres, dict(zip(runs, map(described, many), strict=True)), waits

    a_res, a_zero, a_handle, a_many, a_waits = asyncio.run(check())
    assert a_res == sync_results
    assert a_zero == sync_results
    assert sync_zero == sync_results
    assert a_handle == sync_handle == sync_results
    assert a_many == sync_results
    assert a_waits == sync_waits
    # documented outcomes
    assert sync_results["completed"] == ("ok", {"a": [1, 2.5, None]})
    assert sync_results["skipped"] == ("ok", None)  # workflows.md: a skipped result gives None
    assert sync_results["not_skipped"] == ("ok", 9)
    assert sync_results["noresult"] == ("NoOutput",)
    assert sync_results["contained"] == ("NoOutput",)
    assert sync_results["cancelled"][:2] == ("RunFailed", "cancelled")
    assert sync_results["cancelled"][4] == "cancelled"
    kinds = {k: v[4] for k, v in sync_results.items() if v[0] == "RunFailed"}
    assert kinds == {
        "error": "error",
        "permanent": "permanent",
        "invalid_output": "invalid_output",
        "child_failed": "child_failed",
        "cancelled": "cancelled",
    }, sync_results
    assert sync_results["error"][2] == "xap_boom"
    assert sync_results["child_failed"][2] == "xap_parent" or sync_results["child_failed"][2]


def test_result_of_a_step_timeout_agrees(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=2)
    run_id = client.submit(xap_slow_wf, 1).id
    want = sync_outcome(lambda: client.result(run_id, 30))

    async def check() -> object:
        async with AsyncClient(cyclone_dsn) as a:
            return await async_outcome(lambda: a.result(run_id, 30))

    assert asyncio.run(check()) == want
    assert want[:2] == ("RunFailed", "failed") and want[4] == "timeout", want  # type: ignore[index]


def test_deadline_and_signal_timeout_ends_agree(
    cyclone_dsn: str, client: Client, clock: Callable[[timedelta], None]
) -> None:
    """No worker: the refused call itself records the end (Client.signal docstring)."""
    dl_s, dl_a = (client.submit(xap_gate, i, deadline=timedelta(hours=1)).id for i in (1, 2))
    to_s, to_a = client.submit(xap_gate_to, 1).id, client.submit(xap_gate_to, 2).id
    clock(timedelta(hours=2))
    got_sync = {
        "deadline": sync_outcome(lambda: client.signal(dl_s, "xap_go", 1)),
        "timeout": sync_outcome(lambda: client.signal(to_s, "xap_go", 1)),
    }

    async def check() -> dict[str, object]:
        async with AsyncClient(cyclone_dsn) as a:
            got = {
                "deadline": await async_outcome(lambda: a.signal(dl_a, "xap_go", 1)),
                "timeout": await async_outcome(lambda: a.signal(to_a, "xap_go", 1)),
            }
            got["deadline result"] = await async_outcome(lambda: a.result(dl_a, 10))
            got["timeout result"] = await async_outcome(lambda: a.result(to_a, 10))
            return got

    got_async = asyncio.run(check())
    got_sync["deadline result"] = sync_outcome(lambda: client.result(dl_s, 10))
    got_sync["timeout result"] = sync_outcome(lambda: client.result(to_s, 10))
    assert got_async == got_sync
    assert got_sync["deadline"] == ("PassedDeadline",)
    assert got_sync["timeout"] == ("AlreadyTerminal",)
    assert got_sync["deadline result"][4] == "deadline"  # type: ignore[index]
    assert got_sync["timeout result"][4] == "signal_timeout"  # type: ignore[index]
    for run_id in (dl_s, dl_a, to_s, to_a):
        assert client.signals_of(run_id) == []


# -- before the run starts, while it runs, after a purge ----------------------------------------


def test_waits_on_a_pending_run_time_out_the_same_way(cyclone_dsn: str, client: Client) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    run_id = client.enqueue(xap_echo, 1, scheduled_at=later).id
    gate = client.submit(xap_gate, 1).id
    cases = {
        "pending 0": (run_id, 0),
        "pending tiny": (run_id, 0.01),
        "pending int": (run_id, 0.3),
        "running 0": (gate, 0),
        "running tiny": (gate, 1e-9),
    }
    want = {k: sync_outcome(lambda r=r, t=t: client.result(r, t)) for k, (r, t) in cases.items()}
    want_w = {k: sync_outcome(lambda r=r, t=t: client.wait(r, t)) for k, (r, t) in cases.items()}

    async def check() -> tuple[dict[str, object], dict[str, object]]:
        async with AsyncClient(cyclone_dsn) as a:
            got = {
                k: await async_outcome(lambda r=r, t=t: a.result(r, t))
                for k, (r, t) in cases.items()
            }
            got_w = {
                k: await async_outcome(lambda r=r, t=t: a.wait(r, t)) for k, (r, t) in cases.items()
            }
            assert waits_in_flight(a._client) == 0
            return got, got_w

    got, got_w = asyncio.run(check())
    assert got == want
    assert got_w == want_w
    assert set(want.values()) == {("TimeoutError",)}
    assert waits_in_flight(client) == 0


@pytest.mark.parametrize("bad", [-1, float("nan"), True, "1", timedelta(seconds=1)])
def test_bad_timeouts_are_refused_alike(cyclone_dsn: str, client: Client, bad: Any) -> None:
    run_id = client.submit(xap_gate, 1).id
    want = sync_outcome(lambda: client.result(run_id, bad))
    want_w = sync_outcome(lambda: client.wait(run_id, bad))

    async def check() -> tuple[object, object, object]:
        async with AsyncClient(cyclone_dsn) as a:
            r = await async_outcome(lambda: a.result(run_id, bad))
            w = await async_outcome(lambda: a.wait(run_id, bad))
            h = await async_outcome(lambda: a.handle(run_id).wait(bad))
            return r, w, h

    assert asyncio.run(check()) == (want, want_w, want_w)
    assert want == want_w == ("InvalidArgument",)


def test_purged_runs_read_as_not_found_on_both_clients(cyclone_dsn: str, client: Client) -> None:
    run_id = client.submit(xap_gate, 1).id
    client.signal(run_id, "xap_go", "x")
    assert client.result(run_id, 10) == "x"
    assert client.purge() >= 1
    calls_sync: dict[str, Callable[[], object]] = {
        "result": lambda: client.result(run_id, 5),
        "result0": lambda: client.result(run_id, 0),
        "wait": lambda: client.wait(run_id, 5),
        "outcome": lambda: client.outcome(run_id),
        "get_run": lambda: client.get_run(run_id),
        "signal": lambda: client.signal(run_id, "xap_go", 1),
        "cancel": lambda: client.cancel(run_id),
        "events": lambda: list(client.events(run_id, timeout=5)),
        "events_of": lambda: client.events_of(run_id),
    }
    want = {k: sync_outcome(c) for k, c in calls_sync.items()}

    async def check() -> dict[str, object]:
        async with AsyncClient(cyclone_dsn) as a:

            async def follow() -> list[object]:
                return [e async for e in a.events(run_id, timeout=5)]

            calls: dict[str, Callable[[], Awaitable[object]]] = {
                "result": lambda: a.result(run_id, 5),
                "result0": lambda: a.result(run_id, 0),
                "wait": lambda: a.wait(run_id, 5),
                "outcome": lambda: a.outcome(run_id),
                "get_run": lambda: a.get_run(run_id),
                "signal": lambda: a.signal(run_id, "xap_go", 1),
                "cancel": lambda: a.cancel(run_id),
                "events": follow,
                "events_of": lambda: a.events_of(run_id),
            }
            return {k: await async_outcome(c) for k, c in calls.items()}

    assert asyncio.run(check()) == want
    assert set(want.values()) == {("RunNotFound",)}, want


# -- signals to runs in every state -----------------------------------------------------------


def _states_for_signals(client: Client) -> dict[str, int]:
    """One run per state a signal can meet (no worker)."""
    made: dict[str, int] = {}
    made["waiting"] = client.submit(xap_gate, 1).id
    made["not active"] = client.submit(xap_later_gate, 1).id
    made["paused waiting"] = client.submit(xap_gate, 1).id
    client.pause(made["paused waiting"])
    made["paused not active"] = client.submit(xap_later_gate, 1).id
    client.pause(made["paused not active"])
    made["completed"] = client.submit(xap_gate, 1).id
    client.signal(made["completed"], "xap_go", 0)
    made["cancelled"] = client.submit(xap_gate, 1).id
    client.cancel(made["cancelled"])
    made["quorum"] = client.submit(xap_quorum, 1).id
    made["skipped wait"] = client.submit(xap_cond_gate, 1).id
    made["live cond wait"] = client.submit(xap_cond_gate, 9).id
    return made


def test_signals_to_runs_in_every_state_agree_and_write_the_same(
    cyclone_dsn: str, client: Client
) -> None:
    s_runs = _states_for_signals(client)
    a_runs = _states_for_signals(client)
    sends: list[tuple[str, str, object]] = [
        ("waiting", "xap_go", {"k": 1}),
        ("waiting", "xap_go", 2),  # the run completed with the first
        ("not active", "xap_go", 1),
        ("not active", "xap_go", 2),  # past capacity
        ("paused waiting", "xap_go", 1),
        ("paused not active", "xap_go", 1),
        ("completed", "xap_go", 1),
        ("cancelled", "xap_go", 1),
        ("quorum", "xap_go", 1),
        ("quorum", "xap_go", 2),
        ("quorum", "xap_go", 3),
        ("skipped wait", "xap_go", 1),
        ("live cond wait", "xap_go", 1),
        ("waiting", "xap_nope", 1),
        ("not active", "xap_nope", 1),
    ]
    want = [sync_outcome(lambda s=s, n=n, p=p: client.signal(s_runs[s], n, p)) for s, n, p in sends]

    async def check() -> list[object]:
        async with AsyncClient(cyclone_dsn) as a:
            return [
                await async_outcome(lambda s=s, n=n, p=p: a.signal(a_runs[s], n, p))
                for s, n, p in sends
            ]

    got = asyncio.run(check())
    assert got == want
    # the same effect on the database
    for state in s_runs:
        s_run, a_run = client.get_run(s_runs[state]), client.get_run(a_runs[state])
        assert s_run.state == a_run.state, state
        assert [(st.node, st.state) for st in s_run.steps] == [
            (st.node, st.state) for st in a_run.steps
        ], state
        strip = lambda rows: [  # noqa: E731
            {
                k: v
                for k, v in r.items()
                if k not in ("id", "run_id", "created_at", "sent_at", "consumed_at", "step_id")
            }
            for r in rows
        ]
        assert strip(client.signals_of(s_runs[state])) == strip(client.signals_of(a_runs[state])), (
            state
        )
    documented = dict(zip([f"{s}/{n}/{p}" for s, n, p in sends], want, strict=True))
    assert documented["waiting/xap_go/{'k': 1}"] == ("ok", Delivery.CONSUMED)
    assert documented["waiting/xap_go/2"] == ("AlreadyTerminal",)
    assert documented["not active/xap_go/1"] == ("ok", Delivery.BUFFERED)
    assert documented["not active/xap_go/2"] == ("MailboxFull",)
    assert documented["completed/xap_go/1"] == ("AlreadyTerminal",)
    assert documented["cancelled/xap_go/1"] == ("AlreadyTerminal",)
    assert documented["quorum/xap_go/3"] == ("AlreadyTerminal",)
    assert documented["not active/xap_nope/1"] == ("SignalNotDeliverable",)


@pytest.mark.parametrize(
    ("name", "payload"),
    [("", 1), ("x" * 2000, 1), (None, 1), ("xap_go", {1, 2}), ("xap_go", float("nan"))],
)
def test_bad_signals_are_refused_alike(
    cyclone_dsn: str, client: Client, name: Any, payload: Any
) -> None:
    run_id = client.submit(xap_gate, 1).id
    want = sync_outcome(lambda: client.signal(run_id, name, payload))

    async def check() -> object:
        async with AsyncClient(cyclone_dsn) as a:
            return await async_outcome(lambda: a.signal(run_id, name, payload))

    assert asyncio.run(check()) == want
    assert want[0] != "ok"  # type: ignore[index]
    assert client.signals_of(run_id) == []
    assert client.get_run(run_id).state is RunState.RUNNING


def test_steering_refusals_agree(
    cyclone_dsn: str, client: Client, clock: Callable[[timedelta], None]
) -> None:
    def make() -> dict[str, int]:
        made = {"completed": client.submit(xap_gate, 1).id}
        client.signal(made["completed"], "xap_go", 0)
        made["cancelled"] = client.submit(xap_gate, 1).id
        client.cancel(made["cancelled"])
        made["paused"] = client.submit(xap_gate, 1).id
        client.pause(made["paused"])
        made["running"] = client.submit(xap_gate, 1).id
        made["late"] = client.submit(xap_gate, 1, deadline=timedelta(minutes=30)).id
        made["late paused"] = client.submit(xap_gate, 1, deadline=timedelta(minutes=30)).id
        client.pause(made["late paused"])
        return made

    s_runs, a_runs = make(), make()
    clock(timedelta(hours=1))
    ops = [
        ("pause", "completed"),
        ("resume", "completed"),
        ("cancel", "completed"),
        ("retry", "completed"),
        ("pause", "cancelled"),
        ("resume", "cancelled"),
        ("cancel", "cancelled"),
        ("pause", "paused"),
        ("resume", "running"),
        ("retry", "running"),
        ("pause", "late"),
        ("cancel", "late"),
        ("resume", "late paused"),
        ("cancel", "late paused"),
    ]

    def sync_call(op: str, run_id: int) -> object:
        if op == "retry":
            return client.retry(run_id, "xap_go")
        return getattr(client, op)(run_id)

    want = [sync_outcome(lambda o=o, s=s: sync_call(o, s_runs[s])) for o, s in ops]

    async def check() -> list[object]:
        async with AsyncClient(cyclone_dsn) as a:

            async def call(op: str, run_id: int) -> object:
                if op == "retry":
                    return await a.retry(run_id, "xap_go")
                return await getattr(a, op)(run_id)

            return [await async_outcome(lambda o=o, s=s: call(o, a_runs[s])) for o, s in ops]

    got = asyncio.run(check())
    assert got == want, list(zip(ops, want, got, strict=True))
    for state in s_runs:
        s_run, a_run = client.get_run(s_runs[state]), client.get_run(a_runs[state])
        assert (s_run.state, [(x.node, x.state, x.error_kind) for x in s_run.steps]) == (
            a_run.state,
            [(x.node, x.state, x.error_kind) for x in a_run.steps],
        ), state


# -- events() followers end when the run ends --------------------------------------------------


def test_event_followers_end_when_the_run_ends_in_any_state(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    to_cancel = client.submit(xap_emit_gate, 1).id
    to_complete = client.submit(xap_emit_gate, 2).id
    never_started = client.enqueue(
        xap_echo, 1, scheduled_at=datetime.now(UTC) + timedelta(hours=1)
    ).id
    failed = client.submit(xap_fail, 1).id
    for run_id in (to_cancel, to_complete):
        wait_until(lambda r=run_id: client.events_of(r), what="the first event")

    async def follow_all() -> dict[int, list[tuple[int, str]]]:
        async with AsyncClient(cyclone_dsn) as a:

            async def follow(run_id: int) -> list[tuple[int, str]]:
                return [(e.seq, e.node) async for e in a.handle(run_id).events(timeout=30)]

            tasks = {
                r: asyncio.ensure_future(follow(r))
                for r in (to_cancel, to_complete, never_started, failed)
            }
            await asyncio.sleep(0.3)
            await a.cancel(to_cancel)
            await a.signal(to_complete, "xap_go", 1)
            await a.cancel(never_started)
            _done, pending = await asyncio.wait(tasks.values(), timeout=20)
            assert not pending, "a follower hung"
            out = {r: t.result() for r, t in tasks.items()}
            assert waits_in_flight(a._client) == 0
            return out

    got = asyncio.run(follow_all())
    for run_id in (to_cancel, to_complete, never_started, failed):
        sync_events = [(e.seq, e.node) for e in client.events(run_id, timeout=10)]
        assert got[run_id] == sync_events, run_id
    assert [n for _, n in got[to_cancel]] == ["xap_emit"]
    assert got[never_started] == []


# -- cancelled awaits do not break the shared wait connection ----------------------------------


def test_cancelled_awaits_at_every_moment_leave_other_waiters_working(
    cyclone_dsn: str, client: Client
) -> None:
    async def check() -> None:
        async with AsyncClient(cyclone_dsn) as a:
            for round_ in range(15):
                run_id = (await a.submit(xap_gate, round_)).id
                keeper = asyncio.ensure_future(a.result(run_id, 20))
                victims = [asyncio.ensure_future(a.result(run_id)) for _ in range(5)]
                victims += [asyncio.ensure_future(a.wait(run_id, 20)) for _ in range(5)]
                for _ in range(round_ % 4):
                    await asyncio.sleep(0)
                # the signal lands while the victims are cancelled: their wake-ups may be
                # scheduled on the loop already
                sent = asyncio.ensure_future(a.signal(run_id, "xap_go", round_))
                if round_ % 2:
                    await sent
                for v in victims:
                    v.cancel()
                assert await keeper == round_
                await sent
                results = await asyncio.gather(*victims, return_exceptions=True)
                for r in results:
                    assert (
                        isinstance(r, asyncio.CancelledError)
                        or r == round_
                        or (getattr(r, "state", None) is RunState.COMPLETED)
                    ), r
                assert await a.result(run_id, 0) == round_
            await until_zero(a)

    asyncio.run(check())


async def until_zero(a: AsyncClient) -> None:
    deadline = time.monotonic() + 20
    while waits_in_flight(a._client):
        assert time.monotonic() < deadline, "waits left in flight"
        await asyncio.sleep(0.01)


# -- construction parity -------------------------------------------------------------------------


def test_the_async_client_has_the_sync_clients_public_attributes(cyclone_dsn: str) -> None:
    with Client(cyclone_dsn) as c:
        sync_attrs = {n for n in vars(c) if not n.startswith("_")}

    async def attrs_of() -> set[str]:
        a = await asyncio.to_thread(AsyncClient, cyclone_dsn)
        try:
            return {n for n in vars(a) if not n.startswith("_")}
        finally:
            await a.close()

    assert asyncio.run(attrs_of()) == sync_attrs


@pytest.mark.parametrize("kwargs", [{"pool_size": 0}, {"pool_size": True}, {"tracing": object()}])
def test_bad_constructor_arguments_agree(cyclone_dsn: str, kwargs: dict[str, Any]) -> None:
    want = sync_outcome(lambda: Client(cyclone_dsn, **kwargs).close())
    got = sync_outcome(lambda: asyncio.run(AsyncClient(cyclone_dsn, **kwargs).close()))
    assert got == want


# -- the *_tx methods on the caller's connection ----------------------------------------------


TX_CASES = [
    "intrans",
    "autocommit",
    "inerror",
    "closed",
    "once dup",
    "enqueue dup",
    "bad key",
    "bad deadline",
    "unknown workflow",
    "other schema",
]


def test_tx_methods_agree_on_every_connection_state(cyclone_dsn: str, client: Client) -> None:
    other_schema_dsn = cyclone_dsn.replace("search_path=", "search_path=xap_nowhere,")
    assert other_schema_dsn != cyclone_dsn
    cases = TX_CASES

    def sync_case(case: str) -> object:
        dsn = other_schema_dsn if case == "other schema" else cyclone_dsn
        conn = psycopg.connect(dsn, autocommit=case == "autocommit")
        try:
            if case == "inerror":
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT 1/0")
            if case == "closed":
                conn.close()
            if case == "once dup":
                client.submit_once(xap_gate, 1, key="xap-dup-s")
                h = client.submit_once_tx(conn, xap_gate, 1, key="xap-dup-s")
            elif case == "enqueue dup":
                client.enqueue(xap_echo, 1, unique_key="xap-u-s", scheduled_at=_later())
                h = client.enqueue_tx(conn, xap_echo, 1, unique_key="xap-u-s")
            elif case == "bad key":
                h = client.submit_once_tx(conn, xap_gate, 1, key="")
            elif case == "bad deadline":
                h = client.submit_tx(conn, xap_gate, 1, deadline=timedelta(seconds=-1))
            elif case == "unknown workflow":
                h = client.submit_tx(conn, "xap_no_such_workflow", 1)
            else:
                h = client.submit_tx(conn, xap_gate, 1)
            if not conn.closed and not conn.autocommit:
                conn.commit()
            return ("ok", h.created, client.get_run(h.id).state)
        except Exception as exc:
            return described(exc)
        finally:
            conn.close()

    want = {c: sync_case(c) for c in cases}

    async def check() -> dict[str, object]:
        async with AsyncClient(cyclone_dsn) as a:

            async def async_case(case: str) -> object:
                dsn = other_schema_dsn if case == "other schema" else cyclone_dsn
                conn = await psycopg.AsyncConnection.connect(dsn, autocommit=case == "autocommit")
                try:
                    if case == "inerror":
                        with contextlib.suppress(psycopg.Error):
                            await conn.execute("SELECT 1/0")
                    if case == "closed":
                        await conn.close()
                    if case == "once dup":
                        await a.submit_once(xap_gate, 1, key="xap-dup-a")
                        h = await a.submit_once_tx(conn, xap_gate, 1, key="xap-dup-a")
                    elif case == "enqueue dup":
                        await a.enqueue(xap_echo, 1, unique_key="xap-u-a", scheduled_at=_later())
                        h = await a.enqueue_tx(conn, xap_echo, 1, unique_key="xap-u-a")
                    elif case == "bad key":
                        h = await a.submit_once_tx(conn, xap_gate, 1, key="")
                    elif case == "bad deadline":
                        h = await a.submit_tx(conn, xap_gate, 1, deadline=timedelta(seconds=-1))
                    elif case == "unknown workflow":
                        h = await a.submit_tx(conn, "xap_no_such_workflow", 1)
                    else:
                        h = await a.submit_tx(conn, xap_gate, 1)
                    if not conn.closed and not conn.autocommit:
                        await conn.commit()
                    return ("ok", h.created, (await a.get_run(h.id)).state)
                except Exception as exc:
                    return described(exc)
                finally:
                    await conn.close()

            return {c: await async_case(c) for c in cases}

    got = asyncio.run(check())
    assert got == want, {c: (want[c], got[c]) for c in cases if want[c] != got[c]}


def _later() -> datetime:
    return datetime.now(UTC) + timedelta(hours=1)


# -- more end states, many waiters, close, debounce, events arguments ----------------------------


@workflow(name="xap_contained_deep")
def xap_contained_deep(x):  # type: ignore[no-untyped-def]
    cut = xap_echo.named("cut")(xap_boom(x), on_dep_failure="cancel_branch")
    return xap_echo.named("after_cut")(cut)


@workflow(name="xap_contained_side")
def xap_contained_side(x):  # type: ignore[no-untyped-def]
    xap_echo.named("cut")(xap_boom(x), on_dep_failure="cancel_branch")
    return xap_echo.named("own")(x)


def test_more_end_states_agree(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    runs = {
        "contained deep": client.submit(xap_contained_deep, 1).id,
        "contained side": client.submit(xap_contained_side, 3).id,
        "skipped wait": client.submit(xap_cond_gate, 1).id,
        "enqueued fails": client.enqueue(xap_boom, 4).id,
        "enqueued ok": client.enqueue(xap_echo, [4]).id,
    }
    want = {k: sync_outcome(lambda r=r: client.result(r, 20)) for k, r in runs.items()}

    async def check() -> dict[str, object]:
        async with AsyncClient(cyclone_dsn) as a:
            return {k: await async_outcome(lambda r=r: a.result(r, 20)) for k, r in runs.items()}

    assert asyncio.run(check()) == want
    assert want["contained deep"] == ("NoOutput",), want
    assert want["contained side"] == ("ok", 3), want
    assert want["skipped wait"] == ("ok", None), want
    assert want["enqueued fails"][:3] == ("RunFailed", "failed", "xap_boom"), want  # type: ignore[index]
    assert want["enqueued ok"] == ("ok", [4]), want


def test_two_hundred_async_results_on_a_pool_of_one(cyclone_dsn: str, client: Client) -> None:
    ids = [h.id for h in client.submit_many(xap_gate, list(range(200)))]

    async def check() -> list[object]:
        async with AsyncClient(cyclone_dsn, pool_size=1) as a:
            tasks = [asyncio.ensure_future(a.result(r, 60)) for r in ids]
            await until_count(a, 200)
            for r in ids:
                await a.signal(r, "xap_go", r)
            _done, pending = await asyncio.wait(tasks, timeout=60)
            assert not pending, f"{len(pending)} results hung"
            await until_zero(a)
            return [t.result() for t in tasks]

    assert asyncio.run(check()) == ids


async def until_count(a: AsyncClient, n: int) -> None:
    deadline = time.monotonic() + 20
    while waits_in_flight(a._client) < n:
        assert time.monotonic() < deadline, "waits did not begin"
        await asyncio.sleep(0.01)


def test_sync_and_async_waiters_in_flight_on_a_paused_run_end_when_it_is_cancelled(
    cyclone_dsn: str, client: Client
) -> None:
    run_id = client.submit(xap_gate, 1).id
    client.pause(run_id)
    import threading

    box: list[object] = []
    th = threading.Thread(target=lambda: box.append(sync_outcome(lambda: client.result(run_id))))
    th.start()

    async def check() -> tuple[object, object, object]:
        async with AsyncClient(cyclone_dsn) as a:
            timed = await async_outcome(lambda: a.result(run_id, 0.2))
            t1 = asyncio.ensure_future(async_outcome(lambda: a.result(run_id)))
            t2 = asyncio.ensure_future(async_outcome(lambda: a.handle(run_id).wait()))
            await until_count(a, 2)
            await a.cancel(run_id)
            r1, r2 = await asyncio.wait_for(asyncio.gather(t1, t2), 20)
            return timed, r1, r2

    timed, r1, r2 = asyncio.run(check())
    th.join(20)
    assert not th.is_alive()
    assert timed == ("TimeoutError",)
    assert r1 == box[0]
    assert r1[:2] == ("RunFailed", "cancelled")  # type: ignore[index]
    assert r2[0] == "ok"  # type: ignore[index]


def test_close_twice_and_calls_after_close_agree(cyclone_dsn: str) -> None:
    c = Client(cyclone_dsn)
    c.close()
    want = sync_outcome(c.close)
    want_events = sync_outcome(lambda: c.events(1))
    want_handle = sync_outcome(lambda: c.handle(1).id)

    async def check() -> tuple[object, object, object]:
        a = AsyncClient(cyclone_dsn)
        await a.close()
        twice = await async_outcome(a.close)
        ev = sync_outcome(lambda: a.events(1))
        h = sync_outcome(lambda: a.handle(1).id)
        return twice, ev, h

    assert asyncio.run(check()) == (want, want_events, want_handle)
    assert want == ("ok", None)
    assert want_events == ("ClientClosed",)


def test_debounced_submits_agree(cyclone_dsn: str, client: Client) -> None:
    from cyclone_dsl import Debounce

    d = Debounce(delay=timedelta(hours=1))
    s1, s2 = client.submit(xap_ok, 1, debounce=d), client.submit(xap_ok, 2, debounce=d)
    bad_s = sync_outcome(lambda: client.submit(xap_ok, 1, debounce=object()))  # type: ignore[arg-type]

    async def check() -> tuple[Any, ...]:
        async with AsyncClient(cyclone_dsn) as a:
            a1 = await a.submit(xap_ok, 3, debounce=d)
            bad = await async_outcome(lambda: a.submit(xap_ok, 1, debounce=object()))  # type: ignore[arg-type]
            return a1, bad

    a1, bad = asyncio.run(check())
    assert (s1.created, s2.created, a1.created) == (True, False, False)
    assert a1.id == s1.id
    assert bad == bad_s == ("InvalidArgument",)


@pytest.mark.parametrize(
    "kwargs", [{"after": -1}, {"after": True}, {"timeout": -1}, {"timeout": "x"}, {"after": 2**70}]
)
def test_events_arguments_agree(cyclone_dsn: str, client: Client, kwargs: dict[str, Any]) -> None:
    run_id = client.submit(xap_gate, 1).id
    client.cancel(run_id)

    def sync_call() -> object:
        it = client.events(run_id, **kwargs)
        return list(it)

    want = sync_outcome(sync_call)

    async def check() -> object:
        async with AsyncClient(cyclone_dsn) as a:

            async def call() -> object:
                return [e async for e in a.events(run_id, **kwargs)]

            return await async_outcome(call)

    assert asyncio.run(check()) == want


@pytest.mark.parametrize("timeout", [1e10, 1e300, 2**40])
def test_a_very_long_but_finite_timeout_waits_like_no_limit_on_both_clients(
    cyclone_dsn: str, client: Client, timeout: float
) -> None:
    """RunHandle.wait: "None or infinity: no limit; a negative or NaN one: InvalidArgument".
    A finite timeout longer than threading.TIMEOUT_MAX is a valid number of seconds: the
    wait must simply wait (here the run ends by a signal a moment later)."""
    import threading

    run_id = client.submit(xap_gate, 1).id
    box: list[object] = []
    th = threading.Thread(
        target=lambda: box.append(sync_outcome(lambda: client.result(run_id, timeout))),
        daemon=True,
    )
    th.start()

    async def check() -> object:
        async with AsyncClient(cyclone_dsn) as a:
            task = asyncio.ensure_future(async_outcome(lambda: a.result(run_id, timeout)))
            await until_count(a, 1)
            await asyncio.to_thread(
                wait_until, lambda: box or waits_in_flight(client), what="the sync wait"
            )
            await a.signal(run_id, "xap_go", "late")
            return await asyncio.wait_for(task, 20)

    got = asyncio.run(check())
    th.join(20)
    assert box == [got], (box, got)
    assert got == ("ok", "late")


def test_a_very_long_but_finite_timeout_on_event_followers_of_both_clients(
    cyclone_dsn: str, client: Client
) -> None:
    """Client.events: ``TimeoutError`` "when the run has not ended after ``timeout``
    seconds"; a finite 1e10 s must follow the run to its end, as the async follower does."""
    import threading

    run_id = client.submit(xap_gate, 1).id
    box: list[object] = []
    th = threading.Thread(
        target=lambda: box.append(sync_outcome(lambda: list(client.events(run_id, timeout=1e10)))),
        daemon=True,
    )
    th.start()

    async def check() -> object:
        async with AsyncClient(cyclone_dsn) as a:

            async def follow() -> object:
                return [e async for e in a.events(run_id, timeout=1e10)]

            task = asyncio.ensure_future(async_outcome(follow))
            await until_count(a, 1)
            await asyncio.to_thread(
                wait_until, lambda: box or waits_in_flight(client), what="the sync follower"
            )
            await a.cancel(run_id)
            return await asyncio.wait_for(task, 20)

    got = asyncio.run(check())
    th.join(20)
    assert got == ("ok", [])
    assert box == [got], (box, got)
