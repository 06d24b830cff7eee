"""Audit: transactional handlers that misuse ``ctx.connection`` as real users will.

Each test runs a real worker against an application table (``txm_ledger``) in the test's
schema and checks the guarantee of docs/howto/transactional-steps.md: the handler's writes
commit together with its step's completion, or not at all, and nothing a handler leaves on
its pooled connection reaches the next handler (``concurrency=1``: one connection).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from cyclone_dsl import Client, RunState, StepContext, Worker, step
from cyclone_dsl.client.model import Step
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]
Rows = Callable[[], list[tuple[Any, ...]]]

BARRIERS: dict[str, threading.Barrier] = {}
ROLES: dict[str, str] = {}
SEEN: list[str] = []


@pytest.fixture(autouse=True)
def _reset() -> None:
    BARRIERS.clear()
    ROLES.clear()
    SEEN.clear()


@pytest.fixture
def ledger(cyclone_dsn: str) -> Rows:
    """An application table in the test's schema (no unique key: duplicates show)."""
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE txm_ledger (run_id bigint, node text, attempt int, note text)")
        conn.execute("CREATE TABLE txm_accounts (id int PRIMARY KEY, balance int)")
        conn.execute("INSERT INTO txm_accounts VALUES (1, 0), (2, 0)")

    def rows() -> list[tuple[Any, ...]]:
        with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
            return sorted(conn.execute("SELECT run_id, node, attempt, note FROM txm_ledger"))

    return rows


@pytest.fixture
def role(cyclone_dsn: str, cyclone_admin_dsn: str) -> Iterator[str]:
    """A login-less role with every privilege on the test's schema (so that a completion
    written under it could still reach Cyclone's tables); dropped at the end."""
    name = f"txm_role_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_schema()").fetchone()
        assert row is not None
        schema = sql.Identifier(str(row[0]))
        ident = sql.Identifier(name)
        conn.execute(sql.SQL("CREATE ROLE {}").format(ident))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(schema, ident))
        conn.execute(sql.SQL("GRANT ALL ON ALL TABLES IN SCHEMA {} TO {}").format(schema, ident))
        conn.execute(sql.SQL("GRANT ALL ON ALL SEQUENCES IN SCHEMA {} TO {}").format(schema, ident))
        conn.execute(sql.SQL("GRANT ALL ON ALL FUNCTIONS IN SCHEMA {} TO {}").format(schema, ident))
    ROLES["role"] = name
    yield name
    with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@pytest.fixture
def app_role(cyclone_dsn: str, cyclone_admin_dsn: str, ledger: Rows) -> Iterator[str]:
    """A role that may write the application's table only (the row-level-security way:
    ``SET LOCAL ROLE`` for the handler's own SQL); dropped at the end."""
    name = f"txm_app_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_schema()").fetchone()
        assert row is not None
        ident = sql.Identifier(name)
        conn.execute(sql.SQL("CREATE ROLE {}").format(ident))
        conn.execute(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(str(row[0])), ident)
        )
        conn.execute(sql.SQL("GRANT INSERT, SELECT ON txm_ledger TO {}").format(ident))
    ROLES["role"] = name
    yield name
    with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def write(ctx: StepContext, note: str = "") -> None:
    ctx.connection.execute(
        "INSERT INTO txm_ledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, note)
    )


async def write_async(ctx: StepContext, note: str = "") -> None:
    await ctx.connection.execute(
        "INSERT INTO txm_ledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, note)
    )


def only_step(client: Client, run_id: int) -> Step:
    (only,) = client.get_run(run_id).steps
    return only


def ended(client: Client, run_id: int, timeout: float = 20) -> RunState:
    wait_until(
        lambda: client.get_run(run_id).state.is_terminal,
        timeout=timeout,
        what=f"run {run_id} to end",
    )
    return client.get_run(run_id).state


# -- handlers -----------------------------------------------------------------------------


@step(name="txm_sql", transactional=True, max_attempts=2)
def txm_sql(how: str, ctx: StepContext) -> str:
    """Writes, runs transaction control as SQL, writes again, then returns (or raises)."""
    write(ctx, "before")
    for statement in how.split("+"):
        if statement != "raise":
            ctx.connection.execute(statement)
    write(ctx, "after")
    if "raise" in how:
        raise RuntimeError(f"fails after {how}")
    return how


@step(name="txm_async_sql", transactional=True, max_attempts=2)
async def txm_async_sql(how: str, ctx: StepContext) -> str:
    await write_async(ctx, "before")
    for statement in how.split("+"):
        if statement != "raise":
            await ctx.connection.execute(statement)
    await write_async(ctx, "after")
    if "raise" in how:
        raise RuntimeError(f"fails after {how}")
    return how


