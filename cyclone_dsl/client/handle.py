"""RunHandle, and where a client waits for runs and follows their events (WaitRoute)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs

from cyclone_dsl.client.model import StepEvent
from cyclone_dsl.db.connect import listen_target
from cyclone_dsl.errors import InvalidArgument, NoOutput, RunFailed, RunNotFound
from cyclone_dsl.payload import JSONValue
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


#: The largest seq an event can have (a bigint column).
MAX_SEQ = 2**63 - 1


def checked_after(after: object) -> int:
    """An events offset: a seq, an integer >= 0 (0: from the start). One past every seq
    there can be means the same as the largest: no event comes after it."""
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise InvalidArgument(f"after must be an event seq, an integer >= 0, not {after!r}")
    return min(after, MAX_SEQ)


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
