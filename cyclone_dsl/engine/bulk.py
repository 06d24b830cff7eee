"""Operations in bulk: cancel, retry or resume every run a :class:`RunFilter` selects.

An operation goes a page at a time, in run id order (keyset: the next page starts
after the last id seen), each page in the caller's transaction. The page's runs are
locked in id order as they are selected, waiting for (never skipping) a run a worker
is completing, and the filter is checked again on each row once it is locked. Each
run then goes through the engine's own single-run transition (the one
``client.cancel``, ``client.resume`` or a run-level retry uses) in a savepoint: a run
that transition refuses (it ended or was resumed meanwhile, a retry that cannot
finish it) is skipped with its reason, and the page goes on.

Only runs that existed when the operation started are considered (ids up to a bound
read first), so an operation ends even while new runs keep arriving, and a run it
retried that fails again is not retried twice by it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeVar

import attrs

from cyclone_dsl.db.tx import Tx
from cyclone_dsl.engine import control, waits
from cyclone_dsl.engine.notify import Coalesced
from cyclone_dsl.engine.transitions import Hooks
from cyclone_dsl.errors import (
    AlreadyTerminal,
    InvalidArgument,
    InvalidTransition,
    PassedDeadline,
    RunNotFound,
)
from cyclone_dsl.payload import is_text
from cyclone_dsl.sql import Q
from cyclone_dsl.states import ErrorKind, RunState

#: A bulk page's size unless told otherwise: runs per transaction.
DEFAULT_BATCH_SIZE = 500
MAX_BATCH_SIZE = 10_000


class BulkAction(StrEnum):
    """What a bulk operation does to each run it selects."""

    CANCEL = "cancel"
    RETRY = "retry"
    RESUME = "resume"

    @property
    def states(self) -> tuple[RunState, ...]:
        """The run states this action applies to."""
        return _APPLIES_TO[self]

    def states_under(self, where: RunFilter) -> tuple[RunState, ...]:
        """The run states this action selects under ``where`` (the filter's, else its
        default: every state it applies to, ``failed`` only for a retry);
        :class:`InvalidArgument` for a state it does not apply to."""
        if not where.states:
            return _DEFAULT_STATES[self]
        wrong = [s for s in where.states if s not in self.states]
        if wrong:
            allowed = " and ".join(s.value for s in self.states)
            raise InvalidArgument(
                f"{self.value} applies to {allowed} runs, not to "
                f"{', '.join(s.value for s in wrong)} ones"
            )
        return where.states


_APPLIES_TO = {
    BulkAction.CANCEL: (RunState.RUNNING, RunState.PAUSED),
    BulkAction.RETRY: (RunState.FAILED, RunState.CANCELLED),
    BulkAction.RESUME: (RunState.PAUSED,),
}
# A cancelled run was usually cancelled on purpose: retrying one is asked for by name.
_DEFAULT_STATES = {**_APPLIES_TO, BulkAction.RETRY: (RunState.FAILED,)}


def _listed(what: str, value: object) -> tuple[Any, ...]:
    """``value`` as a tuple: one name, or an iterable of them (not bytes, not a mapping)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, bytes | bytearray | Mapping):
        return tuple(value)
    raise InvalidArgument(f"{what} must be one or a list of them, not {value!r}")


