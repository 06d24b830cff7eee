"""Completion and failure of leased steps, in batches, fenced by lease generation."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from cyclone_dsl.db.tx import Tx
from cyclone_dsl.engine import gates, sequences
from cyclone_dsl.engine.transitions import (
    Hooks,
    after_completions,
    after_discards,
    end_past_deadline,
)
from cyclone_dsl.failpoints import failpoint
from cyclone_dsl.sql import Q
from cyclone_dsl.states import StepState


@attrs.frozen
class Success:
    step_id: int
    generation: int
    output: str | None  # JSON text, None for an action or a None result
    extra_units: int = 0  # rate-limit units the handler used beyond its claim's
    wake_queue: str | None = None  # a limited step: its end frees a slot, wake that queue


@attrs.frozen
class Failure:
    step_id: int
    generation: int
    error: str
    error_kind: str
    panic_stack: str | None = None
    retry: bool = True
    delay_s: float = 0.0
    wake_queue: str | None = None  # a limited step: its end frees a slot, wake that queue


def complete(
    tx: Tx, results: Sequence[Success], hooks: Hooks, *, old_snapshot: bool = False
) -> set[int]:
    """Record successes; return the ids applied (the others were fenced out).

    ``old_snapshot``: the transaction reads a snapshot taken before this call (repeatable
    read, serializable), so a sibling step that changed since raises a serialization
    failure (see the ``lock_open_siblings`` statement) rather than be judged as it was.
    """
    if not results:
        return set()
    # A run past its deadline fails first: these steps' completions are then fenced out.
    end_past_deadline(tx, tx.rows(Q.lock_runs_of_steps, ids=[r.step_id for r in results]), hooks)
    if old_snapshot:
        tx.rows(Q.lock_open_siblings, ids=[r.step_id for r in results])
    done = tx.rows(
        Q.complete_steps,
        ids=[r.step_id for r in results],
        generations=[r.generation for r in results],
        outputs=[r.output for r in results],
    )
    after_completions(tx, done, hooks)
    sequences.wake_next(tx, done)
    gates.wake_freed(tx, [(r.step_id, r.wake_queue) for r in results if r.wake_queue])
    failpoint("complete.before_commit")
    return {r["id"] for r in done}


def fail(tx: Tx, failures: Sequence[Failure], hooks: Hooks) -> dict[int, str]:
    """Record failed executions: retry or discard; return the ids applied, each with the
    state its step moved to (``discarded``: failed for good; else it retries)."""
    if not failures:
        return {}
    end_past_deadline(tx, tx.rows(Q.lock_runs_of_steps, ids=[f.step_id for f in failures]), hooks)
    rows = tx.rows(
        Q.fail_steps,
        ids=[f.step_id for f in failures],
        generations=[f.generation for f in failures],
        retry=[f.retry for f in failures],
        delays=[f.delay_s for f in failures],
        errors=[f.error for f in failures],
        error_kinds=[f.error_kind for f in failures],
        stacks=[f.panic_stack for f in failures],
    )
    woken = [r["queue"] for r in rows if r["state"] == StepState.AVAILABLE]
    gates.wake_freed(tx, [(f.step_id, f.wake_queue) for f in failures if f.wake_queue], woken)
    sequences.wake_next(tx, rows)  # a retry's backoff lets the next of its key overtake it
    discarded = [r for r in rows if r["state"] == StepState.DISCARDED]
    if discarded:
        after_discards(tx, discarded, hooks)
    failpoint("fail.before_commit")
    return {r["id"]: r["state"] for r in rows}
