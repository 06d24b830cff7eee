"""What the client returns: runs and their steps, as frozen attrs objects."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import attrs

from cyclone_dsl.payload import JSONValue
from cyclone_dsl.states import RunState, StepState


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
    lease_owner: str | None
    lease_expiry: datetime | None
    child_workflow: str | None
    signal_name: str | None
    signal_names: list[str] | None
    wait_count: int | None
    input: JSONValue  # the static input; see input_from and the input bindings otherwise
    input_from: str | None
    output: JSONValue

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Step:
        return cls(**{**row, "state": StepState(row["state"])})


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

    @property
    def is_terminal(self) -> bool:
        return self.state.is_terminal

    def step(self, node: str) -> Step:
        for candidate in self.steps:
            if candidate.node == node:
                return candidate
        raise KeyError(node)

    @classmethod
    def from_row(cls, row: dict[str, Any], steps: tuple[Step, ...] = ()) -> Run:
        return cls(**{**row, "state": RunState(row["state"]), "steps": steps})
