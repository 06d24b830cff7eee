"""Audit: server and role settings that DBAs and managed PostgreSQL services impose
(``ALTER ROLE ... SET``) on the role Cyclone connects as. Each setting, one at a time, on
a login role with exactly the grants deploy.md lists: submit, a workflow with a join, a
retry, a timer (the ``clock`` fixture), a signal and a child run, a cancel, and the CLI's
``stats`` and ``runs``. Expected: everything works, or a documented typed error at start;
never a hang, lost work, a hot error loop, or a raw driver error from the public API."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from cyclone_dsl import (
    Client,
    CycloneError,
    RunState,
    StepContext,
    Worker,
    child,
    step,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.errors import SubmitContended
from cyclone_dsl.testing import set_clock_shift
from tests.cli.runner import in_process
from tests.roles import application_role
from tests.waiting import wait_until

Clock = Callable[[timedelta], None]
CALLS: Counter[str] = Counter()
_lock = threading.Lock()


def count(tag: str) -> None:
    with _lock:
        CALLS[tag] += 1


# -- handlers ---------------------------------------------------------------------------------


@step(name="hss_add")
def hss_add(x: int) -> int:
    count("add")
    return x + 1


@step(name="hss_flaky", max_attempts=3)
def hss_flaky(x: int, ctx: StepContext) -> int:
    count(f"flaky:{ctx.attempt}")
    if ctx.attempt == 1:
        raise RuntimeError("hss flaky fails its first attempt")
    return x * 10


@step(name="hss_tx", transactional=True)
def hss_tx(x: int, ctx: StepContext) -> int:
    row = ctx.connection.execute("SELECT %s::int + 100", (x,)).fetchone()
    assert row is not None
    return int(row[0])


@step(name="hss_join")
def hss_join(parts: list[object]) -> list[object]:
    count("join")
    return parts


@workflow(name="hss_child_flow")
def hss_child_flow(x):  # type: ignore[no-untyped-def]
    return hss_add(x)


@workflow(name="hss_flow")
def hss_flow(x):  # type: ignore[no-untyped-def]
    timer = wait_timer(timedelta(hours=1))
    return hss_join(
        [hss_add(x), hss_flaky(x), wait_signal("hss_go"), child(hss_child_flow, x), hss_tx(x)],
        after=[timer],
    )


@workflow(name="hss_waiter")
def hss_waiter(x):  # type: ignore[no-untyped-def]
    return hss_add(x, after=[wait_signal("hss_never")])


HANDLERS = (hss_add, hss_flaky, hss_tx, hss_join, hss_flow, hss_child_flow, hss_waiter)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    CALLS.clear()
    yield
    set_clock_shift(timedelta(0))


class Role:
    def __init__(self, name: str, dsn: str, admin_dsn: str) -> None:
        self.name = name
        self.dsn = dsn
        self.admin_dsn = admin_dsn

    def set(self, setting: str, value: str) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER ROLE {} SET {} = {}").format(
                    sql.Identifier(self.name), sql.Identifier(setting.lower()), sql.Literal(value)
                )
            )

    def show(self, setting: str) -> str:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(
                sql.SQL("SHOW {}").format(sql.Identifier(setting.lower()))
            ).fetchone()
        assert row is not None
        return str(row[0])


def schema_of(dsn: str) -> str:
    options = str(conninfo_to_dict(dsn).get("options") or "")
    return options.split("search_path=")[1].split()[0]


@pytest.fixture
def hss_role(cyclone_dsn: str, cyclone_admin_dsn: str) -> Iterator[Role]:
    """A login role with exactly the grants deploy.md lists for the application."""
    with application_role(cyclone_admin_dsn, schema_of(cyclone_dsn), prefix="hss") as made:
        dsn, role = made
        yield Role(role, dsn, cyclone_admin_dsn)


class Records(logging.Handler):
    """Every record of Cyclone's loggers at WARNING or above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        # A worker says once which loaded workflows it cannot serve: other test modules'
        # broken ones, when they share this process.
        if not record.getMessage().startswith("not serving workflow"):
            self.records.append(record)

    def lines(self) -> list[str]:
        return [f"{r.name} {r.levelname} {r.getMessage()[:200]}" for r in self.records]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("cyclone")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def not_raw(exc: BaseException) -> None:
    """A failure the public API let through must be Cyclone's, not the driver's."""
    assert isinstance(exc, CycloneError), f"raw {type(exc).__module__}.{type(exc).__name__}: {exc}"


