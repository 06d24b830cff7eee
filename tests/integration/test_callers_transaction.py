"""submit_tx, submit_once_tx and enqueue_tx in the caller's transaction, sync and async.

For every root shape (a step, a signal wait, a timer, a child run, a fan-out), the
run exists exactly when the caller commits, fully activated; after a rollback
nothing of it is left. A submit that fails half-way inside the caller's
transaction leaves nothing of itself, and the caller's own writes stay.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    child,
    for_each,
    step,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.testing.failpoints import arm, disarm


@step(name="ct_work")
def work(x: object) -> object:
    return x


@workflow(name="ct_step_root")
def step_root(x):  # type: ignore[no-untyped-def]
    return work(x)


@workflow(name="ct_wait_root")
def wait_root(x):  # type: ignore[no-untyped-def]
    return work(wait_signal("go"))


@workflow(name="ct_timer_root")
def timer_root(x):  # type: ignore[no-untyped-def]
    return work(x, after=[wait_timer(timedelta(hours=1))])


@workflow(name="ct_child_root")
def child_root(x):  # type: ignore[no-untyped-def]
    return child(step_root, x)


@workflow(name="ct_fan_out_root")
def fan_out_root(items):  # type: ignore[no-untyped-def]
    return for_each(work, over=items)


#: (workflow, input, what its roots look like right after the commit: node -> state).
SHAPES: dict[str, tuple[Any, object, dict[str, str]]] = {
    "step": (step_root, 1, {"ct_work": "available"}),
    "wait": (wait_root, 1, {"go": "waiting_signal", "ct_work": "pending"}),
    "timer": (timer_root, 1, {"timer": "waiting_timer", "ct_work": "pending"}),
    "child": (child_root, 1, {"ct_step_root": "waiting_child"}),
    "fan_out": (
        fan_out_root,
        [1, 2],
        {"ct_work": "pending", "ct_work[0]": "available", "ct_work[1]": "available"},
    ),
}


def counts(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM cyclone_runs), (SELECT count(*) FROM cyclone_steps)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def states(client: Client, run_id: int) -> dict[str, str]:
    return {s.node: s.state.value for s in client.get_run(run_id).steps}


def check_shape(client: Client, run_id: int, shape: str) -> None:
    _, _, expected = SHAPES[shape]
    assert states(client, run_id) == expected
    if shape == "child":
        (started,) = client.children_of(run_id)
        assert states(client, started["id"]) == {"ct_work": "available"}


Submit = Callable[[Any, Any, object], int]


def sync_submitters(client: Client) -> dict[str, Submit]:
    return {
        "submit_tx": lambda conn, wf, value: client.submit_tx(conn, wf, value).id,
        "submit_once_tx": lambda conn, wf, value: (
            client.submit_once_tx(conn, wf, value, key=f"k-{wf.name}").id
        ),
    }


@pytest.mark.parametrize("method", ["submit_tx", "submit_once_tx"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sync_submit_in_the_callers_transaction(
    client: Client, cyclone_dsn: str, shape: str, method: str
) -> None:
    wf, value, _ = SHAPES[shape]
    submit = sync_submitters(client)[method]
    with psycopg.connect(cyclone_dsn) as conn:  # not autocommit: the caller commits
        submit(conn, wf, value)
        conn.rollback()
        assert counts(cyclone_dsn) == (0, 0)
        run_id = submit(conn, wf, value)
        assert counts(cyclone_dsn) == (0, 0), "visible before the caller's commit"
        conn.commit()
    check_shape(client, run_id, shape)


@pytest.mark.parametrize("method", ["submit_tx", "submit_once_tx"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_async_submit_in_the_callers_transaction(
    client: Client, cyclone_dsn: str, shape: str, method: str
) -> None:
    wf, value, _ = SHAPES[shape]

    async def scenario() -> int:
        async with AsyncClient(cyclone_dsn) as aclient:
            submitters: dict[str, Callable[[Any], Awaitable[Any]]] = {
                "submit_tx": lambda conn: aclient.submit_tx(conn, wf, value),
                "submit_once_tx": lambda conn: aclient.submit_once_tx(
                    conn, wf, value, key=f"k-{wf.name}"
                ),
            }
            async with await psycopg.AsyncConnection.connect(cyclone_dsn) as conn:
                await submitters[method](conn)
                await conn.rollback()
                assert counts(cyclone_dsn) == (0, 0)
                handle = await submitters[method](conn)
                assert counts(cyclone_dsn) == (0, 0), "visible before the caller's commit"
                await conn.commit()
            return int(handle.id)

    check_shape(client, asyncio.run(scenario()), shape)


def test_enqueue_tx_sync_and_async(client: Client, cyclone_dsn: str) -> None:
    with psycopg.connect(cyclone_dsn) as conn:
        client.enqueue_tx(conn, work, 1, unique_key="u")
        conn.rollback()
        assert counts(cyclone_dsn) == (0, 0)
        first = client.enqueue_tx(conn, work, 1, unique_key="u", priority=4)
        same = client.enqueue_tx(conn, work, 2, unique_key="u")
        conn.commit()
    assert first.created and not same.created and same.id == first.id
    assert client.get_run(first.id).step("ct_work").priority == 4

    async def scenario() -> tuple[bool, int]:
        async with AsyncClient(cyclone_dsn) as aclient:
            async with await psycopg.AsyncConnection.connect(cyclone_dsn) as conn:
                await aclient.enqueue_tx(conn, work, 3, queue="elsewhere")
                await conn.rollback()
                held = await aclient.enqueue_tx(conn, work, 3, unique_key="u")
                fresh = await aclient.enqueue_tx(conn, work, 4, queue="elsewhere")
                await conn.commit()
            return held.created, fresh.id

    held_created, fresh_id = asyncio.run(scenario())
    assert not held_created
    assert client.get_run(fresh_id).step("ct_work").queue == "elsewhere"
    assert counts(cyclone_dsn) == (2, 2)


def test_a_submit_failing_half_way_leaves_the_callers_transaction_usable(
    client: Client, cyclone_dsn: str
) -> None:
    """The child run is inserted, then the submit fails: the savepoint rolls back the
    parent and the child; the caller's own row, written before, commits."""
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute("CREATE TABLE ct_orders (id int)")
        conn.execute("INSERT INTO ct_orders VALUES (1)")
        arm("child.after_insert", "raise")
        try:
            with pytest.raises(RuntimeError):
                client.submit_tx(conn, child_root, 1)
        finally:
            disarm()
        conn.execute("INSERT INTO ct_orders VALUES (2)")
        conn.commit()
        assert conn.execute("SELECT count(*) FROM ct_orders").fetchone() == (2,)
    assert counts(cyclone_dsn) == (0, 0)


