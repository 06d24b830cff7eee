"""Time-driven transitions: timers, signal-wait timeouts, run deadlines, pause and resume."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine import notify
from cyclone_dsl.engine.transitions import (
    Hooks,
    activate,
    after_completions,
    after_discards,
    end_past_deadline,
    lock_run,
    lock_run_checking_deadline,
)
from cyclone_dsl.errors import AlreadyTerminal, InvalidTransition, RunNotFound
from cyclone_dsl.sql import Q
from cyclone_dsl.states import RunState, StepState


def _in_running_runs(tx: Tx, page: list[Row], hooks: Hooks) -> list[int]:
    """Lock the runs of a scanner page's steps; return the ids of the steps whose run still
    runs. The page was read before the locks: a run paused meanwhile (its timers and
    timeouts stand still) is seen only now. A run past its deadline fails here: its
    deadline came first."""
    locked = tx.rows(Q.lock_runs, run_ids=sorted({r["run_id"] for r in page}))
    ended = end_past_deadline(tx, locked, hooks)
    running = {r["id"] for r in locked if r["state"] == RunState.RUNNING} - ended
    return [r["id"] for r in page if r["run_id"] in running]


#: Rounds of :func:`settle_due_waits` in one call; what is left waits for the next pass.
MAX_DUE_ROUNDS = 20


def settle_due_waits(tx: Tx, run_ids: Sequence[int], hooks: Hooks) -> int:
    """Fire the due timers and time out the due signal waits of these runs (locked), in
    the order they came due, however late this is: a timeout that came first fails the
    run (or cancels a branch) before a timer due after it fires, as a prompt scanner
    would have had it. Returns how many waits changed."""
    changed = 0
    for _ in range(MAX_DUE_ROUNDS):
        due = tx.rows(Q.due_waits_in_order, run_ids=list(run_ids))
        if not due:
            break
        timers = [r["id"] for r in due if r["state"] == StepState.WAITING_TIMER]
        timeouts = [r["id"] for r in due if r["state"] == StepState.WAITING_SIGNAL]
        if timers:
            done = tx.rows(Q.fire_timers, ids=timers)
            after_completions(tx, done, hooks)
            changed += len(done)
        if timeouts:
            failed = tx.rows(Q.time_out_signal_waits, ids=timeouts)
            if failed:
                after_discards(tx, failed, hooks)
            changed += len(failed)
    return changed


def settle_due_in_tree(tx: Tx, run_id: int, hooks: Hooks) -> int:
    """Before an operation on run ``run_id`` (a signal, pause, resume, cancel or retry):
    lock it, the runs below and above it, and apply what came due in the running ones
    that no scanner has applied yet, in due order (:func:`settle_due_waits`), so that the
    operation meets the run a prompt scanner would have left. A run past its deadline is
    left as it is (its deadline came first: the operation refuses it). Returns how many
    waits changed."""
    look = tx.one(Q.due_in_tree, run_id=run_id)
    if look is None or not look["due"]:  # the usual case: one statement, no lock
        return 0
    tree = [r["id"] for r in tx.rows(Q.run_tree, run_id=run_id)]
    if not tree:
        return 0
    locked = tx.rows(Q.lock_runs, run_ids=sorted(tree))
    if any(r["past_deadline"] for r in locked):
        return 0
    running = [r["id"] for r in locked if r["state"] == RunState.RUNNING]
    return settle_due_waits(tx, running, hooks) if running else 0


def settle_runs_of(tx: Tx, page: list[Row], hooks: Hooks) -> int:
    """The timers and signal-timeouts passes: the due waits of the runs of the page's
    steps (those runs still running), in the order they came due."""
    if not page:
        return 0
    kept = set(_in_running_runs(tx, page, hooks))
    running = sorted({r["run_id"] for r in page if r["id"] in kept})
    return settle_due_waits(tx, running, hooks) if running else 0


def fail_past_deadline(tx: Tx, page: list[Row], hooks: Hooks) -> int:
    if not page:
        return 0
    locked = tx.rows(Q.lock_runs, run_ids=sorted(r["id"] for r in page))
    return len(end_past_deadline(tx, locked, hooks))


def pause(tx: Tx, run_id: int) -> None:
    """Pause a running run and its running child runs (to any depth): ready and pending work
    waits; running steps finish."""
    # Past a deadline (its own, or a parent's), the pause would stop that clock after the
    # fact: refused.
    run = _locked(tx, run_id, lock=lock_run_checking_deadline)
    if RunState(run["state"]) == RunState.PAUSED:
        raise InvalidTransition(f"run {run_id} is already paused")
    tx.rows(Q.pause_run, run_id=run_id)
    for below in _descendants(tx, run_id):
        if below["state"] == RunState.RUNNING:
            tx.rows(Q.pause_run, run_id=below["id"])


def resume(tx: Tx, run_id: int, hooks: Hooks) -> None:
    """Resume a paused run, and the child runs paused with it (the same ``paused_at``; one
    paused on its own stays paused); deadlines and timed waits move forward by the pause.
    :class:`PassedDeadline` when a run above it is past its deadline (its own deadline
    stood still while it was paused)."""
    run = _locked(tx, run_id, lock=lock_run_checking_deadline)
    if RunState(run["state"]) != RunState.PAUSED:
        raise InvalidTransition(f"run {run_id} is not paused (it is {run['state']})")
    below = _descendants(tx, run_id)
    _resume_one(tx, run, hooks)
    for child in below:
        if child["state"] == RunState.PAUSED and child["paused_at"] == run["paused_at"]:
            _resume_one(tx, child, hooks)


def _resume_one(tx: Tx, run: Row, hooks: Hooks) -> None:
    reopened = tx.rows(Q.resume_run, run_id=run["id"], paused_at=run["paused_at"])
    notify.wake_queues(tx, (r["queue"] for r in reopened if r["state"] == StepState.AVAILABLE))
    activate(tx, ((run["id"], r["node"]) for r in reopened if r["item_of"] is None), hooks)
    for hook in hooks.on_resumed:
        hook(tx, run, hooks)


def _descendants(tx: Tx, run_id: int) -> list[Row]:
    """The runs below ``run_id``, locked in id order (all after it: a child is younger)."""
    ids = [r["id"] for r in tx.rows(Q.run_tree, run_id=run_id) if r["id"] != run_id]
    if not ids:
        return []
    return [r for r in tx.rows(Q.lock_runs, run_ids=ids) if r["id"] in set(ids)]


def _locked(tx: Tx, run_id: int, *, lock: Callable[[Tx, int], Row | None] = lock_run) -> Row:
    run = lock(tx, run_id)
    if run is None:
        raise RunNotFound(run_id)
    state = RunState(run["state"])
    if state.is_terminal:
        raise AlreadyTerminal(run_id, state.value)
    return run
