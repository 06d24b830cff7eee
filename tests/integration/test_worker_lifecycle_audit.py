"""Audit of the worker's lifecycle and options: ``Worker(...)`` given bad options, ``with``,
``start``/``stop``/``run``/``request_stop``, stopping while sync and async handlers run,
handlers longer than the lease, ``ctx.heartbeat()``, ``queues=`` and priorities.

Handlers count their executions in ``CALLS`` (by tag) and may block on ``gate``; each test
checks a run's outcome, which worker completed it and how often its handler ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import socket
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    CycloneError,
    DatabaseUnavailable,
    InvalidArgument,
    RunFailed,
    StepContext,
    StepState,
    Worker,
    step,
)
from cyclone_dsl.worker.observe import WorkerObserver
from tests.waiting import wait_until

CALLS: Counter[str] = Counter()
#: Per tag, whether each execution saw ``ctx.cancelled`` when it ended.
CANCELLED: dict[str, list[bool]] = {}
#: What ``ctx.heartbeat()`` returned, in order.
BEATS: list[bool] = []
#: Tags in the order their handlers ran.
ORDER: list[str] = []
_lock = threading.Lock()
gate = threading.Event()


def _count(tag: str) -> int:
    with _lock:
        CALLS[tag] += 1
        ORDER.append(tag)
        return CALLS[tag]


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    CALLS.clear()
    CANCELLED.clear()
    BEATS.clear()
    ORDER.clear()
    gate.clear()
    yield
    gate.set()  # a handler still blocked in a stopped worker returns


# -- handlers --------------------------------------------------------------------------


@step(name="wla_echo")
def wla_echo(tag: str) -> str:
    _count(tag)
    return tag


@step(name="wla_echo_async")
async def wla_echo_async(tag: str) -> str:
    _count(tag)
    await asyncio.sleep(0)
    return tag


@step(name="wla_hold", max_attempts=1)
def wla_hold(tag: str, ctx: StepContext) -> str:
    """The first execution waits for its cancel (or ``gate``); later ones return at once."""
    if _count(tag) == 1:
        ctx.wait_cancelled(10)
        CANCELLED.setdefault(tag, []).append(ctx.cancelled)
        return f"{tag} first"
    return f"{tag} again"


@step(name="wla_hold_async", max_attempts=1)
async def wla_hold_async(tag: str, ctx: StepContext) -> str:
    if _count(tag) == 1:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            CANCELLED.setdefault(tag, []).append(ctx.cancelled)
            raise
        return f"{tag} first"
    return f"{tag} again"


@step(name="wla_gated", max_attempts=1)
def wla_gated(tag: str) -> str:
    """Runs until ``gate`` opens (the test's stand-in for a handler's work)."""
    _count(tag)
    gate.wait(10)
    return f"{tag} done"


@step(name="wla_long", max_attempts=1)
def wla_long(tag: str) -> str:
    """Works for 2 s: two and a half times the 0.8 s lease of the workers that run it (a
    heartbeat every 0.27 s; a shorter lease missed one on two saturated cores)."""
    _count(tag)
    time.sleep(2.0)
    return f"{tag} done"


@step(name="wla_slow", max_attempts=1)
def wla_slow(tag: str) -> str:
    _count(tag)
    time.sleep(0.4)
    return f"{tag} done"


@step(name="wla_beat", max_attempts=1)
def wla_beat(tag: str, ctx: StepContext) -> str:
    """Heartbeats by hand until a beat says the lease is gone (at most 5 s)."""
    _count(tag)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        held = ctx.heartbeat()
        BEATS.append(held)
        if not held:
            return "lost"
        gate.wait(0.05)
    return "kept"


# -- helpers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def silent_port() -> Iterator[socket.socket]:
    """A listening socket: a DSN on its port shows whether anything tried to connect."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        sock.setblocking(False)
        yield sock


def _connections_tried(sock: socket.socket) -> int:
    tried = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return tried
        conn.close()
        tried += 1


def _cyclone_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("cyclone")}


def _fresh_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _live(client: Client, worker: Worker) -> bool:
    return any(w["id"] == worker.id and w["live"] for w in client.workers())