def _names(what: str, value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    values = _listed(f"a {what}", value)
    for name in values:
        if not is_text(name):
            raise InvalidArgument(f"a {what} must be a non-empty string, not {name!r}")
    return tuple(dict.fromkeys(values))


def _workflows(value: str | Iterable[str] | None) -> tuple[str, ...]:
    return _names("workflow name", value)


def _queues(value: str | Iterable[str] | None) -> tuple[str, ...]:
    return _names("queue name", value)


def _states(value: RunState | str | Iterable[RunState | str] | None) -> tuple[RunState, ...]:
    return _members(RunState, "a run state; the states are", value)


def _error_kinds(
    value: ErrorKind | str | Iterable[ErrorKind | str] | None,
) -> tuple[ErrorKind, ...]:
    return _members(ErrorKind, "an error kind; the kinds are", value)


E = TypeVar("E", RunState, ErrorKind)


def _members(enum: type[E], what: str, value: E | str | Iterable[E | str] | None) -> tuple[E, ...]:
    """The members ``value`` names (one or several, duplicates dropped), or InvalidArgument
    listing the valid ones."""
    if value is None:
        return ()
    values = _listed(what.split(";")[0], value)
    found = []
    for name in values:
        try:
            found.append(enum(name))
        except ValueError:
            valid = ", ".join(m.value for m in enum)
            raise InvalidArgument(f"{name!r} is not {what} {valid}") from None
    return tuple(dict.fromkeys(found))


def _aware(_: object, attribute: attrs.Attribute[datetime | None], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(
            f"{attribute.name} must be a timezone-aware datetime "
            f"(datetime.now(UTC), not datetime.now()), not {value!r}"
        )


@attrs.frozen
class RunFilter:
    """Which runs a bulk operation (``cancel_many``, ``retry_many``, ``resume_many``) acts on.

    Every criterion given must hold; a criterion given several values holds when
    any of them does. Each takes one value or a list:

    * ``workflows``: the run's workflow name;
    * ``states``: the run's state (each must be one the operation applies to; by
      default every state it applies to, ``failed`` only for a retry);
    * ``queues``: one of the run's steps is in this queue;
    * ``error_kinds``: one of the run's steps carries this error kind (the step
      that failed the run, the steps its failure or a deadline cancelled, or one
      waiting to retry after a failed attempt), or one of its attempts failed with
      it (``reclaimed`` is only there): the runs ``list_runs(error_kind=...)`` lists;
    * ``since`` / ``until``: created at or after ``since`` and before ``until``;
    * ``ended_since`` / ``ended_until``: ended at or after / before (an open run
      has not ended and never matches these).

    Datetimes must be timezone-aware. A filter with no criterion is refused
    (:class:`InvalidArgument`): to act on every run an operation applies to, say
    so with ``RunFilter(match_all=True)``, which takes no other criterion.
    """

    workflows: tuple[str, ...] = attrs.field(default=(), converter=_workflows)
    states: tuple[RunState, ...] = attrs.field(default=(), converter=_states)
    queues: tuple[str, ...] = attrs.field(default=(), converter=_queues)
    error_kinds: tuple[ErrorKind, ...] = attrs.field(default=(), converter=_error_kinds)
    since: datetime | None = attrs.field(default=None, validator=_aware)
    until: datetime | None = attrs.field(default=None, validator=_aware)
    ended_since: datetime | None = attrs.field(default=None, validator=_aware)
    ended_until: datetime | None = attrs.field(default=None, validator=_aware)
    match_all: bool = attrs.field(default=False, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.match_all, bool):
            raise InvalidArgument(f"match_all must be True or False, not {self.match_all!r}")
        for low, high in (("since", "until"), ("ended_since", "ended_until")):
            start, end = getattr(self, low), getattr(self, high)
            if start is not None and end is not None and start >= end:
                raise InvalidArgument(f"{low} ({start}) must be before {high} ({end})")
        criteria = [name for name in self.criteria() if name]
        if self.match_all and criteria:
            raise InvalidArgument(
                "RunFilter(match_all=True) selects every run: give it no other criterion"
            )
        if not self.match_all and not criteria:
            raise InvalidArgument(
                "an empty RunFilter would select every run: give a criterion (workflows, "
                "states, queues, error_kinds, since, until, ended_since, ended_until), or "
                "say RunFilter(match_all=True)"
            )

    def criteria(self) -> tuple[object, ...]:
        """The criteria in field order (empty or None when not given)."""
        return (
            self.workflows,
            self.states,
            self.queues,
            self.error_kinds,
            self.since,
            self.until,
            self.ended_since,
            self.ended_until,
        )


@attrs.frozen
class BulkPage:
    """One page of a bulk operation: the runs it selected, what it did with each."""

    acted: tuple[int, ...]
    #: (run id, why the transition refused it), for the runs selected but not changed.
    skipped: tuple[tuple[int, str], ...]
    #: Where the next page starts (the last id selected), or None: this was the last.
    next_after: int | None

    @property
    def matched(self) -> int:
        return len(self.acted) + len(self.skipped)


def _params(action: BulkAction, where: RunFilter, up_to: int) -> dict[str, object]:
    return {
        "states": [s.value for s in action.states_under(where)],
        "up_to": up_to,
        "workflows": list(where.workflows) or None,
        "queues": list(where.queues) or None,
        "error_kinds": [k.value for k in where.error_kinds] or None,
        "since": where.since,
        "until": where.until,
        "ended_since": where.ended_since,
        "ended_until": where.ended_until,
    }


def bound(tx: Tx) -> int:
    """The newest run id now: an operation started now considers runs up to it."""
    row = tx.one(Q.bulk_bound)
    return int(row["up_to"]) if row else 0


def count(tx: Tx, action: BulkAction, where: RunFilter, *, up_to: int) -> int:
    """How many runs ``action`` under ``where`` selects now (no lock, nothing written)."""
    row = tx.one(Q.bulk_count, **_params(action, where, up_to))
    return int(row["runs"]) if row else 0


def _cancel(tx: Tx, run_id: int, hooks: Hooks) -> None:
    control.cancel(tx, run_id, hooks)


def _resume(tx: Tx, run_id: int, hooks: Hooks) -> None:
    waits.resume(tx, run_id, hooks)


_TRANSITIONS: dict[BulkAction, Callable[[Tx, int, Hooks], None]] = {
    BulkAction.CANCEL: _cancel,
    BulkAction.RETRY: control.retry_run,
    BulkAction.RESUME: _resume,
}

#: What a single-run transition raises when it refuses a run (nothing written).
_REFUSALS = (AlreadyTerminal, InvalidTransition, RunNotFound)


def page(
    tx: Tx,
    action: BulkAction,
    where: RunFilter,
    *,
    after_id: int,
    up_to: int,
    limit: int,
    hooks: Hooks,
) -> BulkPage:
    """Select (and lock) the next ``limit`` runs after ``after_id`` and act on each."""
    ids = [
        r["id"]
        for r in tx.rows(
            Q.bulk_lock_page, after_id=after_id, limit=limit, **_params(action, where, up_to)
        )
    ]
    transition = _TRANSITIONS[action]
    held = Coalesced(tx)  # one NOTIFY per channel for the page, not one per run
    acted: list[int] = []
    skipped: list[tuple[int, str]] = []
    for run_id in ids:
        # No savepoint per run: a transition refuses before it writes anything (an engine
        # rule), so a refused run leaves nothing behind and the page goes on.
        # What came due in the run and no scanner applied yet first (kept, even when the
        # transition then refuses the run), as the single-run operations do.
        waits.settle_due_in_tree(held, run_id, hooks)
        try:
            transition(held, run_id, hooks)
        except PassedDeadline as late:  # its end by the deadline came first: record it
            waits.fail_past_deadline(held, [{"id": late.deadline_run_id}], hooks)
            skipped.append((run_id, str(late)))
        except _REFUSALS as exc:
            skipped.append((run_id, str(exc)))
        else:
            acted.append(run_id)
    held.flush()
    return BulkPage(
        acted=tuple(acted),
        skipped=tuple(skipped),
        next_after=ids[-1] if len(ids) >= limit else None,
    )
