"""RunHandle, where a client waits for runs (WaitRoute), and the plan that follows a run's
events (run by a sync or async driver)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs

from cyclone_dsl.client.model import StepEvent
from cyclone_dsl.db.connect import listen_target
from cyclone_dsl.db.follow import (
    ConnectionLost,
    Listen,
    Notifications,
    Output,
    Pause,
    Plan,
    ReadAll,
)
from cyclone_dsl.engine import EVENTS_CHANNEL, RUN_DONE_CHANNEL, names_run
from cyclone_dsl.errors import ClientClosed, InvalidArgument, NoOutput, RunFailed, RunNotFound
from cyclone_dsl.payload import JSONValue
from cyclone_dsl.sql import Q
from cyclone_dsl.states import ErrorKind, RunState, StepState

if TYPE_CHECKING:
    from cyclone_dsl.client.model import Run
    from cyclone_dsl.client.sync import Client

#: Even without a notification (a lost LISTEN connection), state is re-read this often.
RECHECK_SECONDS = 1.0
#: Pause before replacing a wait connection that was lost.
RECONNECT_SECONDS = 0.5
#: Without LISTEN (a pooled DSN and no ``listen_dsn``), a waiting client reads this often.
POLL_SECONDS = 0.25


@attrs.frozen
class WaitRoute:
    """Where a client waits for runs: a direct connection that LISTENs (``listen_dsn``, or a
    DSN that is not pooled), or else the pooled DSN, read every :data:`POLL_SECONDS`."""

    dsn: str
    listen: bool
    pooled: bool

    @classmethod
    def of(cls, dsn: str, *, pooled: bool, listen_dsn: str | None) -> WaitRoute:
        target = listen_target(dsn, pooled=pooled, listen_dsn=listen_dsn)
        if target is None:
            return cls(dsn, listen=False, pooled=True)
        return cls(target, listen=True, pooled=False)

    @property
    def recheck(self) -> float:
        return RECHECK_SECONDS if self.listen else POLL_SECONDS


#: Events read per statement while a follower catches up.
EVENTS_PAGE = 500


@attrs.frozen
class RunHandle:
    """A reference to a submitted run. ``created`` is False when an existing run was returned."""

    id: int
    client: Client = attrs.field(repr=False, eq=False)
    created: bool = True

    def get(self) -> Run:
        return self.client.get_run(self.id)

    def wait(self, timeout: float | None = None) -> Run:
        """Block until the run is terminal and return it; ``TimeoutError`` after ``timeout``
        seconds (None or infinity: no limit; a negative or NaN one: InvalidArgument)."""
        return self.client.wait(self.id, timeout)

    def result(self, timeout: float | None = None) -> JSONValue:
        """Wait, then return the result node's output.

        Raises :class:`RunFailed` for a failed or cancelled run and
        :class:`NoOutput` when the workflow defines no result.
        """
        return self.client.result(self.id, timeout)

    def events(self, after: int = 0, *, timeout: float | None = None) -> Iterator[StepEvent]:
        """The run's events (``ctx.emit``, ``ctx.progress``) after seq ``after``, in order,
        live: waits for new ones, and ends once the run has ended and every event it
        recorded was yielded (see :meth:`Client.events`)."""
        return self.client.events(self.id, after=after, timeout=timeout)


def deadline_of(timeout: object) -> float | None:
    """The monotonic time a wait of ``timeout`` seconds ends (None, or infinity: never);
    :class:`InvalidArgument` for a negative, NaN or non-numeric one."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        seconds = math.nan
    else:
        try:
            seconds = float(timeout)
        except OverflowError:  # an int past the float range: as long as infinity
            seconds = math.inf if timeout > 0 else -math.inf
    if math.isnan(seconds) or seconds < 0:
        raise InvalidArgument(f"timeout must be a number of seconds >= 0 or None, not {timeout!r}")
    return None if math.isinf(seconds) else time.monotonic() + seconds


def _check_open(closed: Callable[[], bool], doing: str) -> None:
    if closed():
        raise ClientClosed(f"the client was closed while {doing}")


def checked_after(after: object) -> int:
    """An events offset: a seq, an integer >= 0 (0: from the start)."""
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise InvalidArgument(f"after must be an event seq, an integer >= 0, not {after!r}")
    return after