def _stop_quietly(worker: Worker, timeout: float = 5) -> None:
    with contextlib.suppress(Exception):  # a worker a test broke on purpose
        worker.stop(timeout=timeout)


# -- bad options: refused at construction, nothing opened --------------------------------

EMPTY_MODULE = types.ModuleType("wla_empty_module")
A_THOUSAND_YEARS_LESS_A_LITTLE = 3.0e10  # accepted by the check (<= 1000 years)


def _raw(reason: str) -> Any:
    """What the case did before it was fixed (the marks of a case that must pass now)."""
    return ()


REFUSED = [
    pytest.param({"concurrency": 0}, id="concurrency=0"),
    pytest.param({"concurrency": -3}, id="concurrency<0"),
    pytest.param({"concurrency": True}, id="concurrency=True"),
    pytest.param({"concurrency": 1.5}, id="concurrency=1.5"),
    pytest.param({"concurrency": "4"}, id="concurrency=str"),
    pytest.param({"concurrency": 2**31}, id="concurrency>int32"),
    pytest.param({"max_concurrency": 0}, id="max_concurrency=0"),
    pytest.param({"max_concurrency": 2**31}, id="max_concurrency>int32"),
    pytest.param({"concurrency": 4, "max_concurrency": 8}, id="concurrency+max_concurrency"),
    pytest.param({"max_async": 0}, id="max_async=0"),
    pytest.param({"max_async": True}, id="max_async=True"),
    pytest.param({"lease": 0}, id="lease=0"),
    pytest.param({"lease": -1.0}, id="lease<0"),
    pytest.param({"lease": math.nan}, id="lease=nan"),
    pytest.param({"lease": math.inf}, id="lease=inf"),
    pytest.param({"lease": "30"}, id="lease=str"),
    pytest.param({"lease": True}, id="lease=True"),
    pytest.param({"lease": timedelta(seconds=30)}, id="lease=timedelta"),
    pytest.param({"lease": 10**400}, id="lease=huge-int"),
    pytest.param({"poll_interval": 0}, id="poll_interval=0"),
    pytest.param({"scan_interval": -0.5}, id="scan_interval<0"),
    pytest.param({"grace": -1}, id="grace<0"),
    pytest.param({"grace": math.nan}, id="grace=nan"),
    pytest.param({"retention": 0}, id="retention=0"),
    pytest.param({"retention": "7d"}, id="retention=str"),
    pytest.param({"batch_size": 0}, id="batch_size=0"),
    pytest.param({"batch_size": True}, id="batch_size=True"),
    pytest.param({"max_reclaims": -1}, id="max_reclaims<0"),
    pytest.param({"max_reclaims": 1.5}, id="max_reclaims=1.5"),
    pytest.param({"max_output_bytes": -1}, id="max_output_bytes<0"),
    pytest.param({"max_events_per_step": 0}, id="max_events_per_step=0"),
    pytest.param({"name": "a\x00b"}, id="name-with-NUL"),
    pytest.param({"name": 5}, id="name=int"),
    pytest.param({"queues": "default"}, id="queues=str"),
    pytest.param({"queues": []}, id="queues=[]"),
    pytest.param({"queues": [""]}, id="queues=['']"),
    pytest.param({"queues": [1]}, id="queues=[int]"),
    pytest.param({"queue_limits": {"other": 1}}, id="queue_limits-unserved-queue"),
    pytest.param({"queue_limits": {"default": 0}}, id="queue_limits=0"),
    pytest.param({"catch_up": "first"}, id="catch_up=str"),
    pytest.param({"metrics_port": 70000}, id="metrics_port>65535"),
    pytest.param({"metrics_port": "9"}, id="metrics_port=str"),
    pytest.param({"processes": 0}, id="processes=0"),
    pytest.param({"processes": True}, id="processes=True"),
    pytest.param({"processes": 1.5}, id="processes=1.5"),
    pytest.param({"processes": 2, "observers": [WorkerObserver()]}, id="processes=2+observers"),
    pytest.param({"objects": "tests.integration"}, id="objects=str"),
    pytest.param({"objects": []}, id="objects=[]"),
    pytest.param({"objects": ["json"]}, id="objects=module-without-definitions"),
    pytest.param({"objects": [EMPTY_MODULE]}, id="objects=empty-module"),
    # Raw Python errors (TypeError, ValueError, AttributeError) instead of InvalidArgument:
    pytest.param(
        {"objects": None},
        id="objects=None",
        marks=_raw("Worker(dsn, None) raises a raw TypeError from list(None), not InvalidArgument"),
    ),
    pytest.param(
        {"objects": [42]},
        id="objects=[int]",
        marks=_raw(
            "Worker(dsn, [42]) raises a raw TypeError ('expected a module...'), not InvalidArgument"
        ),
    ),
    pytest.param(
        {"queues": None},
        id="queues=None",
        marks=_raw("queues=None raises a raw TypeError from dict.fromkeys, not InvalidArgument"),
    ),
    pytest.param(
        {"queues": 5},
        id="queues=int",
        marks=_raw("queues=5 raises a raw TypeError ('int' object is not iterable)"),
    ),
    pytest.param(
        {"queue_limits": 5},
        id="queue_limits=int",
        marks=_raw("queue_limits=5 raises a raw TypeError from dict(5)"),
    ),
    pytest.param(
        {"queue_limits": "ab"},
        id="queue_limits=str",
        marks=_raw("queue_limits='ab' raises a raw ValueError ('dictionary update sequence')"),
    ),
    pytest.param(
        {"observers": 5},
        id="observers=int",
        marks=_raw("observers=5 raises a raw TypeError from list(5)"),
    ),
    pytest.param(
        {"tracing": "yes"},
        id="tracing=str",
        marks=_raw(
            "tracing='yes' raises a raw AttributeError (no get_tracer), not InvalidArgument"
        ),
    ),
    pytest.param(
        {"registry": 5},
        id="registry=int",
        marks=_raw("registry=5 raises a raw AttributeError (no .handlers), not InvalidArgument"),
    ),
    # Accepted, with a meaning the caller did not ask for, or failing only once running:
    pytest.param(
        {"pooled": "false"},
        id="pooled=str",
        marks=_raw(
            "pooled='false' is accepted and truthy: the worker runs in pooled mode "
            "(no LISTEN, polling) instead of refusing a non-bool"
        ),
    ),
    pytest.param(
        {"scanners": "false"},
        id="scanners=str",
        marks=_raw(
            "scanners='false' is accepted and truthy: the scanners run instead of "
            "a non-bool being refused"
        ),
    ),
    pytest.param(
        {"listen_dsn": 5},
        id="listen_dsn=int",
        marks=_raw(
            "listen_dsn=5 is accepted; once started, the listener thread dies on "
            "AttributeError and crashes the worker"
        ),
    ),
    pytest.param(
        {"transactional_dsn": 5},
        id="transactional_dsn=int",
        marks=_raw("transactional_dsn=5 is accepted at construction (used only at start)"),
    ),
    pytest.param(
        {"metrics_port": 0, "metrics_host": 5},
        id="metrics_host=int",
        marks=_raw("metrics_host=5 is accepted; start() then raises a raw TypeError"),
    ),
]


