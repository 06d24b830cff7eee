"""The worker: claims steps, runs their handlers, commits outcomes, keeps leases alive.

Threads, each with one job:

* the fetch loop (the caller's thread in :meth:`Worker.run`) claims batches
  while slots are free and sleeps on NOTIFY wake-ups or the poll interval;
* a thread pool runs sync handlers, one event loop thread runs async ones;
* two completers commit outcomes in batches (one transaction each; while one
  waits for its commit's disk flush, the other fills and sends the next batch);
* the heartbeater extends leases on its own connection, and fails or drops
  steps whose timeout passed or whose lease was lost;
* the listener holds the LISTEN connection;
* the scanner runs the maintenance passes (expired leases, timeouts, timers…)
  under a per-pass advisory lock so that many workers do not repeat them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any

import attrs
import psycopg

from cyclone_dsl import payload
from cyclone_dsl.client.schedules import compiler_for, register_all
from cyclone_dsl.db.connect import connect, make_pool
from cyclone_dsl.db.listen import listen, ping
from cyclone_dsl.db.tx import Tx, in_autocommit, in_transaction
from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.engine import claim as claim_ops
from cyclone_dsl.engine import complete as complete_ops
from cyclone_dsl.engine.claim import Claimed
from cyclone_dsl.engine.complete import Failure, Success
from cyclone_dsl.engine.hooks import engine_hooks
from cyclone_dsl.engine.notify import WORK_CHANNEL
from cyclone_dsl.errors import InvalidArgument
from cyclone_dsl.states import ErrorKind
from cyclone_dsl.worker import execute
from cyclone_dsl.worker.context import StepContext
from cyclone_dsl.worker.scanner import Scanner
from cyclone_dsl.worker.threads import DaemonThreadPool

log = logging.getLogger("cyclone.worker")

#: When every slot was busy, wait this long for more slots before claiming again.
CLAIM_SETTLE_S = 0.002

#: Completion threads. Their transactions lock runs in id order, so they never deadlock.
COMPLETERS = 2


@attrs.define
class _Inflight:
    step: Claimed
    ctx: StepContext
    deadline: float | None  # monotonic time the handler's timeout passes
    settled: bool = False


class Worker:
    """Runs the handlers of the given modules or objects.

    ``Worker(dsn, [myapp.flows]).run()`` blocks until SIGTERM/SIGINT, then
    stops gracefully: no new claims, running handlers get ``grace`` seconds,
    and leases still held after that are released (available again at once,
    the attempt not counted). ``with Worker(...):`` runs the same worker in
    background threads of this process and stops it the same way on exit.
    """

    def __init__(
        self,
        dsn: str,
        objects: Iterable[object] = (),
        *,
        queues: Sequence[str] = ("default",),
        concurrency: int = 10,
        lease: float = 30.0,
        poll_interval: float = 1.0,
        grace: float = 30.0,
        scan_interval: float = 1.0,
        max_reclaims: int = 3,
        batch_size: int = 100,
        max_output_bytes: int = payload.DEFAULT_MAX_BYTES,
        scanners: bool = True,
        retention: timedelta | None = timedelta(days=7),
        catch_up: str = "latest",
        shift: timedelta = timedelta(0),
        name: str | None = None,
        registry: Registry | None = None,
    ) -> None:
        if concurrency < 1:
            raise InvalidArgument("concurrency must be at least 1")
        if lease <= 0 or poll_interval <= 0 or grace < 0:
            raise InvalidArgument("lease and poll_interval must be > 0, grace >= 0")
        if not queues:
            raise InvalidArgument("a worker needs at least one queue")
        self.registry = registry if registry is not None else Registry.from_objects(objects)
        self.handlers = dict(self.registry.handlers())
        self.queues = list(queues)
        self.concurrency = concurrency
        self.lease = timedelta(seconds=lease)
        self.poll_interval = poll_interval
        self.grace = grace
        self.batch_size = batch_size
        self.max_output_bytes = max_output_bytes
        self.shift = shift
        self.id = name or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.hooks = engine_hooks(self.registry)
        self._dsn = dsn
        self._max_reclaims = {
            kind: step.max_reclaims
            for kind, step in self.handlers.items()
            if step.max_reclaims is not None
        }
        self._default_max_reclaims = max_reclaims
        self._scan_interval = scan_interval
        self._with_scanners = scanners
        self._retention = retention
        if catch_up not in ("latest", "all"):
            raise InvalidArgument("catch_up must be 'latest' or 'all'")
        self._catch_up: Any = catch_up
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._closing = threading.Event()  # set once no lease is held: heartbeats end
        self._wake = threading.Event()
        self._slots = threading.Semaphore(concurrency)
        self._inflight: dict[int, _Inflight] = {}
        self._inflight_lock = threading.Lock()
        self._outcomes: queue.Queue[Success | Failure | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._pool: Any = None
        self._executor: DaemonThreadPool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scanner: Scanner | None = None
        self._takes_ctx: dict[str, bool] = {}
        self._queue_turn = 0
        self.completed_count = 0
        self._count_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------

    def run(self) -> None:
        """Run until SIGTERM or SIGINT (a second signal stops at once), then stop gracefully."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self._start_services()
            self._fetch_loop()
        finally:
            self._shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def start(self) -> Worker:
        """Run in background threads of this process; stop with :meth:`stop`."""
        self._start_services()
        self._spawn(self._fetch_loop_then_shutdown, "fetch")
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop claiming, let running handlers finish within the grace period, then return."""
        self._stopping.set()
        self._wake.set()
        self._stopped.wait(timeout if timeout is not None else self.grace + 30)

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stopping.is_set():
            log.warning("second signal: exiting now; held leases will expire and be reclaimed")
            os._exit(1)
        log.info("signal %s: stopping (grace %.0fs)", signum, self.grace)
        self._stopping.set()
        self._wake.set()

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=f"cyclone-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _start_services(self) -> None:
        self._pool = make_pool(
            self._dsn, name=f"cyclone-worker-{os.getpid()}", max_size=3 + COMPLETERS
        )
        self._executor = DaemonThreadPool(self.concurrency, "cyclone-handler")
        self._takes_ctx = {kind: step.takes_ctx for kind, step in self.handlers.items()}
        registered = self._tx(lambda tx: register_all(tx, self.registry))
        if registered:
            log.info("registered schedules %s", registered)
        if any(step.is_async for step in self.handlers.values()):
            self._loop = asyncio.new_event_loop()
            self._spawn(self._loop.run_forever, "asyncio")
        for number in range(COMPLETERS):
            self._spawn(self._complete_loop, f"complete-{number}")
        self._spawn(self._heartbeat_loop, "heartbeat")
        self._spawn(self._listen_loop, "listen")
        if self._with_scanners:
            self._scanner = Scanner(
                self._pool,
                interval=self._scan_interval,
                max_reclaims=self._max_reclaims,
                default_max_reclaims=self._default_max_reclaims,
                hooks=self.hooks,
                shift=self.shift,
                stopping=self._stopping,
                owner=self.id,
                compile_target=compiler_for(self.registry),
                catch_up=self._catch_up,
                retention=self._retention,
            )
            self._spawn(self._scanner.run, "scan")
        log.info(
            "worker %s started: queues %s, %d kinds, concurrency %d",
            self.id,
            self.queues,
            len(self.handlers),
            self.concurrency,
        )

    def _fetch_loop_then_shutdown(self) -> None:
        try:
            self._fetch_loop()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._stopping.set()
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline:
            with self._inflight_lock:
                if not self._inflight:
                    break
            time.sleep(0.02)
        with self._inflight_lock:
            left = [f for f in self._inflight.values() if not f.settled]
            for entry in left:
                entry.settled = True
                entry.ctx._cancelled.set()
            self._inflight.clear()
        if left:
            leases = [(f.step.id, f.step.generation) for f in left]
            try:
                released = self._tx(lambda tx: claim_ops.release(tx, leases))
                log.info("released %d leases at shutdown", len(released))
            except psycopg.Error:
                log.exception("could not release leases; they will expire and be reclaimed")
        self._outcomes.put(None)
        self._closing.set()
        for thread in self._threads:
            # The listener notices the stop within a second on its own; no need to wait for it.
            if thread is not threading.current_thread() and thread.name not in (
                "cyclone-asyncio",
                "cyclone-listen",
            ):
                thread.join(timeout=10)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._executor is not None:
            self._executor.shutdown()
        if self._pool is not None:
            self._pool.close()
        self._stopped.set()
        log.info("worker %s stopped", self.id)

    # -- claiming and running ----------------------------------------------------------

    def _tx(self, work: Any) -> Any:
        return in_transaction(self._pool, work, shift=self.shift)

    def _fetch_loop(self) -> None:
        kinds = sorted(self.handlers)
        backoff = 0.0
        while not self._stopping.is_set():
            free = 0
            while free < self.batch_size and self._slots.acquire(blocking=False):
                free += 1
            if free == 0:
                self._slots.acquire()  # wait for a slot, then count it
                free = 1
                if self._stopping.is_set():
                    self._slots.release()
                    break
                # Busy: let a few more slots free up so claims go in batches, not one by one.
                settle = time.monotonic() + CLAIM_SETTLE_S
                while free < min(self.batch_size, self.concurrency // 2):
                    if self._slots.acquire(timeout=max(0.0, settle - time.monotonic())):
                        free += 1
                    else:
                        break
            self._wake.clear()
            try:
                claimed = in_autocommit(self._pool, self._claimer(kinds, free), shift=self.shift)
                backoff = 0.0
            except psycopg.OperationalError as exc:
                claimed = []
                backoff = min(5.0, max(0.2, backoff * 2))
                log.warning("claim failed (%s); retrying in %.1fs", exc, backoff)
            for _ in range(free - len(claimed)):
                self._slots.release()
            for step in claimed:
                self._dispatch(step)
            if backoff:
                self._stopping.wait(backoff)
            elif not claimed or len(claimed) < free:
                self._wake.wait(self.poll_interval)

    def _claimer(self, kinds: list[str], limit: int) -> Callable[[Tx], list[Claimed]]:
        queues = self._rotated_queues()
        return lambda tx: claim_ops.claim(
            tx, owner=self.id, queues=queues, kinds=kinds, limit=limit, lease=self.lease
        )

    def _rotated_queues(self) -> list[str]:
        """The queues, starting from the next one each claim, so none is starved."""
        self._queue_turn = (self._queue_turn + 1) % len(self.queues)
        return self.queues[self._queue_turn :] + self.queues[: self._queue_turn]

    def _dispatch(self, step: Claimed) -> None:
        handler = self.handlers[step.kind]
        deadline = time.monotonic() + step.timeout_s if step.timeout_s else None
        entry = _Inflight(step, execute.make_context(step, lambda: self._beat(step)), deadline)
        with self._inflight_lock:
            self._inflight[step.id] = entry
        try:
            args = execute.call_arguments(handler.fn, step)
        except (TypeError, ValueError) as exc:  # an unreadable signature
            self._settle(entry, execute.failure_from_exception(step, exc, kind=ErrorKind.ERROR))
            return
        kwargs = {"ctx": entry.ctx} if self._takes_ctx[step.kind] else {}
        if handler.is_async:
            assert self._loop is not None
            future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(
                self._run_async(handler.fn, args, kwargs, step.timeout_s), self._loop
            )
        else:
            assert self._executor is not None
            future = self._executor.submit(handler.fn, *args, **kwargs)
        future.add_done_callback(lambda f: self._on_done(entry, f, handler.keep_output))

    @staticmethod
    async def _run_async(
        fn: Any, args: list[Any], kwargs: dict[str, Any], timeout: float | None
    ) -> Any:
        return await asyncio.wait_for(fn(*args, **kwargs), timeout)

    def _on_done(
        self, entry: _Inflight, future: concurrent.futures.Future[Any], keep_output: bool
    ) -> None:
        step = entry.step
        if future.cancelled():
            return
        exc = future.exception()
        if isinstance(exc, TimeoutError) and entry.deadline is not None:
            outcome: Success | Failure = execute.timeout_failure(step)
        elif exc is not None:
            outcome = execute.failure_from_exception(step, exc, kind=ErrorKind.ERROR)
        else:
            outcome = execute.success_from_result(
                step, future.result(), keep_output=keep_output, max_bytes=self.max_output_bytes
            )
        self._settle(entry, outcome)

    def _settle(self, entry: _Inflight, outcome: Success | Failure | None) -> None:
        with self._inflight_lock:
            if entry.settled:
                return
            entry.settled = True
            self._inflight.pop(entry.step.id, None)
        if outcome is not None:
            self._outcomes.put(outcome)
        self._slots.release()

    # -- completions -------------------------------------------------------------------

    def _complete_loop(self) -> None:
        while True:
            first = self._outcomes.get()
            if first is None:
                self._outcomes.put(None)  # for the other completers
                return
            batch = [first]
            while len(batch) < self.batch_size:
                try:
                    item = self._outcomes.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._outcomes.put(None)
                    break
                batch.append(item)
            self._commit(batch)

    def _commit(self, batch: list[Success | Failure]) -> None:
        """Commit outcomes: successes then failures, each group in one transaction.

        A lost connection is retried until it works (replaying is safe: a
        step that did complete is no longer running at this generation, so
        the replay is fenced). Any other database error would poison the whole
        batch, so the batch is split and the offending outcome turned into a
        final failure of its own step instead of wedging the rest.
        """
        successes = [o for o in batch if isinstance(o, Success)]
        failures = [o for o in batch if isinstance(o, Failure)]
        for group in (successes, failures):
            if group:
                self._commit_group(group)

    def _commit_group(self, group: Sequence[Success | Failure]) -> None:
        delay = 0.2
        while True:
            try:
                self._apply(group)
                return
            except psycopg.OperationalError as exc:
                log.warning("committing outcomes failed (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
                delay = min(10.0, delay * 2)
            except psycopg.Error as exc:
                if len(group) > 1:
                    for outcome in group:
                        self._commit_group([outcome])
                    return
                self._apply_poisoned(group[0], exc)
                return

    def _apply(self, group: Sequence[Success | Failure]) -> None:
        successes = [o for o in group if isinstance(o, Success)]
        failures = [o for o in group if isinstance(o, Failure)]
        if successes:
            done = self._tx(lambda tx: complete_ops.complete(tx, successes, self.hooks))
            with self._count_lock:  # two completers: += is not atomic
                self.completed_count += len(done)
            if len(done) < len(successes):
                log.info(
                    "%d completions fenced out (lease lost or run ended)",
                    len(successes) - len(done),
                )
        if failures:
            self._tx(lambda tx: complete_ops.fail(tx, failures, self.hooks))

    def _apply_poisoned(self, outcome: Success | Failure, exc: psycopg.Error) -> None:
        """The database refused this outcome: fail its step for good, with the reason."""
        log.error("step %s: the database refused its outcome: %s", outcome.step_id, exc)
        final = Failure(
            step_id=outcome.step_id,
            generation=outcome.generation,
            error=payload.sanitize_text(f"the database refused the step's outcome: {exc}"),
            error_kind=ErrorKind.INVALID_OUTPUT.value,
            retry=False,
        )
        try:
            self._tx(lambda tx: complete_ops.fail(tx, [final], self.hooks))
        except psycopg.Error:
            log.exception(
                "step %s: could not record its failure; its lease will expire", final.step_id
            )

    # -- leases --------------------------------------------------------------------------

    def _beat(self, step: Claimed) -> bool:
        held = self._tx(
            lambda tx: claim_ops.heartbeat(tx, [(step.id, step.generation)], self.lease)
        )
        return step.id in held

    def _heartbeat_loop(self) -> None:
        interval = max(0.05, self.lease.total_seconds() / 3)
        conn: psycopg.Connection[Any] | None = None
        next_beat = time.monotonic() + interval
        while not self._closing.is_set():
            self._closing.wait(min(0.1, interval))
            now = time.monotonic()
            with self._inflight_lock:
                entries = [e for e in self._inflight.values() if not e.settled]
            for entry in entries:
                if entry.deadline is not None and now > entry.deadline:
                    entry.ctx._cancelled.set()
                    self._settle(entry, execute.timeout_failure(entry.step))
            if now < next_beat:
                continue
            next_beat = now + interval
            leases = [(e.step.id, e.step.generation) for e in entries if not e.settled]
            if not leases:
                continue
            try:
                if conn is None or conn.closed:
                    conn = connect(self._dsn, name=f"cyclone-heartbeat-{os.getpid()}")
                held = claim_ops.heartbeat(Tx(conn, self.shift), leases, self.lease)
            except psycopg.Error as exc:
                log.warning("heartbeat failed: %s", exc)
                if conn is not None:
                    conn.close()
                conn = None
                continue
            for entry in entries:
                if entry.step.id not in held and not entry.settled:
                    log.warning(
                        "lease lost for step %s (run %s, node %r): result will be ignored",
                        entry.step.id,
                        entry.step.run_id,
                        entry.step.node,
                    )
                    entry.ctx._cancelled.set()
                    self._settle(entry, None)
        if conn is not None:
            conn.close()

    # -- wake-ups --------------------------------------------------------------------------

    def _listen_loop(self) -> None:
        delay = 0.5
        while not self._stopping.is_set():
            try:
                with connect(self._dsn, name=f"cyclone-listen-{os.getpid()}") as conn:
                    listen(conn, WORK_CHANNEL)
                    self._wake.set()  # LISTEN first, then rescan: nothing slips between
                    delay = 0.5
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=1.0):
                            if note.payload in self.queues:
                                self._wake.set()
                        ping(conn)  # a dead or half-open connection shows up here
            except psycopg.Error as exc:
                if self._stopping.is_set():
                    return
                log.warning("LISTEN connection lost (%s); reconnecting in %.1fs", exc, delay)
                self._stopping.wait(delay)
                delay = min(30.0, delay * 2)
