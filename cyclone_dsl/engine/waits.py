"""Time-driven transitions: timers, signal-wait timeouts, run deadlines, pause and resume."""

from __future__ import annotations

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine.transitions import (
    Hooks,
    activate,
    after_completions,
    after_discards,
    end_runs,
)
from cyclone_dsl.errors import AlreadyTerminal, InvalidTransition, RunNotFound
from cyclone_dsl.sql import Q
from cyclone_dsl.states import ErrorKind, RunState


def fire_timers(tx: Tx, page: list[Row], hooks: Hooks) -> int:
    if not page:
        return 0
    tx.rows(Q.lock_runs, run_ids=sorted({r["run_id"] for r in page}))
    done = tx.rows(Q.fire_timers, ids=[r["id"] for r in page])
    after_completions(tx, done, hooks)
    return len(done)


def time_out_signal_waits(tx: Tx, page: list[Row], hooks: Hooks) -> int:
    if not page:
        return 0
    tx.rows(Q.lock_runs, run_ids=sorted({r["run_id"] for r in page}))
    failed = tx.rows(Q.time_out_signal_waits, ids=[r["id"] for r in page])
    if failed:
        after_discards(tx, failed, hooks)
    return len(failed)


def fail_past_deadline(tx: Tx, page: list[Row], hooks: Hooks) -> int:
    if not page:
        return 0
    run_ids = sorted(r["id"] for r in page)
    tx.rows(Q.lock_runs, run_ids=run_ids)
    due = [r["id"] for r in tx.rows(Q.runs_past_deadline, run_ids=run_ids)]
    if not due:
        return 0
    ended = end_runs(
        tx,
        due,
        RunState.FAILED,
        error="the run passed its deadline",
        error_kind=ErrorKind.DEADLINE,
        hooks=hooks,
    )
    return len(ended)


def pause(tx: Tx, run_id: int) -> None:
    """Pause a running run: ready and pending work waits; running steps finish."""
    run = _locked(tx, run_id)
    if RunState(run["state"]) == RunState.PAUSED:
        raise InvalidTransition(f"run {run_id} is already paused")
    tx.rows(Q.pause_run, run_id=run_id)


def resume(tx: Tx, run_id: int, hooks: Hooks) -> None:
    """Resume a paused run; its deadline and timed waits move forward by the pause length."""
    run = _locked(tx, run_id)
    if RunState(run["state"]) != RunState.PAUSED:
        raise InvalidTransition(f"run {run_id} is not paused (it is {run['state']})")
    reopened = tx.rows(Q.resume_run, run_id=run_id, paused_at=run["paused_at"])
    activate(tx, ((run_id, r["node"]) for r in reopened if r["item_of"] is None), hooks)
    for hook in hooks.on_resumed:
        hook(tx, run, hooks)


def _locked(tx: Tx, run_id: int) -> Row:
    locked = tx.rows(Q.lock_runs, run_ids=[run_id])
    if not locked:
        raise RunNotFound(run_id)
    state = RunState(locked[0]["state"])
    if state.is_terminal:
        raise AlreadyTerminal(run_id, state.value)
    return locked[0]