@pytest.mark.parametrize("options", REFUSED)
def test_a_bad_option_is_refused_at_construction_and_opens_nothing(
    options: dict[str, Any], silent_port: socket.socket
) -> None:
    options = dict(options)
    objects = options.pop("objects", [wla_echo])
    dsn = f"host=127.0.0.1 port={silent_port.getsockname()[1]} dbname=wla connect_timeout=1"
    threads = _cyclone_threads()
    with pytest.raises(InvalidArgument):
        Worker(dsn, objects, **options)
    assert _cyclone_threads() <= threads
    assert _connections_tried(silent_port) == 0


def test_good_options_open_nothing_until_start(silent_port: socket.socket) -> None:
    """Construction is pure: even with every option set, nothing connects and no thread
    starts before start()."""
    dsn = f"host=127.0.0.1 port={silent_port.getsockname()[1]} dbname=wla connect_timeout=1"
    threads = _cyclone_threads()
    worker = Worker(
        dsn,
        [wla_echo, wla_echo_async],
        queues=["default", "wla_other"],
        max_concurrency=8,
        max_async=50,
        lease=2,
        poll_interval=0.5,
        grace=0,
        scan_interval=0.5,
        retention=None,
        queue_limits={"wla_other": 2},
        name="wla-pure",
    )
    assert worker.settings().max_concurrency == 8
    assert worker.settings().max_async == 50
    assert _cyclone_threads() <= threads
    assert _connections_tried(silent_port) == 0