@step(name="txm_probe", transactional=True, max_attempts=1)
def txm_probe(n: int, ctx: StepContext) -> dict[str, Any]:
    return _probe_rows([ctx.connection.execute(q).fetchone() for q in PROBES])


@step(name="txm_async_probe", transactional=True, max_attempts=1)
async def txm_async_probe(n: int, ctx: StepContext) -> dict[str, Any]:
    rows = []
    for q in PROBES:
        cur = await ctx.connection.execute(q)
        rows.append(await cur.fetchone())
    return _probe_rows(rows)


PROBES: list[Any] = [
    "SELECT current_user::text",
    "SELECT current_setting('statement_timeout')",
    "SELECT current_setting('TimeZone')",
    "SELECT count(*) FROM pg_listening_channels()",
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
    "SELECT count(*) FROM pg_class WHERE relpersistence = 't' AND pg_table_is_visible(oid)",
    "SELECT current_setting('lock_timeout')",
]
PROBE_KEYS = ["user", "statement_timeout", "timezone", "listen", "advisory", "temp"]
PROBE_KEYS.append("lock_timeout")


def _probe_rows(rows: list[Any]) -> dict[str, Any]:
    return {key: row[0] for key, row in zip(PROBE_KEYS, rows, strict=True)}


POLLUTIONS = {
    "statement_timeout": ["SET statement_timeout = '1234ms'"],
    "timezone": ["SET TIME ZONE 'Pacific/Chatham'"],
    "listen": ["LISTEN txm_channel"],
    "advisory": ["SELECT pg_advisory_lock(4242)"],
    "temp": ["CREATE TEMP TABLE txm_scratch (x int)"],
    "lock_timeout": ["SET lock_timeout = '4321ms'"],
}


@step(name="txm_pollute", transactional=True, max_attempts=1)
def txm_pollute(what: str, ctx: StepContext) -> str:
    write(ctx, what)
    for statement in POLLUTIONS[what.removesuffix("+raise")]:
        ctx.connection.execute(statement)
    if what.endswith("+raise"):
        raise RuntimeError(f"fails after {what}")
    return what


@step(name="txm_async_pollute", transactional=True, max_attempts=1)
async def txm_async_pollute(what: str, ctx: StepContext) -> str:
    await write_async(ctx, what)
    for statement in POLLUTIONS[what.removesuffix("+raise")]:
        await ctx.connection.execute(statement)
    if what.endswith("+raise"):
        raise RuntimeError(f"fails after {what}")
    return what


def set_role(how: str) -> sql.Composed:
    """``SET SESSION AUTHORIZATION role``, or ``SET {SESSION|LOCAL} ROLE role``."""
    if how == "SESSION AUTHORIZATION":
        return sql.SQL("SET SESSION AUTHORIZATION {}").format(sql.Identifier(ROLES["role"]))
    return sql.SQL("SET {} ROLE {}").format(sql.SQL(how), sql.Identifier(ROLES["role"]))


@step(name="txm_set_role", transactional=True, max_attempts=2)
def txm_set_role(how: str, ctx: StepContext) -> str:
    write(ctx, how)
    ctx.connection.execute(set_role(how))
    row = ctx.connection.execute("SELECT current_user::text").fetchone()
    assert row is not None
    return str(row[0])


@step(name="txm_async_set_role", transactional=True, max_attempts=2)
async def txm_async_set_role(how: str, ctx: StepContext) -> str:
    await write_async(ctx, how)
    await ctx.connection.execute(set_role(how))
    cur = await ctx.connection.execute("SELECT current_user::text")
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


@step(name="txm_recovers", transactional=True, max_attempts=1)
def txm_recovers(how: str, ctx: StepContext) -> str:
    """A database error inside the handler's own savepoint, recovered from."""
    write(ctx, "outer")
    if how == "block":
        with contextlib.suppress(psycopg.errors.DivisionByZero), ctx.connection.transaction():
            write(ctx, "inner")
            ctx.connection.execute("SELECT 1 / 0")
    else:  # savepoints by hand, in SQL
        ctx.connection.execute("SAVEPOINT txm_sp")
        try:
            write(ctx, "inner")
            ctx.connection.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            ctx.connection.execute("ROLLBACK TO SAVEPOINT txm_sp")
    write(ctx, "last")
    return how


