"""Audit of the user documentation as a new user reads it (part C): docs/guarantees.md,
docs/reference/errors.md and docs/reference/api.md (whose entries are the docstrings of
the public objects, rendered by mkdocstrings).

Each test checks one of the pages' concrete claims through the public API against the
real database: where the errors are importable from, their classes, attributes and
message shapes, the signatures and defaults of the API reference, and the "typed refusal,
nothing written" guarantee under bad input.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import socket
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import cyclone_dsl
from cyclone_dsl import (
    AlreadyTerminal,
    AsyncClient,
    AsyncRunHandle,
    Client,
    Concurrency,
    CycloneError,
    DatabaseUnavailable,
    Delivery,
    InvalidArgument,
    InvalidGraph,
    InvalidPayload,
    InvalidTransition,
    MailboxFull,
    NodeRef,
    NoOutput,
    PayloadTooLarge,
    RateLimit,
    Ref,
    RunFailed,
    RunFilter,
    RunHandle,
    RunNotFound,
    RunState,
    SignalNotDeliverable,
    StepContext,
    UnknownDefinition,
    UnknownKind,
    UnknownWorkflow,
    Worker,
    action,
    for_each,
    migrate,
    step,
    wait_n,
    wait_signal,
    workflow,
)
from cyclone_dsl import errors as cyclone_errors
from cyclone_dsl.errors import SchemaVersionMismatch
from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path
from tests.roles import limited_role

StartWorker = Callable[..., Worker]

MIB = 1024 * 1024
LIMIT = 16 * MIB  # "payload byte limit (16 MiB by default)", guarantees.md:16
SECRET = "dwc-s3cret-pw"


# --- handlers (names are global in the process: every one starts with dwc_) -------------


@step(name="dwc_echo")
def dwc_echo(x: object) -> object:
    return x


@action(name="dwc_act")
def dwc_act(x: object) -> None:
    return None


@step(name="dwc_huge_output", max_attempts=1)
def dwc_huge_output(size: int) -> str:
    return "x" * size


@step(name="dwc_tx", transactional=True)
def dwc_tx(x: object, ctx: StepContext) -> object:
    return x


@workflow(name="dwc_flow")
def dwc_flow(inp: Ref[object]) -> NodeRef[object]:
    return dwc_echo(inp)


@workflow(name="dwc_signalled")
def dwc_signalled(inp: Ref[object]) -> NodeRef[object]:
    got: NodeRef[object] = wait_signal("go")
    return dwc_echo(got)


@workflow(name="dwc_quorum")
def dwc_quorum(inp: Ref[object]) -> NodeRef[object]:
    got: NodeRef[object] = wait_n("vote", 2)
    return dwc_echo(got)


@workflow(name="dwc_no_result")
def dwc_no_result(inp: Ref[object]) -> None:
    dwc_act(inp)


def _nothing_written(client: Client) -> None:
    assert client.run_counts() == {}
    assert client.list_runs() == []


def _one_line(text: str) -> None:
    assert "\n" not in text, text


# =========================================================================================
# errors.md and api.md: where the errors are, what they are
# =========================================================================================

# Every error class errors.md names in its prose, and those the API reference's docstrings
# say a call raises (Client.retry: NodeNotFound, Client.unschedule: ScheduleError), plus
# migrate_versions, which the migrate() entry of api.md points to.
_DOCUMENTED_NAMES = [
    "InvalidGraph",
    "BuildTimeValue",
    "DatabaseUnavailable",
    "InvalidArgument",
    "SchemaVersionMismatch",
    "MigrationPermissionDenied",
    "MigrationError",
    "MigrationLockTimeout",
    "NodeNotFound",
    "ScheduleError",
    "migrate_versions",
]


def test_dwc_every_documented_error_is_importable_from_cyclone_dsl() -> None:
    missing = [name for name in _DOCUMENTED_NAMES if not hasattr(cyclone_dsl, name)]
    assert missing == []
    # and every error class of cyclone_dsl.errors: api.md, "everything public"
    unexported = [
        name
        for name, obj in vars(cyclone_errors).items()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__ == "cyclone_dsl.errors"
        and name not in cyclone_dsl.__all__
    ]
    assert unexported == []


def test_dwc_the_error_tree_of_the_errors_module_shows_each_class_under_its_base() -> None:
    """The module's docstring draws the tree: every class, each under its first base."""
    doc = cyclone_errors.__doc__ or ""
    tree = [line for line in doc.splitlines() if "── " in line or line.strip() == "CycloneError"]
    depth_of: dict[str, int] = {}
    parents: dict[str, str] = {}
    stack: list[str] = []
    for line in tree:
        name = line.split("── ")[-1].split()[0] if "── " in line else "CycloneError"
        prefix = len(line) - len(line.lstrip(" │├└─"))  # "    ├── ": 8, one level down: 12
        depth = (prefix - 4) // 4 if "── " in line else 0
        depth_of[name] = depth
        del stack[depth:]
        if stack:
            parents[name] = stack[-1]
        stack.append(name)
    for name, obj in vars(cyclone_errors).items():
        if isinstance(obj, type) and issubclass(obj, cyclone_errors.CycloneError):
            if obj is cyclone_errors.CycloneError:
                continue
            assert name in parents, f"{name} is not in the tree"
            assert parents[name] == obj.__mro__[1].__name__, name