def exercise(dsn: str, clock: Clock, records: Records, *, pooled: bool = False) -> None:
    """The whole tour on ``dsn``: submit, join, retry, timer, signal, child, cancel, CLI
    (``pooled``: as through a transaction-mode pooler, so no ``options`` are sent)."""
    with (
        Client(dsn, pooled=pooled) as client,
        Worker(dsn, HANDLERS, poll_interval=0.5, scan_interval=0.5, grace=5.0, pooled=pooled),
    ):
        created = datetime.now(UTC)
        for where in ("UTC", "Pacific/Chatham", "Europe/Berlin"):
            daily = client.schedule(
                hss_add, "30 9 * * *", id=f"hss_daily_{where}", input=1, location=where
            )
            local = daily.next_run_at.astimezone(ZoneInfo(where))
            assert (local.hour, local.minute) == (9, 30), (where, daily.next_run_at)
            assert timedelta(0) < daily.next_run_at - created <= timedelta(days=1, hours=1)
            client.unschedule(daily.id)
        run = client.submit(hss_flow, 4, deadline=timedelta(days=3))
        assert client.signal(run.id, "hss_go", {"ok": 1}) is not None
        cancelled = client.submit(hss_waiter, 1)
        wait_until(
            lambda: CALLS["flaky:2"] == 1 or CALLS["join"] > 0,
            timeout=30,
            what="the flaky step's retry",
        )
        clock(timedelta(hours=2))  # the timer (and any retry backoff) comes due
        assert run.result(timeout=30) == [5, 40, {"ok": 1}, 5, 104]
        got = run.get()
        assert got.state == RunState.COMPLETED
        assert got.deadline_at is not None
        length = got.deadline_at.astimezone(UTC) - got.created_at.astimezone(UTC)
        assert abs(length - timedelta(days=3)) < timedelta(seconds=5)
        assert abs(got.created_at.astimezone(UTC) - created) < timedelta(minutes=5)
        (timer,) = [s for s in got.steps if s.kind == "@timer"]
        assert timer.state.value == "completed"
        client.cancel(cancelled.id)
        assert cancelled.get().state == RunState.CANCELLED
        assert CALLS["flaky:1"] == 1 and CALLS["flaky:2"] == 1 and CALLS["join"] == 1
        cli = in_process(dsn)
        flags = ["--pooled"] if pooled else []
        stats = cli(*flags, "stats")
        assert stats.returncode == 0, stats.stderr
        listed = cli(*flags, "runs")
        assert listed.returncode == 0, listed.stderr
        assert str(run.id) in listed.stdout
    assert len(records.records) < 10, records.lines()


# -- settings that must leave everything working ----------------------------------------------