@step(name="txm_async_recovers", transactional=True, max_attempts=1)
async def txm_async_recovers(how: str, ctx: StepContext) -> str:
    await write_async(ctx, "outer")
    if how == "block":
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            async with ctx.connection.transaction():
                await write_async(ctx, "inner")
                await ctx.connection.execute("SELECT 1 / 0")
    else:
        await ctx.connection.execute("SAVEPOINT txm_sp")
        try:
            await write_async(ctx, "inner")
            await ctx.connection.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            await ctx.connection.execute("ROLLBACK TO SAVEPOINT txm_sp")
    await write_async(ctx, "last")
    return how


@step(name="txm_async_swallows", transactional=True, max_attempts=3)
async def txm_async_swallows(n: int, ctx: StepContext) -> int:
    await write_async(ctx)
    if ctx.attempt == 1:
        with contextlib.suppress(psycopg.errors.UniqueViolation):
            await ctx.connection.execute("INSERT INTO txm_accounts VALUES (1, 0)")
    return n


@step(name="txm_deadlock", transactional=True, max_attempts=4)
def txm_deadlock(order: list[int], ctx: StepContext) -> list[int]:
    """Two of these lock the same two rows in opposite orders: one is the deadlock's
    victim, raised from its own statement."""
    first, second = order
    ctx.connection.execute("UPDATE txm_accounts SET balance = balance + 1 WHERE id = %s", (first,))
    write(ctx, f"{first}-{second}")
    if ctx.attempt == 1:
        with contextlib.suppress(threading.BrokenBarrierError):
            BARRIERS["deadlock"].wait(10)
    ctx.connection.execute("UPDATE txm_accounts SET balance = balance + 1 WHERE id = %s", (second,))
    return order


@step(name="txm_conflict_caught", transactional=True, isolation="serializable", max_attempts=4)
def txm_conflict_caught(key: str, ctx: StepContext) -> str:
    """At serializable, "b" updates a row that "a" updated and committed after b's snapshot:
    the UPDATE raises a serialization failure, which b catches and returns past."""
    ctx.connection.execute("SELECT sum(balance) FROM txm_accounts")  # the snapshot
    if ctx.attempt == 1:
        with contextlib.suppress(threading.BrokenBarrierError):
            BARRIERS["conflict"].wait(10)
        if key == "b":
            wait_until(lambda: _committed(ROLES["dsn"], "a"), timeout=10, what="a to commit")
    write(ctx, key)
    try:
        ctx.connection.execute("UPDATE txm_accounts SET balance = balance + 1 WHERE id = 1")
    except psycopg.errors.SerializationFailure:
        SEEN.append(f"{key} caught")
        return "caught"
    return "clean"


