"""Run states, step states and error kinds, spelled exactly as in the schema."""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_RUN_STATES


class StepState(StrEnum):
    PENDING = "pending"
    AVAILABLE = "available"
    RUNNING = "running"
    WAITING_SIGNAL = "waiting_signal"
    WAITING_TIMER = "waiting_timer"
    WAITING_CHILD = "waiting_child"
    PAUSED = "paused"
    COMPLETED = "completed"
    DISCARDED = "discarded"
    CANCELLED = "cancelled"
    #: Not a database state: how the client shows a node its condition skipped (stored as
    #: ``completed`` with no output and error kind ``skipped``).
    SKIPPED = "skipped"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STEP_STATES


class ErrorKind(StrEnum):
    ERROR = "error"
    PANIC = "panic"
    PERMANENT = "permanent"
    TIMEOUT = "timeout"
    RECLAIM_LIMIT = "reclaim_limit"
    DEADLINE = "deadline"
    SIGNAL_TIMEOUT = "signal_timeout"
    OUTPUT_LIMIT = "output_limit"
    ITEM_LIMIT = "item_limit"
    INVALID_OUTPUT = "invalid_output"
    INVALID_INPUT = "invalid_input"
    DEP_FAILED = "dep_failed"
    CHILD_FAILED = "child_failed"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"  # a conditional node that did not run (its step is completed)
    RECLAIMED = "reclaimed"  # an attempt whose lease expired (the attempt history only)


class OnDepFailure(StrEnum):
    FAIL_RUN = "fail_run"
    CANCEL_BRANCH = "cancel_branch"


TERMINAL_RUN_STATES = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED})
TERMINAL_STEP_STATES = frozenset(
    {StepState.COMPLETED, StepState.DISCARDED, StepState.CANCELLED, StepState.SKIPPED}
)