SETTINGS: dict[str, list[tuple[str, str]]] = {
    # Timeouts together, for the time budget: each alone passed too.
    "timeouts": [
        ("statement_timeout", "200ms"),
        ("lock_timeout", "50ms"),
        ("idle_in_transaction_session_timeout", "500ms"),
    ],
    "serializable": [("default_transaction_isolation", "serializable")],
    # Display settings together, for the time budget: each alone passed too.
    "display": [
        ("TimeZone", "Pacific/Chatham"),
        ("IntervalStyle", "postgres_verbose"),
        ("client_min_messages", "debug5"),
    ],
    "datestyle_sql_dmy": [("DateStyle", "SQL, DMY")],
    "jit_always": [("jit", "on"), ("jit_above_cost", "0")],
    # Planner knobs: plans may change, results must not (together, for the time budget).
    "planner_costs": [
        ("work_mem", "64kB"),
        ("random_page_cost", "0.01"),
        ("seq_page_cost", "50"),
        ("cpu_tuple_cost", "10"),
    ],
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_hss_the_tour_works_under_a_role_setting(
    hss_role: Role, clock: Clock, records: Records, setting: str
) -> None:
    for name, value in SETTINGS[setting]:
        hss_role.set(name, value)
    name, value = SETTINGS[setting][0]
    assert hss_role.show(name) != ""  # the role's sessions have it
    try:
        exercise(hss_role.dsn, clock, records)
    except AssertionError:
        raise
    except BaseException as exc:
        not_raw(exc)
        raise


#: The settings a direct connection overrides in ``options`` (idle_in_transaction_session_timeout,
#: default_transaction_isolation, DateStyle): with ``pooled=True`` the role's apply to
#: Cyclone's sessions, but for DateStyle, which a pooled session sets if it must.
POOLED_SETTINGS = ["timeouts", "serializable", "datestyle_sql_dmy"]


@pytest.mark.parametrize("setting", POOLED_SETTINGS)
def test_hss_the_tour_works_pooled_under_a_role_setting(
    hss_role: Role, clock: Clock, records: Records, setting: str
) -> None:
    """With ``pooled=True`` no ``options`` are sent: the role's settings are the sessions'
    (scale.md: set them on the role)."""
    for name, value in SETTINGS[setting]:
        hss_role.set(name, value)
    try:
        exercise(hss_role.dsn, clock, records, pooled=True)
    except AssertionError:
        raise
    except BaseException as exc:
        not_raw(exc)
        raise


# -- DateStyle: psycopg reads timestamps in ISO only ---------------------------------------------


def test_hss_a_worker_serves_a_role_whose_datestyle_is_not_iso(
    hss_role: Role, client: Client
) -> None:
    """``ALTER ROLE app SET DateStyle = 'SQL, DMY'`` (a European DBA's default): the
    worker must serve steps, or refuse at start with a typed error, never start and die."""
    hss_role.set("DateStyle", "SQL, DMY")
    with Client(hss_role.dsn) as on_role:
        handle = on_role.enqueue(hss_add, 1)
        worker = Worker(hss_role.dsn, [hss_add], poll_interval=0.5, scan_interval=0.5, grace=5.0)
        try:
            worker.start()
        except CycloneError:
            return  # refused at start, typed: acceptable
        try:
            wait_until(
                lambda: (
                    worker.error is not None
                    or client.get_run(handle.id).state == RunState.COMPLETED
                ),
                timeout=20,
                what="the worker to run the step",
            )
            assert worker.error is None, f"the worker died: {worker.error!r}"
            assert client.result(handle.id, timeout=20) == 2
        finally:
            with contextlib.suppress(CycloneError):
                worker.stop()


def test_hss_a_client_reads_runs_on_a_role_whose_datestyle_is_not_iso(hss_role: Role) -> None:
    hss_role.set("DateStyle", "SQL, DMY")
    with Client(hss_role.dsn) as client:
        handle = client.enqueue(hss_add, 1)
        try:
            got = handle.get()
        except BaseException as exc:
            not_raw(exc)
            raise
        assert got.state == RunState.RUNNING or got.state.value == "pending"
        try:
            client.list_runs()
        except BaseException as exc:
            not_raw(exc)
            raise


def test_hss_cli_runs_on_a_role_whose_datestyle_is_not_iso(hss_role: Role) -> None:
    hss_role.set("DateStyle", "SQL, DMY")
    with Client(hss_role.dsn) as client:
        run = client.enqueue(hss_add, 1)
    listed = in_process(hss_role.dsn)("runs")
    assert listed.returncode == 0, listed.stderr
    assert str(run.id) in listed.stdout
    assert "Traceback" not in listed.stderr


# -- a read-only role --------------------------------------------------------------------------


def test_hss_a_client_on_a_read_only_role_gets_a_typed_error(hss_role: Role) -> None:
    """``default_transaction_read_only = on`` (a role meant for a replica or for reporting):
    a submit cannot write; the caller gets Cyclone's error, not the driver's."""
    hss_role.set("default_transaction_read_only", "on")
    caught: BaseException | None = None
    try:
        with Client(hss_role.dsn) as client:
            client.enqueue(hss_add, 1)
    except Exception as exc:
        caught = exc
    assert caught is not None, "a submit on a read-only role succeeded"
    not_raw(caught)
    assert "read-only" in str(caught) or "read only" in str(caught), str(caught)


def test_hss_a_worker_on_a_read_only_role_fails_at_start_with_a_typed_error(
    hss_role: Role, records: Records
) -> None:
    hss_role.set("default_transaction_read_only", "on")
    worker = Worker(hss_role.dsn, [hss_add], poll_interval=0.5, scan_interval=0.5, grace=5.0)
    try:
        worker.start()
    except BaseException as exc:
        not_raw(exc)
        return
    try:
        # Started: it must not sit there failing every claim and scan in a loop.
        wait_until(lambda: worker.error is not None, timeout=5, what="the worker to give up")
    except AssertionError:
        pytest.fail(
            f"the worker started on a read-only role and keeps running; "
            f"{len(records.records)} log records: {records.lines()[:5]}"
        )
    finally:
        with contextlib.suppress(CycloneError):
            worker.stop()
    pytest.fail(f"the worker started, then died: {worker.error!r}")


# -- idle_session_timeout: the server ends idle sessions ---------------------------------------


def test_hss_a_client_outlives_the_servers_idle_session_timeout(hss_role: Role) -> None:
    """``idle_session_timeout = 1s`` (set by some managed services and DBAs to reap idle
    sessions): the server ends the pool's idle connections; the client's next calls must
    still work (the session was ended before the call sent anything: nothing to doubt)."""
    hss_role.set("idle_session_timeout", "1s")
    failures: list[str] = []
    with Client(hss_role.dsn) as client:
        # Four calls at once: the pool holds four connections, then they all sit idle.
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: client.enqueue(hss_add, i), range(8)))
        time.sleep(1.6)  # the server ends the pool's idle sessions
        for i in range(6):
            try:
                client.enqueue(hss_add, i)
            except BaseException as exc:
                not_raw(exc)
                failures.append(f"{type(exc).__name__}: {str(exc)[:120]}")
    assert failures == [], failures