def test_a_lease_below_a_microsecond_is_refused_or_kept(client: Client, cyclone_dsn: str) -> None:
    try:
        worker = Worker(cyclone_dsn, [wla_slow], lease=1e-9, poll_interval=0.1, scan_interval=0.1)
    except InvalidArgument:
        return
    with worker:
        handle = client.enqueue(wla_slow, "tiny")
        try:
            assert handle.result(timeout=8) == "tiny done"
        except RunFailed as failed:
            raise AssertionError(f"the run failed: {failed}; executions: {CALLS}") from None
    assert CALLS["tiny"] == 1


@pytest.mark.parametrize(
    "option",
    [
        pytest.param(
            "poll_interval",
            marks=_raw(
                "poll_interval=3e10 (< 1000 years, accepted) crashes the fetch loop "
                "with OverflowError in Event.wait (> threading.TIMEOUT_MAX): WorkerCrashed"
            ),
        ),
        pytest.param(
            "scan_interval",
            marks=_raw(
                "scan_interval=3e10 (accepted) crashes the scanner thread with "
                "OverflowError in Event.wait after its first pass: WorkerCrashed"
            ),
        ),
        pytest.param(
            "grace",
            marks=_raw(
                "grace=3e10 (accepted) makes stop() raise a raw OverflowError from "
                "Event.wait(grace + 30) instead of stopping"
            ),
        ),
    ],
)
def test_a_duration_the_check_accepts_is_one_the_worker_can_wait(
    client: Client, cyclone_dsn: str, option: str
) -> None:
    """The checks accept up to a thousand years; Event.wait takes at most
    threading.TIMEOUT_MAX (about 292 years): refuse the rest, or wait in pieces."""
    options: dict[str, Any] = {"poll_interval": 0.1, "scan_interval": 0.1, "grace": 1}
    options[option] = A_THOUSAND_YEARS_LESS_A_LITTLE
    try:
        worker = Worker(cyclone_dsn, [wla_echo], **options)
    except InvalidArgument:
        return
    handle = client.enqueue(wla_echo, option)
    worker.start()
    try:
        assert handle.result(timeout=5) == option
        if option != "grace":  # once idle, the fetch loop (or the scanner) waits
            with contextlib.suppress(AssertionError):
                wait_until(lambda: worker.error, timeout=1, what="the worker to crash")
            assert worker.error is None, f"the worker crashed: {worker.error!r}"
        worker.stop()
    finally:
        _stop_quietly(worker)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(
            {"max_concurrency": 2**31 - 1},
            id="max_concurrency",
            marks=_raw(
                "max_concurrency=2**31-1 is accepted, but with async handlers too "
                "start() registers concurrency=cap+max_async into an int4 column: raw psycopg "
                "NumericValueOutOfRange"
            ),
        ),
        pytest.param(
            {"max_async": 2**31 - 1},
            id="max_async",
            marks=_raw(
                "max_async=2**31-1 is accepted, but with sync handlers too start() "
                "overflows the registry's int4 concurrency: raw psycopg NumericValueOutOfRange"
            ),
        ),
    ],
)
def test_the_largest_accepted_limits_start(
    client: Client, cyclone_dsn: str, options: dict[str, Any]
) -> None:
    try:
        worker = Worker(
            cyclone_dsn, [wla_echo, wla_echo_async], poll_interval=0.1, grace=1, **options
        )
    except InvalidArgument:
        return
    try:
        worker.start()
    except CycloneError:
        raise
    except Exception as exc:
        raise AssertionError(f"start() raised a raw {type(exc).__name__}: {exc}") from exc
    try:
        assert client.enqueue(wla_echo_async, "big").result(timeout=5) == "big"
    finally:
        worker.stop()


# -- start and stop ----------------------------------------------------------------------