def test_an_autocommit_connection_gets_an_atomic_submit(client: Client, cyclone_dsn: str) -> None:
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        arm("child.after_insert", "raise")
        try:
            with pytest.raises(RuntimeError):
                client.submit_tx(conn, child_root, 1)
        finally:
            disarm()
        assert counts(cyclone_dsn) == (0, 0)
        run_id = client.submit_tx(conn, child_root, 1).id  # commits on its own
    check_shape(client, run_id, "child")


def test_submit_once_tx_waits_for_the_holder_to_commit_or_roll_back(
    client: Client, cyclone_dsn: str
) -> None:
    """A second caller with the same key waits on the first one's transaction: it gets
    the first one's run if that commits, and creates its own if that rolls back."""
    for outcome in ("commit", "rollback"):
        key = f"race-{outcome}"
        with psycopg.connect(cyclone_dsn) as holder:
            first = client.submit_once_tx(holder, step_root, 1, key=key)
            result: dict[str, Any] = {}

            def second(key: str = key, result: dict[str, Any] = result) -> None:
                result["handle"] = client.submit_once(step_root, 2, key=key)

            import threading

            thread = threading.Thread(target=second)
            thread.start()
            thread.join(timeout=0.5)
            assert thread.is_alive(), "the second caller did not wait for the first"
            getattr(holder, outcome)()
            thread.join(timeout=10)
        handle = result["handle"]
        if outcome == "commit":
            assert (handle.id, handle.created) == (first.id, False)
        else:
            assert handle.created and handle.id != first.id


