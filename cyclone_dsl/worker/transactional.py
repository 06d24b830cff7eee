"""Transactional handlers: the handler's writes and its step's completion in one transaction.

The handler gets ``ctx.connection``, inside a transaction the worker opened. When it
returns, the worker completes the step on that same connection, fenced by the lease
generation like every completion, and commits. Anything else rolls back the handler's
writes with the transaction:

* the handler raises (the failure is then recorded as usual, and a retry starts clean);
* its output cannot be stored (the step fails, as any step's would);
* the step was decided elsewhere meanwhile: its timeout passed, it was cancelled, or its
  lease was lost (the worker interrupts the statement the handler is running);
* the completion is fenced: the lease was reclaimed and claimed again since (a frozen
  worker that wakes up), so the step belongs to another execution.

The transaction stays open while the handler runs: transactional steps are for short
database work, bounded by the step's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from cyclone_dsl.db.callers import AsyncConnectionTx
from cyclone_dsl.db.clock import current_shift
from cyclone_dsl.db.handler_tx import (
    AnyConnection,
    AsyncPool,
    async_handler_connection,
    async_handler_pool,
    async_ready_for_completion,
    committed_after_reset,
    handler_connection,
    handler_pool,
    ready_for_completion,
    transaction_ended,
)
from cyclone_dsl.db.tx import ConnectionTx
from cyclone_dsl.engine import AfterCommit, Claimed, Engine, Failure, Success
from cyclone_dsl.errors import Permanent
from cyclone_dsl.states import ErrorKind
from cyclone_dsl.worker import execute
from cyclone_dsl.worker.context import StepContext

log = logging.getLogger("cyclone.worker")

#: What a transactional run returns: its completion committed with the handler's writes.
COMMITTED = object()
#: What a transactional run returns when it was rolled back and has nothing more to record
#: (its step was decided elsewhere, or its completion was fenced out).
DROPPED = object()


@attrs.frozen
class Call:
    """One transactional handler call and how the worker wants it decided."""

    step: Claimed
    fn: Callable[..., Any]
    args: list[Any]
    kwargs: dict[str, Any]
    ctx: StepContext
    keep_output: bool
    #: The rate-limit units its claim reserved (None: the handler is not rate limited).
    reserved_units: int | None
    isolation: str | None
    #: Take the decision for this step (False: it was decided elsewhere: roll back).
    decide: Callable[[], bool]
    #: Record the connection the handler runs on (None once it is given back), so that a
    #: timeout or a cancel can interrupt it.
    attach: Callable[[object], None]
    #: Mark the step's lease as held by the handler's transaction (True), or no longer
    #: (False): heartbeats then only check it, or renew it again.
    hold_lease: Callable[[bool], None] = lambda held: None
    #: Whether the handler may still be called (False: its step timed out, was cancelled
    #: or lost its lease while the call waited for a connection).
    may_start: Callable[[], bool] = lambda: True


class _RollBack(Exception):
    """Internal: end the handler's transaction without committing."""

    def __init__(self, outcome: Failure | None) -> None:
        super().__init__("rolled back")
        self.outcome = outcome


@contextlib.contextmanager
def _in_the_workers_transaction(conn: AnyConnection) -> Iterator[None]:
    """Around the handler's call: whether it returned or raised, fail the step for good if
    it ended the worker's transaction (see :func:`_refuse_an_ended_transaction`)."""
    try:
        yield
    except Exception as exc:
        _refuse_an_ended_transaction(conn, exc)
        raise
    _refuse_an_ended_transaction(conn)


def _refuse_an_ended_transaction(conn: AnyConnection, raised: Exception | None = None) -> None:
    """Fail the step for good if its handler ended the worker's transaction (a COMMIT or
    ROLLBACK sent as SQL: the connection is no longer in a transaction). What it wrote
    can no longer be kept together with the completion, which would run statement by
    statement; a retry would write again what a COMMIT kept."""
    if not transaction_ended(conn):
        return
    raise Permanent(
        "the handler ended its step's transaction itself (a COMMIT or ROLLBACK sent as "
        "SQL): its writes can no longer be kept with the step's completion, so the step "
        "fails without a retry (check what it wrote); raise to roll back instead"
    ) from raised