def test_an_unreachable_database_fails_start_fast_and_leaves_nothing_running() -> None:
    threads = _cyclone_threads()
    worker = Worker(f"host=127.0.0.1 port={_fresh_port()} dbname=wla", [wla_echo])
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as caught:
        worker.start()
    assert time.monotonic() - started < 5
    assert caught.value.cause == "connection_refused"
    assert _cyclone_threads() <= threads
    unreachable = Worker(f"host=127.0.0.1 port={_fresh_port()} dbname=wla", [wla_echo])
    with pytest.raises(DatabaseUnavailable), unreachable:  # and `with` says the same
        pass


@pytest.mark.parametrize(
    "failed_start", [pytest.param(False, id="never-started"), pytest.param(True, id="start-failed")]
)
def test_stopping_a_worker_that_is_not_running_returns_at_once(failed_start: bool) -> None:
    worker = Worker(f"host=127.0.0.1 port={_fresh_port()} dbname=wla", [wla_echo], grace=0)
    if failed_start:
        with pytest.raises(DatabaseUnavailable):
            worker.start()
    stopper = threading.Thread(target=worker.stop, name="wla-stopper", daemon=True)
    stopper.start()
    stopper.join(5)  # at once: nothing to wait for (5 s: a loaded machine may be slow)
    assert not stopper.is_alive(), "stop() is still blocked after 5 s"


def test_with_runs_sync_and_async_steps_and_leaves_the_worker_stopped(
    client: Client, cyclone_dsn: str
) -> None:
    with Worker(cyclone_dsn, [wla_echo, wla_echo_async], poll_interval=0.1, grace=1) as worker:
        assert _live(client, worker)
        assert client.enqueue(wla_echo, "s").result(timeout=5) == "s"
        assert client.enqueue(wla_echo_async, "a").result(timeout=5) == "a"
    assert not _live(client, worker)
    row = next(w for w in client.workers() if w["id"] == worker.id)
    assert row["stopped_at"] is not None
    late = client.enqueue(wla_echo, "after")  # nobody claims it any more
    assert client.get_run(late.id).steps[0].state is StepState.AVAILABLE
    assert Counter({"s": 1, "a": 1}) == CALLS


def test_an_error_in_the_with_body_propagates_and_stops_the_worker(
    client: Client, cyclone_dsn: str
) -> None:
    worker = Worker(cyclone_dsn, [wla_echo], poll_interval=0.1, grace=1)

    def body() -> None:
        with worker:
            assert client.enqueue(wla_echo, "x").result(timeout=5) == "x"
            _ = 1 / 0

    with pytest.raises(ZeroDivisionError):
        body()
    assert not _live(client, worker)


def test_stopping_twice_is_harmless(client: Client, cyclone_dsn: str) -> None:
    worker = Worker(cyclone_dsn, [wla_echo], poll_interval=0.1, grace=1).start()
    assert client.enqueue(wla_echo, "once").result(timeout=5) == "once"
    worker.stop()
    started = time.monotonic()
    worker.stop()
    worker.request_stop()
    assert time.monotonic() - started < 0.5
    assert worker.error is None


def test_a_handler_that_returns_within_the_grace_completes_on_its_worker(
    client: Client, cyclone_dsn: str
) -> None:
    worker = Worker(cyclone_dsn, [wla_gated], poll_interval=0.1, grace=5).start()
    handle = client.enqueue(wla_gated, "g")
    wait_until(lambda: CALLS["g"], what="the handler to start")
    stopper = threading.Thread(target=worker.stop, name="wla-stopper", daemon=True)
    stopper.start()
    stopper.join(0.3)
    assert stopper.is_alive(), "stop() did not wait for the running handler"
    gate.set()
    stopper.join(5)
    assert not stopper.is_alive()
    step_row = handle.get().step("wla_gated")
    assert step_row.state is StepState.COMPLETED
    assert step_row.output == "g done"
    assert step_row.lease_owner == worker.id
    assert step_row.attempt == 0  # no failed attempt
    assert CALLS["g"] == 1