def events_plan(
    run_id: int,
    after: int,
    timeout: float | None,
    *,
    recheck: float = RECHECK_SECONDS,
    closed: Callable[[], bool] = lambda: False,
) -> Plan[None]:
    """Output the run's events after seq ``after`` in order, live, and end once the run is
    terminal and every event it recorded was output.

    LISTEN only wakes the plan up: it always reads by seq from the table (and re-reads
    every ``recheck`` seconds without a notification), so a lost notification or a
    connection cut delays events, never skips one. Each read returns the run's state and
    the next events in one snapshot: a terminal state there means no event is left.
    Raises :class:`RunNotFound`, ``TimeoutError`` after ``timeout`` seconds, or
    :class:`ClientClosed` at the first look after ``closed()`` became true.
    """
    deadline = deadline_of(timeout)
    cursor = after
    doing = f"following the events of run {run_id}"
    while True:
        try:
            yield Listen((EVENTS_CHANNEL, RUN_DONE_CHANNEL))
            while True:
                params: dict[str, object] = {
                    "run_id": run_id,
                    "after": cursor,
                    "limit": EVENTS_PAGE,
                }
                rows: list[dict[str, Any]] = yield ReadAll(Q.run_events_after, params)
                _check_open(closed, doing)
                if not rows:
                    raise RunNotFound(run_id)
                found = tuple(StepEvent.from_row(run_id, r) for r in rows if r["seq"] is not None)
                if found:
                    cursor = found[-1].seq
                    yield Output(found)
                if len(found) >= EVENTS_PAGE:
                    continue
                state = RunState(rows[0]["run_state"])
                if state.is_terminal:
                    return
                if deadline is not None and deadline - time.monotonic() <= 0:
                    raise TimeoutError(f"run {run_id} is still {state} after {timeout}s")
                yield from _until_woken(run_id, deadline, recheck)
        except ConnectionLost:
            yield from _reconnect(run_id, deadline, timeout, closed, doing)


def _until_woken(run_id: int, deadline: float | None, recheck: float) -> Plan[None]:
    """Wait for a notification naming the run, or ``recheck`` seconds (never past the
    deadline): then the plan reads again."""
    recheck_at = time.monotonic() + recheck_in(deadline, recheck)
    while True:
        left = max(0.0, recheck_at - time.monotonic())
        payloads: list[str] = yield Notifications(left)
        if left == 0 or any(names_run(p, run_id) for p in payloads):
            return


def _reconnect(
    run_id: int,
    deadline: float | None,
    timeout: float | None,
    closed: Callable[[], bool],
    doing: str,
) -> Plan[None]:
    """After a lost connection: give up once the client is closed (:class:`ClientClosed`:
    an outage would otherwise keep the plan reconnecting) or past the deadline, else
    pause, then reconnect."""
    _check_open(closed, doing)
    if deadline is not None and time.monotonic() >= deadline:
        # Raised while the plan handles ConnectionLost: that cause is said in the message.
        raise TimeoutError(f"run {run_id}: no answer from PostgreSQL in {timeout}s") from None
    yield Pause(RECONNECT_SECONDS)


def recheck_in(deadline: float | None, recheck: float = RECHECK_SECONDS) -> float:
    """Seconds to wait for a notification before reading the state again."""
    if deadline is None:
        return recheck
    return max(0.0, min(recheck, deadline - time.monotonic()))


def outcome_from_row(row: dict[str, Any] | None, run_id: int) -> JSONValue:
    if row is None:
        raise RunNotFound(run_id)
    state = RunState(row["state"])
    if state in (RunState.FAILED, RunState.CANCELLED):
        error, kind = row["failed_error"], row["failed_error_kind"]
        # The run's own end, when no step failure ended it: a step that waited to retry
        # keeps its last attempt's error when the run's end cancels it.
        if state == RunState.CANCELLED and kind != ErrorKind.CANCELLED:
            error, kind = "the run was cancelled", ErrorKind.CANCELLED.value
        elif state == RunState.FAILED and row["past_deadline"] and not row["failed_at_end"]:
            error, kind = "the run passed its deadline", ErrorKind.DEADLINE.value
        raise RunFailed(run_id, state.value, row["failed_node"], error, kind)
    if row["result_node"] is None:
        raise NoOutput(f"run {run_id}: its workflow defines no result")
    if row["result_state"] in (StepState.CANCELLED, StepState.DISCARDED):
        # A failure contained by on_dep_failure="cancel_branch" cut the result node off:
        # the run completed, but None would pass for a result the node never gave.
        raise NoOutput(
            f"run {run_id} completed, but its result node {row['result_node']!r} was "
            f"{row['result_state']}: a failure upstream of it was contained (cancel_branch)"
        )
    result: JSONValue = row["result"]
    return result