class TransactionalRunner:
    """Runs a worker's transactional handlers (sync on its threads, async on its loop).

    :meth:`run` and :meth:`run_async` return :data:`COMMITTED`, :data:`DROPPED`, or a
    :class:`Failure` the worker must record (the decision is then already taken: the output
    could not be stored, or the completion itself failed, so the step retries). A handler's
    own exception propagates, after the rollback, with the decision not taken: the worker
    records it like any handler's.
    """

    def __init__(
        self,
        engine: Engine,
        dsn: str,
        *,
        name: str,
        size: int,
        max_bytes: int,
        idle_s: float,
        pooled: bool = False,
    ) -> None:
        self._engine = engine
        self._dsn = dsn
        self._pooled = pooled
        self._name = name
        self._size = size
        self._max_bytes = max_bytes
        self._idle_s = idle_s
        self._pool = handler_pool(dsn, name=name, max_size=size, idle_s=idle_s, pooled=pooled)
        self._async_pool: AsyncPool | None = None

    def close(self) -> None:
        self._pool.close()

    async def aclose(self) -> None:
        if self._async_pool is not None:
            await self._async_pool.close()

    def _decided_outcome(self, call: Call, result: object) -> Success:
        """Take the decision, then the completion to record in the handler's transaction."""
        if not call.decide():
            raise _RollBack(None)
        units = call.reserved_units
        outcome = execute.success_from_result(
            call.step,
            result,
            keep_output=call.keep_output,
            max_bytes=self._max_bytes,
            extra_units=execute.extra_units(call.ctx, units) if units is not None else 0,
        )
        if isinstance(outcome, Failure):
            raise _RollBack(outcome)
        if call.step.gated:
            outcome = attrs.evolve(outcome, wake_queue=call.step.queue)
        return outcome

    def run(self, call: Call) -> object:
        """Run a sync handler in its transaction (on the caller's thread)."""
        outcome: Success | None = None
        try:
            with handler_connection(self._pool, call.isolation) as conn:
                call.attach(conn)
                if not call.may_start():  # it waited for a connection past its end
                    call.attach(None)
                    raise _RollBack(None)
                engine_tx = ConnectionTx(conn, current_shift())
                tx = AfterCommit(engine_tx)
                try:
                    if _old_snapshot(call):
                        call.hold_lease(True)
                    with conn.transaction():
                        if _old_snapshot(call):
                            self._hold_lease(call, self._engine.hold_lease(tx, call.step.id))
                        call.ctx._connection = conn
                        with _in_the_workers_transaction(conn):
                            result = call.fn(*call.args, **call.kwargs)
                        outcome = self._decided_outcome(call, result)
                        # The engine's time is now(), the start of this transaction.
                        age, isolation = ready_for_completion(conn, pooled=self._pooled)
                        _check_isolation(call, isolation)
                        engine_tx.shift = current_shift() + age
                        if not self._engine.complete(
                            tx, [outcome], old_snapshot=_old_snapshot(call)
                        ):
                            raise _RollBack(None)
                    committed_after_reset(conn, pooled=self._pooled)
                finally:
                    call.hold_lease(False)
                    call.ctx._connection = None
                    call.attach(None)  # before the connection goes back to the pool
                _send_quietly(call, lambda: tx.send(ConnectionTx(conn, current_shift())))
        except _RollBack as rolled:
            if rolled.outcome is None:
                self._end_if_past_deadline(call)
            return self._rolled_back(call, rolled)
        except Exception as exc:
            if outcome is None:
                raise  # the handler's (or its output's) failure: not decided yet
            return self._completion_failed(call, exc)
        return COMMITTED

    async def run_async(self, call: Call) -> object:
        """:meth:`run` for an async handler, on the worker's event loop, in the task the
        worker cancels at the step's timeout (no task of its own: one that outlived a
        cancellation it swallowed would go on with the connection)."""
        if self._async_pool is None:
            self._async_pool = async_handler_pool(
                self._dsn,
                name=self._name,
                max_size=self._size,
                idle_s=self._idle_s,
                pooled=self._pooled,
            )
            await self._async_pool.open()
        loop = asyncio.get_running_loop()
        outcome: Success | None = None
        try:
            async with async_handler_connection(self._async_pool, call.isolation) as conn:
                call.attach(conn)
                if not call.may_start():  # it waited for a connection past its end
                    call.attach(None)
                    raise _RollBack(None)
                engine_tx = AsyncConnectionTx(conn, loop, current_shift())
                tx = AfterCommit(engine_tx)
                try:
                    if _old_snapshot(call):  # may wait for a heartbeat: not on the loop
                        await asyncio.to_thread(call.hold_lease, True)
                    async with conn.transaction():
                        if _old_snapshot(call):
                            held = await asyncio.to_thread(
                                self._engine.hold_lease, tx, call.step.id
                            )
                            self._hold_lease(call, held)
                        call.ctx._connection = conn
                        with _in_the_workers_transaction(conn):
                            result = await execute.contained(call.fn(*call.args, **call.kwargs))
                        outcome = self._decided_outcome(call, result)
                        age, isolation = await async_ready_for_completion(conn, pooled=self._pooled)
                        _check_isolation(call, isolation)
                        engine_tx.shift = current_shift() + age
                        done = await asyncio.to_thread(
                            self._engine.complete, tx, [outcome], old_snapshot=_old_snapshot(call)
                        )
                        if not done:
                            raise _RollBack(None)
                    committed_after_reset(conn, pooled=self._pooled)
                finally:
                    call.hold_lease(False)
                    call.ctx._connection = None
                    call.attach(None)
                after = AsyncConnectionTx(conn, loop, current_shift())
                await asyncio.to_thread(_send_quietly, call, lambda: tx.send(after))
        except _RollBack as rolled:
            if rolled.outcome is None:
                await asyncio.to_thread(self._end_if_past_deadline, call)
            return self._rolled_back(call, rolled)
        except Exception as exc:
            if outcome is None:
                raise
            return self._completion_failed(call, exc)
        return COMMITTED

    def _end_if_past_deadline(self, call: Call) -> None:
        """A completion that found its run past its deadline ended the run in the handler's
        transaction, which then rolled back: record that end now, as a plain step's
        completion does, rather than at the scanner's next pass."""
        try:
            with handler_connection(self._pool, None) as conn:
                tx = AfterCommit(ConnectionTx(conn, current_shift()))
                with conn.transaction():
                    ended = self._engine.end_past_deadline(tx, call.step.run_id)
                if ended:
                    _send_quietly(call, lambda: tx.send(ConnectionTx(conn, current_shift())))
        except Exception as exc:  # noqa: BLE001 - the deadline scanner records it too
            log.info("run %s: its deadline's end was not recorded (%s)", call.step.run_id, exc)

    @staticmethod
    def _hold_lease(call: Call, held: bool) -> None:
        if not held:
            log.debug(
                "step %s: another step's lock holds its lease key; its lease is kept "
                "while that lock lasts",
                call.step.id,
            )

    @staticmethod
    def _completion_failed(call: Call, exc: Exception) -> Failure:
        """The completion or the commit failed (a serialization failure, a lost
        connection…): nothing was kept, the step retries like a failed one."""
        log.warning(
            "step %s (run %s, node %r): its transaction did not commit: %s",
            call.step.id,
            call.step.run_id,
            call.step.node,
            exc,
        )
        return execute.failure_from_exception(call.step, exc, kind=ErrorKind.ERROR)

    @staticmethod
    def _rolled_back(call: Call, rolled: _RollBack) -> object:
        if rolled.outcome is not None:
            return rolled.outcome
        log.info(
            "step %s (run %s, node %r): decided elsewhere or fenced out; its transaction "
            "was rolled back",
            call.step.id,
            call.step.run_id,
            call.step.node,
        )
        return DROPPED