def test_stop_past_the_grace_hands_sync_and_async_steps_to_a_running_worker_at_once(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """The leases are released, not left to expire (30 s here): the other worker starts
    both steps at once; the first executions saw their cancel; no attempt is spent."""
    first = Worker(cyclone_dsn, [wla_hold, wla_hold_async], poll_interval=0.1, grace=0.2)
    first.start()
    sync_run = client.enqueue(wla_hold, "s")
    async_run = client.enqueue(wla_hold_async, "a")
    wait_until(lambda: CALLS["s"] and CALLS["a"], what="both handlers to start")
    second = start_worker(wla_hold, wla_hold_async, poll_interval=0.1)
    started = time.monotonic()
    first.stop()
    assert sync_run.result(timeout=5) == "s again"
    assert async_run.result(timeout=5) == "a again"
    assert time.monotonic() - started < 5  # far below the 30 s lease
    assert CANCELLED == {"s": [True], "a": [True]}
    assert Counter({"s": 2, "a": 2}) == CALLS
    for handle, node in ((sync_run, "wla_hold"), (async_run, "wla_hold_async")):
        row = handle.get().step(node)
        assert row.lease_owner == second.id
        assert row.attempt == 0  # the released execution did not count as a failure
        assert row.reclaims == 0
    assert first.error is None


def test_stop_does_not_wait_for_a_handler_that_ignores_its_cancel(
    client: Client, cyclone_dsn: str
) -> None:
    """A sync handler cannot be interrupted: stop() returns after the grace all the same,
    and the step is available again at once, its attempt not spent."""
    worker = Worker(cyclone_dsn, [wla_gated], poll_interval=0.1, grace=0.3).start()
    handle = client.enqueue(wla_gated, "stuck")
    wait_until(lambda: CALLS["stuck"], what="the handler to start")
    started = time.monotonic()
    worker.stop()
    assert time.monotonic() - started < 3
    row = handle.get().step("wla_gated")
    assert row.state is StepState.AVAILABLE
    assert row.attempt == 0
    assert not _live(client, worker)


def test_run_in_a_thread_stops_on_request_stop(client: Client, cyclone_dsn: str) -> None:
    worker = Worker(cyclone_dsn, [wla_echo], poll_interval=0.1, grace=1)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            worker.run()
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    runner = threading.Thread(target=serve, name="wla-run", daemon=True)
    runner.start()
    assert client.enqueue(wla_echo, "r").result(timeout=5) == "r"
    worker.request_stop()
    runner.join(5)
    assert not runner.is_alive()
    assert errors == []
    assert not _live(client, worker)


def test_run_on_the_main_thread_stops_gracefully_on_sigterm(
    client: Client, cyclone_dsn: str
) -> None:
    """SIGTERM: no new claims, the running handler finishes within the grace, run()
    returns, and the previous SIGTERM handler is back."""
    assert threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)
    worker = Worker(cyclone_dsn, [wla_gated], poll_interval=0.1, grace=5)
    handle = client.enqueue(wla_gated, "sig")

    def terminate() -> None:
        try:
            wait_until(lambda: CALLS["sig"], timeout=10, what="the handler to start")
        except AssertionError:
            worker.request_stop()  # never leave run() blocking the test
            return
        os.kill(os.getpid(), signal.SIGTERM)
        gate.set()

    helper = threading.Thread(target=terminate, name="wla-sigterm", daemon=True)
    helper.start()
    worker.run()
    helper.join(5)
    assert signal.getsignal(signal.SIGTERM) is previous
    row = handle.get().step("wla_gated")
    assert row.state is StepState.COMPLETED
    assert row.lease_owner == worker.id
    assert CALLS["sig"] == 1
    assert not _live(client, worker)


# -- handlers, leases and heartbeats -----------------------------------------------------


