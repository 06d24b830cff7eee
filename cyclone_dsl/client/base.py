"""Client argument checks without I/O (compiling lives in :mod:`cyclone_dsl.dsl.runs`)."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from typing import Any, Final

from cyclone_dsl.dsl.flow import MAX_LIMIT
from cyclone_dsl.durations import MAX_DURATION, is_duration, refusal
from cyclone_dsl.engine import LIVE_FOR
from cyclone_dsl.errors import InvalidArgument, RunNotFound
from cyclone_dsl.graph.validate import MAX_SIGNAL_NAME_BYTES, queue_problem
from cyclone_dsl.payload import JSONValue, encode, is_text, text_problem
from cyclone_dsl.states import ErrorKind, RunState

#: The longest key or signal name (bytes of UTF-8): a wait takes no longer name.
MAX_KEY_BYTES = MAX_SIGNAL_NAME_BYTES

#: The run states purge deletes unless told otherwise: every terminal one.
ENDED_STATES: tuple[RunState, ...] = (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED)


class Unset(enum.Enum):
    """The type of :data:`UNSET`: an argument left out (where ``None`` is a value)."""

    UNSET = "UNSET"


#: An argument left out.
UNSET = Unset.UNSET


def checked_run_id(run_id: object) -> int:
    """``run_id`` if it is a run's id (an int); :class:`InvalidArgument` for anything else,
    and :class:`RunNotFound` for an int no bigint column holds, before any statement is
    sent."""
    if isinstance(run_id, int) and not isinstance(run_id, bool):
        if not -(2**63) <= run_id < 2**63:
            raise RunNotFound(run_id)
        return run_id
    hint = " (a handle's run id is handle.id)" if hasattr(run_id, "id") else ""
    raise InvalidArgument(f"expected a run id (an int), not {run_id!r}{hint}")


def checked_inputs(inputs: object) -> list[JSONValue]:
    """A bulk submit's inputs as a list, read once: any iterable of inputs but a string,
    bytes or a mapping, which iterate as characters or keys (``submit_many(wf, "abc")``
    would make three runs); :class:`InvalidArgument` for those and for a non-iterable."""
    if isinstance(inputs, str | bytes | bytearray | Mapping) or not isinstance(inputs, Iterable):
        raise InvalidArgument(
            f"inputs must be a list (or another iterable) of run inputs, one per run, not "
            f"{inputs!r:.80}"
        )
    return list(inputs)


def encoded_inputs(inputs: list[JSONValue], what: str) -> list[str]:
    """The JSON text of each input of a bulk call; an error names the input (``$[3]``,
    ``the run input [3]``)."""
    return [
        encode(value, what=f"{what} [{index}]", path=f"$[{index}]")
        for index, value in enumerate(inputs)
    ]


def check_older_than(older_than: object) -> None:
    # A cutoff before PostgreSQL's first timestamp (4713 BC) would raise in SQL.
    if not isinstance(older_than, timedelta) or not timedelta(0) <= older_than <= MAX_DURATION:
        raise InvalidArgument(
            f"older_than must be a timedelta from 0 to 1000 years, not {older_than!r}"
        )


#: How long a purge keeps trying the runs its batches skipped because another
#: transaction held them (a retry or a signal of them, another purge's batch).
PURGE_LOCK_WAIT_S: Final = 2.0


def purge_pauses() -> Iterator[float]:
    """The pauses before a purge tries its skipped runs again: doubling, from 20 ms, up
    to :data:`PURGE_LOCK_WAIT_S` in all."""
    pause, waited = 0.02, 0.0
    while waited + pause <= PURGE_LOCK_WAIT_S:
        yield pause
        waited += pause
        pause *= 2


def checked_text(name: str, value: object) -> str:
    """``value`` if it is a non-empty string a text column can store (see
    :func:`~cyclone_dsl.payload.is_text`); :class:`InvalidArgument` for anything else, before
    any statement is sent."""
    if not is_text(value):
        raise InvalidArgument(
            f"{name} must be a non-empty string without NUL characters or lone surrogates, "
            f"not {value!r}"
        )
    return value


def checked_count(name: str, value: object, low: int = 1, high: int = 2**63 - 1) -> int:
    """``value`` if it is an int (not a bool) from ``low`` to ``high`` (by default what a
    bigint holds); :class:`InvalidArgument` for anything else."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgument(f"{name} must be an integer from {low} to {high}, not {value!r}")
    return value