def _committed(dsn: str, note: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM txm_ledger WHERE note = %s", (note,)).fetchone()
        return bool(row and row[0])


def notes_of(rows: Rows, run_id: int) -> list[tuple[int, str]]:
    return sorted((row[2], row[3]) for row in rows() if row[0] == run_id)


SQL_HANDLERS = {"sync": txm_sql, "async": txm_async_sql}
PROBE_HANDLERS = {"sync": txm_probe, "async": txm_async_probe}
POLLUTERS = {"sync": txm_pollute, "async": txm_async_pollute}
ROLE_SETTERS = {"sync": txm_set_role, "async": txm_async_set_role}
RECOVERERS = {"sync": txm_recovers, "async": txm_async_recovers}
CLEAN = {
    "user": "postgres",
    "statement_timeout": "0",
    "timezone": "Etc/UTC",
    "listen": 0,
    "advisory": 0,
    "temp": 0,
    "lock_timeout": "0",
}


def clean_session(client: Client, probe: Any) -> dict[str, Any]:
    """What the next handler on the (only) pooled connection sees of its session."""
    result = client.enqueue(probe, 1).result(timeout=20)
    assert isinstance(result, dict)
    return result


# -- transaction control written as SQL -------------------------------------------------


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("how", ["BEGIN", "COMMIT+BEGIN"])
def test_txm_a_begin_in_sql_keeps_every_write_with_the_completion(
    client: Client, start_worker: StartWorker, ledger: Rows, flavour: str, how: str
) -> None:
    """A stray BEGIN is a no-op warning inside the worker's transaction (COMMIT+BEGIN opens
    a new one, which the worker then commits with the completion)."""
    handler = SQL_HANDLERS[flavour]
    start_worker(handler, PROBE_HANDLERS[flavour], concurrency=1)
    handle = client.enqueue(handler, how)
    assert handle.result(timeout=20) == how
    assert only_step(client, handle.id).attempts == ()
    assert notes_of(ledger, handle.id) == [(1, "after"), (1, "before")]
    assert clean_session(client, PROBE_HANDLERS[flavour]) == CLEAN


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_txm_a_sql_rollback_does_not_complete_the_step_without_its_writes(
    client: Client, start_worker: StartWorker, ledger: Rows, flavour: str
) -> None:
    """conn.rollback() is refused (ProgrammingError, the attempt fails); the same ROLLBACK
    sent as SQL must not let the step complete without the 'before' write: the worker's
    transaction is gone (the connection is idle, not in a transaction, when the handler
    returns), so its completion cannot be kept with the handler's writes."""
    handler = SQL_HANDLERS[flavour]
    start_worker(handler, concurrency=1)
    handle = client.enqueue(handler, "ROLLBACK")
    state = ended(client, handle.id)
    notes = notes_of(ledger, handle.id)
    assert state is not RunState.COMPLETED or (1, "before") in notes, notes
    assert "transaction" in (only_step(client, handle.id).error or ""), notes


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_txm_a_sql_commit_then_raise_is_not_retried_into_duplicate_writes(
    client: Client, start_worker: StartWorker, ledger: Rows, flavour: str
) -> None:
    """The handler's writes were committed by its own COMMIT; the worker cannot roll them
    back, and retrying writes them again (max_attempts=2: two committed copies, a failed
    run). Noticing that the handler ended its transaction (the connection is idle, not in
    a transaction, after the handler) would fail the step for good with a typed error
    rather than repeat writes that can no longer be kept with a completion."""
    handler = SQL_HANDLERS[flavour]
    start_worker(handler, concurrency=1)
    handle = client.enqueue(handler, "COMMIT+raise")
    assert ended(client, handle.id) is RunState.FAILED
    assert notes_of(ledger, handle.id) == [(1, "after"), (1, "before")]


def test_txm_a_sql_commit_then_return_fails_for_good_and_leaves_a_clean_connection(
    client: Client, start_worker: StartWorker, ledger: Rows
) -> None:
    """The handler's own COMMIT ended the worker's transaction: its completion can no
    longer be kept with its writes, so the step fails for good (permanent, no retry that
    would write again), the writes it committed stay once, and the next handler on the
    same connection runs in a fresh transaction of its own."""
    start_worker(txm_sql, txm_probe, concurrency=1)
    handle = client.enqueue(txm_sql, "COMMIT")
    assert ended(client, handle.id) is RunState.FAILED
    step = only_step(client, handle.id)
    assert step.error_kind == "permanent" and "ended its step's transaction" in (step.error or "")
    assert notes_of(ledger, handle.id) == [(1, "after"), (1, "before")]
    assert clean_session(client, txm_probe) == CLEAN
    again = client.enqueue(txm_sql, "BEGIN")
    assert again.result(timeout=20) == "BEGIN"


# -- savepoints and swallowed errors -----------------------------------------------------


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("how", ["block", "sql"])
def test_txm_an_error_recovered_inside_a_savepoint_keeps_the_other_writes(
    client: Client, start_worker: StartWorker, ledger: Rows, flavour: str, how: str
) -> None:
    """A database error inside the handler's own savepoint (``with conn.transaction():``,
    or SAVEPOINT / ROLLBACK TO SAVEPOINT in SQL) rolls back only that block: the step
    completes on its first attempt with the writes outside it."""
    handler = RECOVERERS[flavour]
    start_worker(handler, concurrency=1)
    handle = client.enqueue(handler, how)
    assert handle.result(timeout=20) == how
    assert only_step(client, handle.id).attempts == ()
    assert notes_of(ledger, handle.id) == [(1, "last"), (1, "outer")]


def test_txm_an_async_handler_that_swallows_a_database_error_is_retried(
    client: Client, start_worker: StartWorker, ledger: Rows
) -> None:
    """docs: a handler that swallows a database error leaves the transaction aborted: its
    completion cannot commit, the attempt fails and is retried (async flavour)."""
    start_worker(txm_async_swallows, txm_async_probe, concurrency=1)
    handle = client.enqueue(txm_async_swallows, 4)
    assert handle.result(timeout=20) == 4
    (first,) = only_step(client, handle.id).attempts
    assert "InFailedSqlTransaction" in (first.error or "")
    assert notes_of(ledger, handle.id) == [(2, "")]
    assert clean_session(client, txm_async_probe) == CLEAN


# -- session state left behind -----------------------------------------------------------


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_txm_session_state_left_behind_does_not_reach_the_next_handler(
    client: Client, start_worker: StartWorker, ledger: Rows, flavour: str
) -> None:
    """One pooled connection (concurrency=1): after each handler that leaves a setting, a
    LISTEN, a session advisory lock or a temporary table (and returns, or raises after),
    the next handler sees a clean session; every completed polluter kept its write."""
    polluter, probe = POLLUTERS[flavour], PROBE_HANDLERS[flavour]
    start_worker(polluter, probe, concurrency=1)
    completed = []
    for what in POLLUTIONS:
        for raising in (False, True):
            handle = client.enqueue(polluter, f"{what}+raise" if raising else what)
            state = ended(client, handle.id)
            assert state is (RunState.FAILED if raising else RunState.COMPLETED), what
            if not raising:
                completed.append((handle.id, what))
            assert clean_session(client, probe) == CLEAN, (what, raising)
    assert sorted((row[0], row[3]) for row in ledger()) == sorted(completed)


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("how", ["SESSION", "SESSION AUTHORIZATION"])
def test_txm_a_role_set_by_a_handler_does_not_reach_the_next_handler(
    client: Client, start_worker: StartWorker, ledger: Rows, role: str, flavour: str, how: str
) -> None:
    """docs/howto/transactional-steps.md: what one handler leaves on its connection (a
    SET, ...) is dropped before the connection serves the next."""
    setter, probe = ROLE_SETTERS[flavour], PROBE_HANDLERS[flavour]
    start_worker(setter, probe, concurrency=1)
    handle = client.enqueue(setter, how)
    assert handle.result(timeout=20) == role
    assert notes_of(ledger, handle.id) == [(1, how)]
    assert clean_session(client, probe)["user"] == "postgres"


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_txm_a_local_role_for_the_handlers_own_sql_still_lets_the_step_complete(
    client: Client, start_worker: StartWorker, ledger: Rows, app_role: str, flavour: str
) -> None:
    """As for ``SET LOCAL search_path`` (documented as fine: the completion runs with the
    session's own), a handler that switches to an application role for its own SQL must
    not make the completion run as that role, which cannot reach Cyclone's tables."""
    setter = ROLE_SETTERS[flavour]
    start_worker(setter, concurrency=1)
    handle = client.enqueue(setter, "LOCAL")
    state = ended(client, handle.id)
    assert state is RunState.COMPLETED, only_step(client, handle.id).error
    assert notes_of(ledger, handle.id) == [(1, "LOCAL")]


# -- conflicts raised from the handler's own statements ----------------------------------


def test_txm_a_deadlock_victim_is_retried_and_each_write_lands_once(
    client: Client, start_worker: StartWorker, ledger: Rows, cyclone_dsn: str
) -> None:
    BARRIERS["deadlock"] = threading.Barrier(2)
    start_worker(txm_deadlock, concurrency=2)
    first = client.enqueue(txm_deadlock, [1, 2])
    second = client.enqueue(txm_deadlock, [2, 1])
    assert first.result(timeout=30) == [1, 2]
    assert second.result(timeout=30) == [2, 1]
    errors = [a.error or "" for h in (first, second) for a in only_step(client, h.id).attempts]
    assert len(errors) == 1 and "DeadlockDetected" in errors[0], errors
    assert sorted(row[3] for row in ledger()) == ["1-2", "2-1"]
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT sum(balance) FROM txm_accounts").fetchone() == (4,)


def test_txm_a_caught_serialization_failure_fails_the_attempt_and_is_retried(
    client: Client, start_worker: StartWorker, ledger: Rows, cyclone_dsn: str
) -> None:
    """A serialization failure raised from the handler's own statement and caught by it:
    the handler returns normally from an aborted transaction; that attempt cannot complete
    (its "caught" result is never kept, nor its write) and is retried with a fresh
    snapshot."""
    BARRIERS["conflict"] = threading.Barrier(2)
    ROLES["dsn"] = cyclone_dsn
    start_worker(txm_conflict_caught, concurrency=2)
    a = client.enqueue(txm_conflict_caught, "a")
    b = client.enqueue(txm_conflict_caught, "b")
    assert a.result(timeout=30) == "clean"
    assert b.result(timeout=30) == "clean"
    assert SEEN == ["b caught"]
    assert only_step(client, a.id).attempts == ()
    (failed,) = only_step(client, b.id).attempts
    assert "InFailedSqlTransaction" in (failed.error or ""), failed.error
    assert notes_of(ledger, a.id) == [(1, "a")]
    assert notes_of(ledger, b.id) == [(2, "b")]
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT balance FROM txm_accounts WHERE id = 1").fetchone() == (2,)