def test_hss_a_worker_outlives_the_servers_idle_session_timeout(
    hss_role: Role, client: Client, records: Records
) -> None:
    """The worker's own sessions (pool, heartbeats, LISTEN) sit idle past the timeout: it
    must go on serving, without a warning a second for as long as it stays idle."""
    hss_role.set("idle_session_timeout", "1s")
    with Worker(hss_role.dsn, [hss_add], grace=5.0) as worker:  # default poll and scan: 1 s
        assert client.enqueue(hss_add, 1).result(timeout=20) == 2
        time.sleep(3.5)  # idle: its sessions sit idle past the timeout
        assert client.enqueue(hss_add, 2).result(timeout=20) == 3
        assert worker.error is None
    assert len(records.records) < 3, records.lines()


# -- what Cyclone sets per session, against the role's settings ---------------------------------


@step(name="hss_settings", transactional=True)
def hss_settings(_: object, ctx: StepContext) -> dict[str, str]:
    shown: dict[str, str] = {}
    for name in ("transaction_isolation", "jit", "idle_in_transaction_session_timeout"):
        row = ctx.connection.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
        assert row is not None
        shown[name] = str(row[0])
    time.sleep(1.0)  # idle in the transaction, past the role's 500 ms
    ctx.connection.execute("SELECT 1")
    return shown


def test_hss_a_transactional_step_gets_the_documented_session_settings(
    hss_role: Role, client: Client
) -> None:
    """transactional-steps.md / deploy.md: the handler's transaction is read committed by
    default, keeps the server's (here the role's) JIT for the user's SQL, and is ended when
    idle longer than the worker's lease, not the role's shorter timeout."""
    hss_role.set("default_transaction_isolation", "serializable")
    hss_role.set("jit", "on")
    hss_role.set("idle_in_transaction_session_timeout", "500ms")
    with Worker(hss_role.dsn, [hss_settings], poll_interval=0.5, scan_interval=0.5, lease=30):
        shown = client.enqueue(hss_settings, None).result(timeout=30)
    assert shown == {
        "transaction_isolation": "read committed",
        "jit": "on",
        "idle_in_transaction_session_timeout": "30s",
    }