def checked_id(name: str, value: object) -> int:
    """``value`` if it is an id (an int of 64 bits); :class:`InvalidArgument` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value
    raise InvalidArgument(f"{name} must be an id (an int of 64 bits), not {value!r}")


def checked_aware(name: str, value: object) -> datetime:
    """``value`` if it is a timezone-aware datetime; :class:`InvalidArgument` otherwise."""
    if isinstance(value, datetime) and value.utcoffset() is not None:
        return value
    raise InvalidArgument(
        f"{name} must be a timezone-aware datetime (datetime.now(UTC), not datetime.now()), "
        f"not {value!r}"
    )


def check_deadline(deadline: timedelta | None) -> timedelta | None:
    if deadline is None:
        return None
    if not is_duration(deadline):
        raise InvalidArgument(refusal("deadline", deadline))
    return deadline


def check_scheduled_at(scheduled_at: datetime | None) -> None:
    if scheduled_at is not None:
        checked_aware("scheduled_at", scheduled_at)


def run_state(value: RunState | str) -> RunState:
    """A run state from its name, or :class:`InvalidArgument` listing the valid ones."""
    try:
        return RunState(value)
    except ValueError:
        valid = ", ".join(s.value for s in RunState)
        raise InvalidArgument(f"{value!r} is not a run state; the states are {valid}") from None


def error_kind(value: object) -> str:
    """An error kind's name, or :class:`InvalidArgument` listing the valid ones."""
    try:
        return ErrorKind(value if isinstance(value, str) else "").value
    except ValueError:
        valid = ", ".join(k.value for k in ErrorKind)
        raise InvalidArgument(f"{value!r} is not an error kind; the kinds are {valid}") from None


def purge_states(states: object) -> list[RunState]:
    """The states to purge, checked: a collection of terminal run states."""
    if isinstance(states, str | bytes | Mapping) or not isinstance(states, Iterable):
        raise InvalidArgument(
            f"states must be a tuple of terminal run states (completed, failed, cancelled), "
            f"not {states!r:.80}"
        )
    wanted = [run_state(s) for s in states]
    if not wanted or any(not s.is_terminal for s in wanted):
        raise InvalidArgument(
            "purge deletes terminal runs only: give states among completed, failed and cancelled"
        )
    return wanted


def check_key(what: str, key: object) -> None:
    wrong = text_problem(what, key, MAX_KEY_BYTES)
    if wrong is not None:
        raise InvalidArgument(wrong)


def check_queue_limit(queue: object, limit: object) -> None:
    wrong = queue_problem(queue)
    if wrong is not None:
        raise InvalidArgument(wrong)
    if limit is not None and (
        not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT
    ):
        raise InvalidArgument(
            f"a queue limit must be an integer from 1 to {MAX_LIMIT}, or None, not {limit!r}"
        )


def wait_reason(row: Mapping[str, Any]) -> str:
    """Why a step waits, in words, from a row of the engine's wait reasons."""
    scope: str = row["scope"]
    kind, _, name = scope.partition(":")
    share = f"{row['key']}: " if row["key"] else ""
    full = f"{row['in_use']}/{row['max_count']}"
    if kind == "rate":
        until = row["free_at"]
        when = until.strftime("%H:%M:%S") if until is not None else "the window has room"
        return f"rate limited until {when} ({name}, {share}{full} in the window)"
    if kind == "run":
        return f"waiting for a run slot of {name} ({share}{full} runs under way)"
    if kind == "queue":
        return f"waiting for queue {name} ({full} running: its cap)"
    return f"waiting for a concurrency slot ({share}{full})"


def live_for(value: timedelta | None) -> timedelta:
    """How recent a worker's last beat must be for it to count as live (workers beat every
    few seconds): ``value``, or the engine's default."""
    if value is None:
        return LIVE_FOR
    if not is_duration(value):
        raise InvalidArgument(refusal("live_for", value))
    return value
