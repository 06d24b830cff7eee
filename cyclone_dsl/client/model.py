"""What the client returns: runs and their steps, as frozen attrs objects."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import attrs

from cyclone_dsl.payload import JSONValue
from cyclone_dsl.states import ErrorKind, RunState, StepState


@attrs.frozen
class Attempt:
    """One execution of a step that did not complete it: it failed (``outcome``
    ``retried`` or ``failed``), its lease expired (``reclaimed``), or its worker stopped
    and gave the lease back (``released``; the attempt is not spent); or one an operator
    retry or replay reset: ``replayed`` (it had completed), ``cancelled`` (a cancel had
    stopped it).

    ``number`` counts from 1, like ``StepContext.attempt``; a reclaimed execution
    keeps its number, and the next run of it has the same one.
    """

    number: int
    outcome: str
    worker: str | None
    started_at: datetime | None
    ended_at: datetime
    error: str | None
    error_kind: str | None
    panic_stack: str | None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Attempt:
        return cls(
            number=row["attempt"],
            outcome=row["outcome"],
            worker=row["worker"],
            started_at=row["started_at"],
            ended_at=row["ended_at"],
            error=row["error"],
            error_kind=row["error_kind"],
            panic_stack=row["panic_stack"],
        )


#: Outcomes whose execution was counted in ``attempt`` (a failure); a reclaim is not.
_COUNTED = frozenset({StepState.RUNNING, StepState.COMPLETED})


def shown_state(row: dict[str, Any]) -> StepState:
    """A step row's state as the client shows it: a node its condition skipped is stored
    as completed (error kind ``skipped``) and shown as :attr:`StepState.SKIPPED`."""
    state = StepState(row["state"])
    if state is StepState.COMPLETED and row.get("error_kind") == ErrorKind.SKIPPED:
        return StepState.SKIPPED
    return state


@attrs.frozen
class Step:
    id: int
    node: str
    kind: str
    state: StepState
    attempt: int
    max_attempts: int
    reclaims: int
    queue: str
    priority: int
    error: str | None
    error_kind: str | None
    panic_stack: str | None
    scheduled_at: datetime
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    item_of: str | None
    item_index: int | None
    #: The worker holding the lease while the step runs; once it completed, the worker
    #: that completed it (a failed attempt's worker is in ``attempts``).
    lease_owner: str | None
    lease_expiry: datetime | None
    child_workflow: str | None
    signal_name: str | None
    signal_names: list[str] | None
    wait_count: int | None
    input: JSONValue  # the static input; see input_from and the input bindings otherwise
    input_from: str | None
    output: JSONValue
    attempts: tuple[Attempt, ...] = ()  # the executions that did not complete it
    #: In a fork: the output was copied from the source run; the step did not run.
    copied: bool = False

    @property
    def attempt_number(self) -> int:
        """The number of the step's latest execution, from 1 (0: it never ran).

        The same number a running handler sees as ``ctx.attempt``, and the one the CLI
        and the dashboard show as ``attempt N/max_attempts``. The ``attempt`` column
        counts failed executions, so a running or completed step is on ``attempt + 1``;
        a step discarded after failures, or waiting for its retry, last ran as
        ``attempt``; one discarded for its reclaims ran ``attempt + 1`` times.
        """
        if self.state in _COUNTED or self.error_kind == "reclaim_limit":
            return self.attempt + 1
        return self.attempt

    @property
    def attempt_label(self) -> str:
        """``attempt_number/max_attempts``, or ``-`` for a step that never ran."""
        number = self.attempt_number
        return f"{number}/{self.max_attempts}" if number else "-"

    @classmethod
    def from_row(
        cls, row: dict[str, Any], attempts: tuple[Attempt, ...] = (), *, copied: bool = False
    ) -> Step:
        return cls(**{**row, "state": shown_state(row), "attempts": attempts, "copied": copied})


@attrs.frozen
class Run:
    id: int
    workflow: str
    def_version: str
    input: JSONValue
    state: RunState
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    deadline_at: datetime | None
    result_node: str | None
    submit_key: str | None
    paused_at: datetime | None
    parent_run_id: int | None
    parent_node_id: str | None
    steps: tuple[Step, ...] = ()
    #: For a fork (``client.fork``): the run it was forked from, and the node.
    forked_from: int | None = None
    fork_node: str | None = None

    @property
    def is_terminal(self) -> bool:
        return self.state.is_terminal

    def step(self, node: str) -> Step:
        for candidate in self.steps:
            if candidate.node == node:
                return candidate
        raise KeyError(node)

    @classmethod
    def from_row(
        cls, row: dict[str, Any], steps: tuple[Step, ...] = (), fork: dict[str, Any] | None = None
    ) -> Run:
        return cls(
            **{**row, "state": RunState(row["state"]), "steps": steps},
            forked_from=fork["source_run_id"] if fork else None,
            fork_node=fork["from_node"] if fork else None,
        )


@attrs.frozen
class StepEvent:
    """One event a running step reported (``ctx.emit`` or ``ctx.progress``).

    ``seq`` numbers a run's events from 1, in the order they were stored.
    ``kind`` is ``"event"`` (``data`` is the value given to ``ctx.emit``) or
    ``"progress"`` (``data`` is ``{"done": int, "total": int, "message": str | None}``).
    ``attempt`` is the execution that wrote it (like ``ctx.attempt``); ``at`` its time
    by the database clock. ``fenced`` is True when that execution did not hold the
    step's lease when it wrote the event, or lost it later to a reclaim or a release
    (the step ran again): the event is kept, but its work may have been repeated.
    """

    seq: int
    run_id: int
    node: str
    step_id: int
    attempt: int
    kind: str
    data: JSONValue
    at: datetime
    fenced: bool

    @classmethod
    def from_row(cls, run_id: int, row: dict[str, Any]) -> StepEvent:
        return cls(
            seq=row["seq"],
            run_id=run_id,
            node=row["node"],
            step_id=row["step_id"],
            attempt=row["attempt"],
            kind=row["kind"],
            data=row["payload"],
            at=row["created_at"],
            fenced=row["fenced"],
        )