# -- lock_timeout: a key held by another transaction ---------------------------------------------


@pytest.mark.parametrize(
    "setting",
    ["lock_timeout=50ms", "statement_timeout=200ms"],
    ids=["lock_timeout", "statement_timeout"],
)
def test_hss_a_unique_key_held_by_an_open_transaction_under_a_short_timeout(
    hss_role: Role, cyclone_dsn: str, client: Client, setting: str
) -> None:
    """``lock_timeout = 50ms`` (or ``statement_timeout = 200ms``) on the role: an enqueue
    whose unique key another open transaction is inserting waits for a lock; it must end
    with the holder's run, or with a typed error, never the driver's LockNotAvailable or
    QueryCanceled."""
    name, value = setting.split("=")
    hss_role.set(name, value)
    with psycopg.connect(cyclone_dsn) as conn:  # a transaction open on the key
        holder = client.enqueue_tx(conn, hss_add, 1, unique_key="hss-key")
        with Client(hss_role.dsn) as on_role, ThreadPoolExecutor(1) as pool:
            second = pool.submit(on_role.enqueue, hss_add, 2, unique_key="hss-key")
            time.sleep(0.4)
            conn.commit()
            try:
                got = second.result(timeout=20)
            except SubmitContended:
                return  # typed, and nothing written: trying again is safe (ten looks failed)
            except BaseException as exc:
                not_raw(exc)
                raise
    assert got.id == holder.id and not got.created


# -- search_path: another schema with tables of the same names first ---------------------------


@pytest.fixture
def decoy(hss_role: Role, cyclone_dsn: str, cyclone_admin_dsn: str) -> Iterator[str]:
    """A schema holding empty tables named as Cyclone's (version tables copied, so it looks
    current), readable and writable by the role, put first in the role's search_path."""
    real = schema_of(cyclone_dsn)
    name = f"hss_decoy_{secrets.token_hex(4)}"
    with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        tables = [
            str(row[0])
            for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", (real,)
            ).fetchall()
        ]
        for table in tables:
            conn.execute(
                sql.SQL("CREATE TABLE {}.{} (LIKE {}.{} INCLUDING DEFAULTS)").format(
                    sql.Identifier(name),
                    sql.Identifier(table),
                    sql.Identifier(real),
                    sql.Identifier(table),
                )
            )
            if "version" in table:
                conn.execute(
                    sql.SQL("INSERT INTO {}.{} SELECT * FROM {}.{}").format(
                        sql.Identifier(name),
                        sql.Identifier(table),
                        sql.Identifier(real),
                        sql.Identifier(table),
                    )
                )
        role = sql.Identifier(hss_role.name)
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(name), role))
        conn.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {} TO {}").format(
                sql.Identifier(name), role
            )
        )
    hss_role.set("search_path", f"{name}, {real}")
    try:
        yield name
    finally:
        with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def test_hss_the_dsns_search_path_wins_over_the_roles(
    hss_role: Role, decoy: str, cyclone_admin_dsn: str, clock: Clock, records: Records
) -> None:
    """The DSN names Cyclone's schema in ``options``; the role's search_path puts another
    schema with tables of the same names first. Every Cyclone session (pool, LISTEN,
    heartbeats, transactional handlers, events, the CLI) must use the DSN's schema."""
    exercise(hss_role.dsn, clock, records)
    with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
        tables = [
            str(row[0])
            for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", (decoy,)
            ).fetchall()
        ]
        written = {
            table: n
            for table in tables
            if "version" not in table
            for (n,) in [
                conn.execute(
                    sql.SQL("SELECT count(*) FROM {}.{}").format(
                        sql.Identifier(decoy), sql.Identifier(table)
                    )
                ).fetchone()
                or (0,)
            ]
            if n
        }
    assert written == {}