def test_a_handler_longer_than_its_lease_is_kept_by_heartbeats(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Lease 0.8 s, work 2 s, a second worker scanning every 0.1 s: no reclaim, one
    execution, completed by the first worker."""
    first = start_worker(wla_long, lease=0.8, poll_interval=0.1, scan_interval=0.1)
    handle = client.enqueue(wla_long, "long")
    wait_until(lambda: CALLS["long"], what="the handler to start")
    start_worker(wla_long, lease=0.8, poll_interval=0.1, scan_interval=0.1)
    assert handle.result(timeout=5) == "long done"
    row = handle.get().step("wla_long")
    assert row.reclaims == 0
    assert row.lease_owner == first.id
    assert CALLS["long"] == 1


def test_ctx_heartbeat_is_true_while_held_and_false_once_the_run_is_cancelled(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(wla_beat, poll_interval=0.1)
    handle = client.enqueue(wla_beat, "hb")
    wait_until(lambda: len(BEATS) >= 3, what="a few manual heartbeats")
    assert all(BEATS)
    client.cancel(handle.id)
    wait_until(lambda: BEATS and not BEATS[-1], timeout=5, what="a heartbeat to say lost")
    assert BEATS.count(False) == 1
    assert client.get_run(handle.id).state == "cancelled"
    assert CALLS["hb"] == 1


# -- queues and priorities ---------------------------------------------------------------


def test_a_worker_claims_only_the_queues_it_serves(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(wla_echo, queues=["wla_high"], poll_interval=0.1)
    elsewhere = client.enqueue(wla_echo, "default-queue")
    mine = client.enqueue(wla_echo, "high-queue", queue="wla_high")
    assert mine.result(timeout=5) == "high-queue"
    row = client.get_run(elsewhere.id).steps[0]
    assert row.state is StepState.AVAILABLE
    assert row.queue == "default"
    start_worker(wla_echo, queues=["default"], poll_interval=0.1)
    assert elsewhere.result(timeout=5) == "default-queue"
    assert Counter({"default-queue": 1, "high-queue": 1}) == CALLS


def test_one_slot_runs_the_highest_priority_first_and_serves_every_queue(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Within a queue: priority DESC. Across queues a claim goes queue by queue, starting
    from the next one each time, so a queue with low priority work is not starved."""
    handles = [
        client.enqueue(wla_echo, "p0", queue="wla_qa", priority=0),
        client.enqueue(wla_echo, "p10", queue="wla_qa", priority=10),
        client.enqueue(wla_echo, "p5", queue="wla_qa", priority=5),
        client.enqueue(wla_echo, "p7", queue="wla_qa", priority=7),
        client.enqueue(wla_echo, "other", queue="wla_qb", priority=-5),
    ]
    start_worker(wla_echo, queues=["wla_qa", "wla_qb"], concurrency=1, poll_interval=0.1)
    for handle in handles:
        handle.result(timeout=5)
    queue_a = [tag for tag in ORDER if tag != "other"]
    assert queue_a == ["p10", "p7", "p5", "p0"]
    assert ORDER.index("other") <= 1


# -- restarting a worker object ----------------------------------------------------------


def test_starting_a_stopped_worker_again_serves_or_is_refused(
    client: Client, cyclone_dsn: str
) -> None:
    worker = Worker(cyclone_dsn, [wla_echo], poll_interval=0.1, grace=1)
    worker.start()
    worker.stop()
    handle = client.enqueue(wla_echo, "again")
    try:
        worker.start()
    except CycloneError:
        return
    try:
        assert handle.result(timeout=1) == "again"
    finally:
        _stop_quietly(worker)


def test_starting_a_running_worker_twice_is_refused(cyclone_dsn: str) -> None:
    worker = Worker(cyclone_dsn, [wla_echo], poll_interval=0.1, grace=0.5).start()
    try:
        with pytest.raises(CycloneError):
            worker.start()
    finally:
        # Under the bug stop() blocks for many seconds: stop in the background.
        threading.Thread(
            target=_stop_quietly, args=(worker, 30), name="wla-cleanup", daemon=True
        ).start()


def test_a_start_that_fails_late_leaves_no_live_worker_behind(
    client: Client, cyclone_dsn: str
) -> None:
    """Before (at the audited commit): the metrics port was bound after the worker had
    registered, and a port in use (a raw OSError) left the worker listed as live for 30 s,
    blocking other handler versions of its kinds and hiding unserved work."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        worker = Worker(cyclone_dsn, [wla_echo], metrics_port=port, metrics_host="127.0.0.1")
        with pytest.raises(Exception) as caught:  # noqa: PT011 - any error; what is left matters
            worker.start()
    assert not _live(client, worker), f"after {type(caught.value).__name__}: still live"