def _check_isolation(call: Call, isolation: str) -> None:
    """Roll the attempt back, failed for good, when the handler changed its transaction's
    isolation level (SET TRANSACTION): the completion judges the run's other steps on the
    declared level's terms, and at repeatable read or serializable it must lock them (and
    the lease must be held by the transaction, from its start). Judged on a snapshot it did
    not expect, a join saw its sibling still running and was never activated."""
    declared = (call.isolation or "read committed").lower()
    actual = "read committed" if isolation == "read uncommitted" else isolation
    if actual == declared:
        return
    raise _RollBack(
        Failure(
            step_id=call.step.id,
            generation=call.step.generation,
            error=(
                f"the handler set its transaction's isolation to {actual} (SET TRANSACTION); "
                f"the step declares {declared}: declare it on the step instead, "
                f"@step(transactional=True, isolation={actual!r})"
            ),
            error_kind=ErrorKind.ERROR.value,
            retry=False,
        )
    )


def _old_snapshot(call: Call) -> bool:
    """Whether the handler's transaction reads one snapshot throughout (repeatable read,
    serializable): its completion must not judge other steps on it."""
    return call.isolation is not None and call.isolation.lower() != "read committed"


def _send_quietly(call: Call, send: Callable[[], None]) -> None:
    """Send a committed transaction's notifications; their loss only delays listeners
    until they poll."""
    try:
        send()
    except Exception as exc:  # noqa: BLE001 - committed already: nothing to undo
        log.info("step %s: its wake-ups were not sent (%s); listeners will poll", call.step.id, exc)