class TextLoader(psycopg.adapt.Loader):
    """Loads a value as its text, as Django's connection does for ``jsonb``."""

    def load(self, data: Any) -> str:
        return bytes(data).decode()


def configured_like_a_framework(conn: Any) -> None:
    """The loaders a framework sets on the connections it owns: ``jsonb``, ``json`` and
    ``timestamptz`` read as plain text."""
    for name in ("json", "jsonb", "timestamptz"):
        conn.adapters.register_loader(name, TextLoader)


def test_submit_tx_reads_its_rows_with_psycopgs_loaders(client: Client, cyclone_dsn: str) -> None:
    """A framework's connection loads jsonb as text: the child run the submit starts must
    still get the input, not its JSON text, and the connection keeps its loaders."""
    with psycopg.connect(cyclone_dsn) as conn:
        configured_like_a_framework(conn)
        run_id = client.submit_tx(conn, child_root, {"n": 1}).id
        conn.commit()
        assert conn.execute("SELECT '{}'::jsonb").fetchone() == ("{}",)
    (started,) = client.children_of(run_id)
    assert client.get_run(started["id"]).input == {"n": 1}


def test_async_submit_tx_reads_its_rows_with_psycopgs_loaders(
    client: Client, cyclone_dsn: str
) -> None:
    async def submit() -> int:
        async with await psycopg.AsyncConnection.connect(cyclone_dsn) as conn:
            configured_like_a_framework(conn)
            async with AsyncClient(cyclone_dsn) as aclient:
                run_id = (await aclient.submit_tx(conn, child_root, {"n": 2})).id
            await conn.commit()
            return run_id

    run_id = asyncio.run(submit())
    (started,) = client.children_of(run_id)
    assert client.get_run(started["id"]).input == {"n": 2}


def test_a_timer_submitted_in_an_open_transaction_counts_from_the_submit(
    client: Client, cyclone_dsn: str
) -> None:
    """The engine reads the time as now(), which is the start of the caller's transaction:
    a timer submitted after the transaction had been open a while started early, by that
    long."""
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute("SELECT 1")  # the application's transaction begins
        time.sleep(0.5)
        (before,) = conn.execute("SELECT clock_timestamp()").fetchone() or (None,)
        handle = client.submit_tx(conn, timer_root, 1)
        conn.commit()
    (timer,) = [s for s in handle.get().steps if s.kind == "@timer"]
    assert timer.scheduled_at >= before + timedelta(hours=1)


def test_an_async_timer_submitted_in_an_open_transaction_counts_from_the_submit(
    client: Client, cyclone_dsn: str
) -> None:
    async def scenario() -> tuple[Any, int]:
        async with (
            AsyncClient(cyclone_dsn) as aclient,
            await psycopg.AsyncConnection.connect(cyclone_dsn) as conn,
        ):
            await conn.execute("SELECT 1")
            await asyncio.sleep(0.5)
            cur = await conn.execute("SELECT clock_timestamp()")
            (before,) = await cur.fetchone() or (None,)
            handle = await aclient.submit_tx(conn, timer_root, 1)
            await conn.commit()
            return before, int(handle.id)

    before, run_id = asyncio.run(scenario())
    (timer,) = [s for s in client.get_run(run_id).steps if s.kind == "@timer"]
    assert timer.scheduled_at >= before + timedelta(hours=1)