def test_dwc_the_documented_errors_exist_in_cyclone_dsl_errors_with_their_bases() -> None:
    errors = cyclone_errors
    # errors.md:12 "BuildTimeValue (a TypeError)"
    assert issubclass(errors.BuildTimeValue, TypeError)
    assert issubclass(errors.BuildTimeValue, CycloneError)
    # errors.md:30, 42: "(a MigrationError)"
    assert issubclass(errors.MigrationPermissionDenied, errors.MigrationError)
    assert issubclass(errors.MigrationLockTimeout, errors.MigrationError)
    assert issubclass(errors.SchemaVersionMismatch, CycloneError)
    # the tree of the errors module: InvalidArgument is also a ValueError
    assert issubclass(InvalidArgument, ValueError)
    # the classes cyclone_dsl exports are the very classes of cyclone_dsl.errors
    for name in cyclone_dsl.__all__:
        obj = getattr(cyclone_dsl, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert getattr(errors, name) is obj, name


def _tree() -> list[tuple[int, str]]:
    """(depth, class name) of each line of the tree in the errors module's docstring."""
    doc = cyclone_errors.__doc__ or ""
    rows: list[tuple[int, str]] = []
    for line in doc.splitlines():
        found = re.match(r"^\s*((?:│   |    )*)[├└]── (\w+)", line)
        if found:
            rows.append((len(found.group(1)) // 4 + 1, found.group(2)))
    return rows


def test_dwc_the_error_tree_of_the_reference_matches_the_classes() -> None:
    rows = _tree()
    assert len(rows) >= 25, rows
    parents: list[str] = ["CycloneError"]
    for depth, name in rows:
        del parents[depth:]
        cls = getattr(cyclone_errors, name)
        assert issubclass(cls, getattr(cyclone_errors, parents[-1])), (name, parents[-1])
        parents.append(name)


def test_dwc_error_attributes_and_message_shapes() -> None:
    payload = InvalidPayload("$.items[3].name", "nan is not valid JSON")
    assert (payload.path, payload.reason) == ("$.items[3].name", "nan is not valid JSON")
    too_large = PayloadTooLarge("the run input", 20, 10)
    assert (too_large.what, too_large.size, too_large.limit) == ("the run input", 20, 10)
    unavailable = DatabaseUnavailable("cannot connect", "timeout")
    assert unavailable.cause == "timeout"
    graph = InvalidGraph("dwc_w", [("a", "first"), (None, "second"), ("a", "third")])
    assert graph.problems == ("first", "second", "third")
    assert graph.node_ids == ("a",)
    assert str(graph) == "workflow 'dwc_w' is invalid:\n  - [a] first\n  - second\n  - [a] third"


# =========================================================================================
# api.md: signatures and defaults as the reference states them
# =========================================================================================


def _defaults(fn: Any) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def test_dwc_worker_signature_defaults_are_the_documented_ones() -> None:
    d = _defaults(Worker)
    assert d["queues"] == ("default",)
    assert d["lease"] == 30.0
    assert d["poll_interval"] == 1.0
    assert d["grace"] == 30.0
    assert d["scan_interval"] == 1.0
    assert d["max_reclaims"] == 3
    assert d["batch_size"] == 100
    assert d["max_output_bytes"] == LIMIT  # the 16 MiB payload limit of guarantees.md
    assert d["retention"] == timedelta(days=7)
    assert d["processes"] == 1  # "The default is 1 (this process)"
    assert d["max_events_per_step"] == 10_000
    assert d["concurrency"] is None and d["max_concurrency"] is None and d["max_async"] is None


def test_dwc_other_documented_defaults() -> None:
    assert _defaults(Concurrency) == {"key": None, "limit": 1}  # "At most limit at once"
    assert _defaults(RateLimit)["units"] == 1
    fe = _defaults(for_each)
    assert (fe["max_parallel"], fe["max_bytes"]) == (0, 0)  # "0: no limit"
    assert _defaults(migrate)["lock_timeout"] == 60.0
    assert _defaults(Client.list_runs)["limit"] == 50
    assert _defaults(Client.purge)["older_than"] == timedelta(0)
    assert set(_defaults(Client.purge)["states"]) == {
        RunState.COMPLETED,
        RunState.FAILED,
        RunState.CANCELLED,
    }
    assert _defaults(RunHandle)["created"] is True
    # the step options are keyword-only, the handler positional-only
    params = inspect.signature(step).parameters
    assert params["fn"].kind is inspect.Parameter.POSITIONAL_ONLY
    assert all(
        p.kind is inspect.Parameter.KEYWORD_ONLY for name, p in params.items() if name != "fn"
    )
    assert inspect.signature(step).parameters.keys() == inspect.signature(action).parameters.keys()


def _public_methods(cls: type) -> dict[str, Any]:
    return {n: v for n, v in vars(cls).items() if not n.startswith("_") and callable(v)}


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_dwc_async_client_has_every_client_method_with_the_same_parameters() -> None:
    """AsyncClient: "Every method of Client, with the same parameters, as a coroutine
    (except handle, which does no I/O)"."""
    sync, aio = _public_methods(Client), _public_methods(AsyncClient)
    assert sync.keys() == aio.keys()
    for name in sync:
        assert _params(sync[name]) == _params(aio[name]), name
        if name == "handle":
            assert not inspect.iscoroutinefunction(aio[name])
        elif name == "events":
            assert inspect.isasyncgenfunction(aio[name]) or not inspect.iscoroutinefunction(
                aio[name]
            )
        else:
            assert inspect.iscoroutinefunction(aio[name]), name
    rs, ra = _public_methods(RunHandle), _public_methods(AsyncRunHandle)
    assert rs.keys() == ra.keys()
    for name in rs:
        assert _params(rs[name]) == _params(ra[name]), name


# =========================================================================================
# Worker (api.md): effective defaults, refused options, runs once
# =========================================================================================


def test_dwc_worker_effective_concurrency_limits(start_worker: StartWorker) -> None:
    """ "from 10 up to max_concurrency (default 256, or 32 when the worker serves
    transactional handlers) ... from 100 up to max_async (default 10,000)"."""
    plain = start_worker(dwc_echo).settings()
    assert plain.adaptive
    assert (plain.concurrency, plain.max_concurrency) == (10, 256)
    assert (plain.async_concurrency, plain.max_async) == (100, 10_000)
    assert plain.batch_size == 100
    transactional = start_worker(dwc_echo, dwc_tx).settings()
    assert transactional.max_concurrency == 32
    fixed = start_worker(dwc_echo, concurrency=3).settings()
    assert not fixed.adaptive and fixed.concurrency == 3


@pytest.mark.parametrize(
    "option",
    [
        {"lease": 0},
        {"lease": -1.0},
        {"lease": math.nan},
        {"lease": math.inf},
        {"lease": True},
        {"poll_interval": 1e-7},  # under a microsecond
        {"scan_interval": "1"},
        {"grace": -0.5},
        {"grace": 9223372037.0},  # past what a thread can wait
        {"max_reclaims": -1},
        {"max_reclaims": 1.5},
        {"max_output_bytes": -1},
    ],
)
def test_dwc_worker_refuses_bad_durations_and_counts(
    cyclone_dsn: str, option: dict[str, Any]
) -> None:
    with pytest.raises(InvalidArgument):
        Worker(cyclone_dsn, [dwc_echo], **option)


def test_dwc_worker_accepts_the_documented_extremes(cyclone_dsn: str) -> None:
    """ "from a microsecond up to what a thread can wait (about 292 years); grace may be 0;
    max_reclaims and max_output_bytes are integers >= 0"."""
    Worker(
        cyclone_dsn,
        [dwc_echo],
        lease=1e-6,
        poll_interval=9223372036.0,
        grace=0,
        max_reclaims=0,
        max_output_bytes=0,
    )


def test_dwc_a_worker_runs_once(start_worker: StartWorker) -> None:
    worker = start_worker(dwc_echo)
    with pytest.raises(InvalidTransition):
        worker.start()
    worker.stop()
    with pytest.raises(InvalidTransition):
        worker.start()
    worker.stop()  # "at once for a worker that is not running"


# =========================================================================================
# guarantees.md "Typed refusal": bad input is refused with a typed error, nothing written
# =========================================================================================


def test_dwc_an_invalid_graph_is_refused_at_submit_and_worker_start_writing_nothing(
    client: Client, cyclone_dsn: str
) -> None:
    @workflow(name="dwc_broken")
    def dwc_broken(inp: Ref[object]) -> None:
        echo: Any = dwc_echo  # the calls below are wrong on purpose
        echo(inp, inp, node_id="twice")
        echo(inp, bogus_option=1)

    with pytest.raises(InvalidGraph) as at_submit:
        client.submit(dwc_broken, 1)
    bad = at_submit.value
    assert bad.workflow == "dwc_broken"
    assert "twice" in bad.node_ids and len(bad.problems) >= 2, bad.problems
    assert str(bad).startswith("workflow 'dwc_broken' is invalid:\n  - ")
    with pytest.raises(InvalidGraph):
        client.submit_many(dwc_broken, [1, 2])
    with pytest.raises(InvalidGraph):
        Worker(cyclone_dsn, [dwc_broken], poll_interval=0.2).start()
    _nothing_written(client)


_DEEP: dict[str, Any] = {"items": [0, 1, 2, {"name": math.nan}]}


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (_DEEP, "$.items[3].name"),
        ({"a": {1, 2}}, "$.a"),
        ({"a": [b"bytes"]}, "$.a[0]"),
        ({"ok": 1, "bad": math.inf}, "$.bad"),
        ({"a": "nul\x00"}, "$.a"),
        ({"a": ["\ud800"]}, "$.a[0]"),
    ],
)
def test_dwc_a_non_json_input_names_its_path_and_writes_nothing(
    client: Client, value: object, path: str
) -> None:
    bad: Any = value
    submits: list[Callable[[], object]] = [
        lambda: client.submit(dwc_flow, bad),
        lambda: client.enqueue(dwc_echo, bad),
        lambda: client.submit_once(dwc_flow, bad, key="dwc-k"),
    ]
    for submit in submits:
        with pytest.raises(InvalidPayload) as refused:
            submit()
        assert refused.value.path == path
        assert str(refused.value).startswith(f"invalid payload at {path}: ")
    _nothing_written(client)


def test_dwc_one_bad_input_in_a_batch_writes_none_of_the_batch(client: Client) -> None:
    with pytest.raises(InvalidPayload):
        client.submit_many(dwc_flow, [1, 2, {"x": math.nan}])
    with pytest.raises(InvalidPayload):
        client.enqueue_many(dwc_echo, [1, 2, {3}])  # type: ignore[list-item]
    with pytest.raises(PayloadTooLarge):
        client.enqueue_many(dwc_echo, [1, "x" * LIMIT])
    _nothing_written(client)


def test_dwc_unknown_definitions_are_typed_lookup_errors_and_write_nothing(
    client: Client,
) -> None:
    with pytest.raises(UnknownWorkflow) as wf:
        client.submit("dwc_no_such_workflow")
    assert isinstance(wf.value, UnknownDefinition) and isinstance(wf.value, LookupError)
    assert "dwc_no_such_workflow" in str(wf.value)
    with pytest.raises(UnknownKind) as kind:
        client.enqueue("dwc_no_such_kind")
    assert "dwc_no_such_kind" in str(kind.value)
    _nothing_written(client)


def test_dwc_the_payload_limit_is_16_mib_of_utf8_and_refuses_before_any_write(
    client: Client,
) -> None:
    # one byte over: refused, with the documented attributes and message
    with pytest.raises(PayloadTooLarge) as over:
        client.submit(dwc_flow, "x" * (LIMIT - 1))  # + 2 quotes = LIMIT + 1 bytes
    assert (over.value.size, over.value.limit) == (LIMIT + 1, LIMIT)
    expected = f"{over.value.what} is {LIMIT + 1} bytes, over the limit of {LIMIT} bytes"
    assert str(over.value) == expected
    # bytes, not characters: 8 Mi two-byte characters are over the limit
    with pytest.raises(PayloadTooLarge):
        client.enqueue(dwc_echo, "é" * (8 * MIB))
    _nothing_written(client)
    # exactly at the limit: accepted
    handle = client.enqueue(dwc_act, "x" * (LIMIT - 2))
    assert handle.created
    assert client.run_counts() == {"running": 1}


def test_dwc_signal_refusals_store_nothing(client: Client) -> None:
    run = client.submit(dwc_quorum, None)
    with pytest.raises(PayloadTooLarge) as big:
        client.signal(run.id, "vote", "x" * LIMIT)
    assert big.value.limit == LIMIT
    with pytest.raises(InvalidPayload):
        client.signal(run.id, "vote", {"a": math.nan})
    with pytest.raises(SignalNotDeliverable):
        client.signal(run.id, "dwc-nobody-waits-for-this", 1)
    assert client.signals_of(run.id) == []
    # capacity N for wait_n: two consumed, the third is refused with its attributes
    assert client.signal(run.id, "vote", 1) is Delivery.CONSUMED
    assert client.signal(run.id, "vote", 2) is Delivery.CONSUMED
    assert client.get_run(run.id).step("vote").state == "completed"
    assert client.signal(run.id, "vote", 3) is Delivery.NOT_STORED
    assert [s["payload"] for s in client.signals_of(run.id)] == [1, 2]


def test_dwc_mailbox_full_carries_run_name_and_capacity(client: Client) -> None:
    @workflow(name="dwc_late_wait")
    def dwc_late_wait(inp: Ref[object]) -> NodeRef[object]:
        first = dwc_echo(inp)
        got = wait_signal("late", after=first)
        return dwc_echo(got, node_id="after_late")

    run = client.submit(dwc_late_wait, 1)  # no worker: the wait is not active yet
    assert client.signal(run.id, "late", "a") is Delivery.BUFFERED
    with pytest.raises(MailboxFull) as full:
        client.signal(run.id, "late", "b")
    assert (full.value.run_id, full.value.name, full.value.capacity) == (run.id, "late", 1)
    assert str(full.value) == f"run {run.id}: the mailbox of signal 'late' is full (capacity 1)"
    assert [s["payload"] for s in client.signals_of(run.id)] == ["a"]


def test_dwc_ended_runs_raise_already_terminal_with_run_and_state(client: Client) -> None:
    run = client.submit(dwc_signalled, None)
    client.cancel(run.id)
    for call in (
        lambda: client.cancel(run.id),
        lambda: client.signal(run.id, "go", 1),
        lambda: client.pause(run.id),
    ):
        with pytest.raises(AlreadyTerminal) as ended:
            call()
        assert (ended.value.run_id, ended.value.state) == (run.id, "cancelled")
        assert str(ended.value).startswith(f"run {run.id} is already cancelled")
    assert client.signals_of(run.id) == []
    with pytest.raises(RunFailed) as failed:
        run.result(timeout=10)
    f = failed.value
    assert (f.run_id, f.state, f.node, f.error_kind) == (run.id, "cancelled", "go", "cancelled")


def test_dwc_an_output_over_the_default_limit_fails_its_step_with_output_limit(
    start_worker: StartWorker, client: Client
) -> None:
    """guarantees.md:13 "a 50 MB output fails its step with output_limit" (here just over
    the default 16 MiB of max_output_bytes)."""
    start_worker(dwc_huge_output)
    run = client.enqueue(dwc_huge_output, LIMIT)  # + 2 quotes: over the limit
    with pytest.raises(RunFailed) as failed:
        run.result(timeout=30)
    assert failed.value.error_kind == "output_limit"
    assert client.get_run(run.id).steps[0].output is None


_HOSTILE = 'it\'s "q"; DROP TABLE cyclone_runs; -- %s %(x)s 😀'


def test_dwc_hostile_names_are_stored_byte_for_byte(
    start_worker: StartWorker, client: Client
) -> None:
    @step(name="dwc_" + _HOSTILE)
    def dwc_hostile(x: object) -> object:
        return x

    queue = (_HOSTILE * 10).encode()[:252].decode("utf-8", "ignore")
    queue += "😀" * ((256 - len(queue.encode())) // 4)
    queue += "q" * (256 - len(queue.encode()))
    assert len(queue.encode()) == 256
    start_worker(dwc_hostile, queues=[queue])
    run = client.enqueue(dwc_hostile, _HOSTILE, queue=queue, unique_key=_HOSTILE)
    assert run.result(timeout=20) == _HOSTILE
    got = client.get_run(run.id)
    assert got.workflow == "dwc_" + _HOSTILE
    assert (got.steps[0].kind, got.steps[0].queue) == ("dwc_" + _HOSTILE, queue)
    once = client.submit_once(dwc_signalled, None, key=_HOSTILE)
    assert client.get_run(once.id).submit_key == _HOSTILE
    assert not client.submit_once(dwc_signalled, None, key=_HOSTILE).created
    with pytest.raises(InvalidArgument):
        client.enqueue(dwc_hostile, 1, queue=queue + "q")  # 257 bytes
    with pytest.raises(InvalidArgument):
        client.enqueue(dwc_hostile, 1, queue="😀" * 65)  # 65 characters, 260 bytes


# =========================================================================================
# guarantees.md "Atomic transitions" / "Uniqueness": the caller's transaction
# =========================================================================================


@pytest.fixture
def dwc_unmigrated_dsn(cyclone_admin_dsn: str) -> Iterator[str]:
    name = create_schema(cyclone_admin_dsn, migrated=False)
    try:
        yield with_search_path(cyclone_admin_dsn, name)
    finally:
        drop_schema(cyclone_admin_dsn, name)


def test_dwc_a_submit_tx_that_fails_in_the_database_leaves_the_callers_transaction_usable(
    client: Client, dwc_unmigrated_dsn: str
) -> None:
    """Client.submit_tx: "The writes run in a savepoint: if the submit fails, nothing of
    it stays in the caller's transaction." (a connection that cannot see Cyclone's
    tables makes the submit fail inside the database)."""
    with psycopg.connect(dwc_unmigrated_dsn) as conn:
        conn.execute("CREATE TABLE dwc_mine (x int)")
        conn.execute("INSERT INTO dwc_mine VALUES (1)")
        with pytest.raises(Exception, match="cyclone_runs"):  # its type: the next test
            client.submit_tx(conn, dwc_flow, 1)
        assert conn.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS
        conn.execute("INSERT INTO dwc_mine VALUES (2)")
        conn.commit()
        assert conn.execute("SELECT count(*) FROM dwc_mine").fetchone() == (2,)


def test_dwc_submit_tx_on_a_connection_without_cyclone_tables_is_a_typed_error(
    client: Client, dwc_unmigrated_dsn: str
) -> None:
    with psycopg.connect(dwc_unmigrated_dsn) as conn:
        conn.execute("CREATE TABLE dwc_mine (x int)")
        with pytest.raises(SchemaVersionMismatch, match="cyclone migrate"):
            client.submit_tx(conn, dwc_flow, 1)
        with pytest.raises(SchemaVersionMismatch, match="cyclone migrate"):
            client.enqueue_tx(conn, dwc_echo, 1)
        conn.execute("INSERT INTO dwc_mine VALUES (1)")  # the caller's transaction goes on
        conn.commit()
        assert conn.execute("SELECT x FROM dwc_mine").fetchall() == [(1,)]


def test_dwc_async_submit_tx_without_cyclone_tables_is_a_typed_error(
    cyclone_dsn: str, dwc_unmigrated_dsn: str
) -> None:
    async def go() -> None:
        async with (
            AsyncClient(cyclone_dsn) as aclient,
            await psycopg.AsyncConnection.connect(dwc_unmigrated_dsn, autocommit=True) as conn,
        ):
            with pytest.raises(SchemaVersionMismatch, match="cyclone migrate"):
                await aclient.submit_tx(conn, dwc_flow, 1)

    asyncio.run(go())


def test_dwc_a_rolled_back_submit_does_not_exist_and_does_not_block_its_key(
    client: Client, cyclone_dsn: str
) -> None:
    with psycopg.connect(cyclone_dsn) as conn:
        client.submit_tx(conn, dwc_flow, 1)
        held = client.submit_once_tx(conn, dwc_signalled, None, key="dwc-key")
        unique = client.enqueue_tx(conn, dwc_echo, 1, unique_key="dwc-unique")
        assert held.created and unique.created
        conn.rollback()
    _nothing_written(client)
    assert client.submit_once(dwc_signalled, None, key="dwc-key").created
    assert client.enqueue(dwc_echo, 1, unique_key="dwc-unique").created
    assert not client.enqueue(dwc_echo, 2, unique_key="dwc-unique").created


# =========================================================================================
# api.md: Client and RunHandle lookups and refusals
# =========================================================================================

_BY_RUN_ID: dict[str, Callable[[Client, int], object]] = {
    "get_run": lambda c, r: c.get_run(r),
    "progress": lambda c, r: c.progress(r),
    "dependencies": lambda c, r: c.dependencies(r),
    "signals_of": lambda c, r: c.signals_of(r),
    "children_of": lambda c, r: c.children_of(r),
    "why_waiting": lambda c, r: c.why_waiting(r),
    "outcome": lambda c, r: c.outcome(r),
    "wait": lambda c, r: c.wait(r, timeout=5),
    "events_of": lambda c, r: c.events_of(r),
    "cancel": lambda c, r: c.cancel(r),
    "pause": lambda c, r: c.pause(r),
    "resume": lambda c, r: c.resume(r),
    "signal": lambda c, r: c.signal(r, "go"),
    "retry": lambda c, r: c.retry(r, "x"),
    "fork": lambda c, r: c.fork(r, "x"),
}


@pytest.mark.parametrize("method", sorted(_BY_RUN_ID))
def test_dwc_a_missing_run_is_run_not_found(client: Client, method: str) -> None:
    with pytest.raises(RunNotFound) as missing:
        _BY_RUN_ID[method](client, 424242)
    assert missing.value.run_id == 424242
    assert str(missing.value) == "run 424242 does not exist"
    assert isinstance(missing.value, LookupError)


def test_dwc_retry_fork_and_schedule_refusals_change_nothing(client: Client) -> None:
    run = client.submit(dwc_signalled, None)
    before = client.get_run(run.id)
    with pytest.raises(cyclone_errors.NodeNotFound) as no_node:
        client.retry(run.id, "dwc-nope")
    assert (no_node.value.run_id, no_node.value.node) == (run.id, "dwc-nope")
    with pytest.raises(InvalidTransition):
        client.retry(run.id, "go")  # waiting, neither discarded nor cancelled
    with pytest.raises(InvalidArgument):
        client.fork(run.id, "dwc-nope")
    with pytest.raises(InvalidTransition):
        client.resume(run.id)  # "Resume a paused run": this one is running
    assert client.get_run(run.id) == before
    assert len(client.list_runs()) == 1
    with pytest.raises(cyclone_errors.ScheduleError) as sched:
        client.unschedule("dwc-no-schedule")
    assert isinstance(sched.value, InvalidArgument)
    with pytest.raises(cyclone_errors.ScheduleError):
        client.enable_schedule("dwc-no-schedule")
    with pytest.raises(cyclone_errors.ScheduleError):
        client.schedule(dwc_flow, "not a cron")
    with pytest.raises(cyclone_errors.ScheduleError):
        client.schedule(dwc_flow, "* * * * *", location="Mars/Olympus")
    assert client.list_schedules() == []


def test_dwc_a_closed_client_raises_client_closed_but_handle_needs_no_database(
    cyclone_dsn: str,
) -> None:
    with Client(cyclone_dsn) as client:
        run = client.submit(dwc_signalled, None)
    with pytest.raises(cyclone_dsl.ClientClosed):
        client.submit(dwc_flow, 1)
    with pytest.raises(cyclone_dsl.ClientClosed):
        client.get_run(run.id)
    with pytest.raises(cyclone_dsl.ClientClosed):
        run.get()
    assert client.handle(run.id).id == run.id  # "no database access"


def test_dwc_run_handle_wait_timeouts(start_worker: StartWorker, client: Client) -> None:
    """RunHandle.wait: "TimeoutError after timeout seconds (None or infinity: no limit; a
    negative or NaN one: InvalidArgument)"."""
    run = client.submit(dwc_signalled, None)
    for bad in (-1.0, math.nan):
        with pytest.raises(InvalidArgument):
            run.wait(bad)
    with pytest.raises(TimeoutError):
        run.wait(0.3)
    start_worker(dwc_echo, dwc_act)
    client.signal(run.id, "go", {"v": 1})
    assert run.wait(math.inf).state == RunState.COMPLETED
    assert run.result(None) == {"v": 1}
    no_result = client.submit(dwc_no_result, 1)
    assert no_result.wait(20).state == RunState.COMPLETED
    with pytest.raises(NoOutput):
        no_result.result(5)


def test_dwc_async_run_handle_wait_refuses_the_same_timeouts(cyclone_dsn: str) -> None:
    async def main() -> None:
        async with AsyncClient(cyclone_dsn) as aclient:
            run = await aclient.submit(dwc_signalled, None)
            for bad in (-1.0, math.nan):
                with pytest.raises(InvalidArgument):
                    await run.wait(bad)
            with pytest.raises(TimeoutError):
                await run.wait(0.3)
            with pytest.raises(RunNotFound):
                await aclient.get_run(424242)

    asyncio.run(main())


def test_dwc_run_filter_refusals() -> None:
    with pytest.raises(InvalidArgument):
        RunFilter()
    with pytest.raises(InvalidArgument):
        RunFilter(workflows="dwc_flow", match_all=True)
    with pytest.raises(InvalidArgument):
        RunFilter(since=datetime(2020, 1, 1))  # naive on purpose
    assert RunFilter(match_all=True).match_all
    assert RunFilter(since=datetime(2020, 1, 1, tzinfo=UTC)).since is not None


def test_dwc_client_without_a_dsn_reads_the_environment(
    cyclone_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CYCLONE_DATABASE_URL", raising=False)
    with pytest.raises(InvalidArgument):
        Client()
    monkeypatch.setenv("CYCLONE_DATABASE_URL", cyclone_dsn)
    with Client() as client:
        assert client.run_counts() == {}


# =========================================================================================
# errors.md "Errors from migrate()": typed, one line, no password, driver error on __cause__
# =========================================================================================


def test_dwc_migrate_refuses_an_unparsable_dsn_without_the_password() -> None:
    for dsn in (f"mysql://dwc:{SECRET}@localhost/db", f"http://dwc:{SECRET}@localhost/db"):
        with pytest.raises(InvalidArgument) as bad:
            migrate(dsn)
        _one_line(str(bad.value))
        assert SECRET not in str(bad.value)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dwc_migrate_unreachable_servers_are_database_unavailable_with_a_cause(
    cyclone_admin_dsn: str,
) -> None:
    params = psycopg.conninfo.conninfo_to_dict(cyclone_admin_dsn)
    missing_db = psycopg.conninfo.make_conninfo(
        "", **{**params, "dbname": "dwc_no_such_database", "password": SECRET}
    )
    cases = {
        f"postgresql://dwc:{SECRET}@127.0.0.1:{_closed_port()}/db": "connection_refused",
        f"postgresql://dwc:{SECRET}@dwc-no-such-host.invalid/db": "unknown_host",
        missing_db: "database_missing",
    }
    for dsn, cause in cases.items():
        with pytest.raises(DatabaseUnavailable) as down:
            migrate(dsn)
        assert down.value.cause == cause, str(down.value)
        _one_line(str(down.value))
        assert SECRET not in str(down.value)
        assert isinstance(down.value.__cause__, psycopg.Error)


def test_dwc_migrate_target_out_of_range_is_a_migration_error(cyclone_dsn: str) -> None:
    for version in (-1, cyclone_dsl.LATEST_SCHEMA_VERSION + 1):
        with pytest.raises(cyclone_errors.MigrationError) as bad:
            migrate(cyclone_dsn, version=version)
        _one_line(str(bad.value))
    # nothing moved: the schema is still at the latest version, and a rerun is a no-op
    assert migrate(cyclone_dsn) == cyclone_dsl.LATEST_SCHEMA_VERSION


def test_dwc_an_unmigrated_schema_is_schema_version_mismatch_for_a_client(
    dwc_unmigrated_dsn: str,
) -> None:
    with (
        pytest.raises(cyclone_errors.SchemaVersionMismatch) as old,
        Client(dwc_unmigrated_dsn) as client,
    ):
        client.run_counts()
    assert "migrate" in str(old.value)


def test_dwc_a_role_without_rows_is_permission_denied_and_a_row_role_may_migrate(
    cyclone_admin_dsn: str, cyclone_schema: str
) -> None:
    """errors.md: DatabaseUnavailable ``permission_denied`` (the role may not read Cyclone's
    tables); "a role that only reads and writes rows can call migrate() on every start"."""
    with limited_role(cyclone_admin_dsn, cyclone_schema) as no_rows:
        with pytest.raises(DatabaseUnavailable) as denied, Client(no_rows) as client:
            client.run_counts()
        assert denied.value.cause == "permission_denied"
        _one_line(str(denied.value))
        with pytest.raises(DatabaseUnavailable) as worker_denied:
            Worker(no_rows, [dwc_echo], poll_interval=0.2).start()
        assert worker_denied.value.cause == "permission_denied"
    with limited_role(cyclone_admin_dsn, cyclone_schema, select=True) as rows:
        assert migrate(rows) == cyclone_dsl.LATEST_SCHEMA_VERSION
        with Client(rows) as client:
            assert client.enqueue(dwc_echo, 1).get().state == RunState.RUNNING
