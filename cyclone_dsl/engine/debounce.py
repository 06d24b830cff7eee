"""Debounced submits: submits of one (workflow, key) inside a window become one run.

The first submit inserts the run with its first steps held until ``delay`` from
now (their ``scheduled_at``: the claim takes nothing before). A submit of the
same key while none of the run's steps has been claimed gives the run its own
input and deadline and moves the start to ``delay`` after itself; once a step
was claimed, the window is closed and the submit opens a new one, as does a
submit whose definition differs from the run's (another deploy's: the run's
rows have the other shape). Submits of one key are serialised by a
transaction-level advisory lock, so two first submits never make two runs.
"""

from __future__ import annotations

from datetime import timedelta

from cyclone_dsl.db.tx import Tx
from cyclone_dsl.engine import gates, waits
from cyclone_dsl.engine.submit import Submitted, insert_run, special_roots
from cyclone_dsl.engine.transitions import Hooks
from cyclone_dsl.errors import InvalidArgument
from cyclone_dsl.graph.rows import CompiledRun
from cyclone_dsl.sql import Q

DEBOUNCE_LOCK_NAMESPACE = 0x0C7C0DB


def submit(
    tx: Tx,
    compiled: CompiledRun,
    *,
    key: str,
    delay: timedelta,
    deadline: timedelta | None,
    hooks: Hooks,
) -> Submitted:
    """Submit ``compiled`` into the debounce window of its workflow and ``key``."""
    roots = special_roots(compiled)
    guarded = {g.node for g in compiled.guards}
    if any(node in guarded for node in roots):
        # Its conditions are judged on the first submit's input when the run starts; a
        # later submit's input could not change which branch runs.
        raise InvalidArgument(
            f"workflow {compiled.workflow!r} starts with a conditional step "
            f"({', '.join(repr(n) for n in roots if n in guarded)}: when= or otherwise=): "
            "debounce replaces a held run's input, so its first nodes must be unconditional "
            "steps; put an unconditional step first"
        )
    if roots:
        raise InvalidArgument(
            f"workflow {compiled.workflow!r} starts with a wait, timer, child run or fan-out: "
            "debounce holds a run's first steps, so its first nodes must be steps"
        )
    tx.one(
        Q.lock_debounce_key,
        namespace=DEBOUNCE_LOCK_NAMESPACE,
        workflow=compiled.workflow,
        key=key,
    )
    window = tx.one(Q.open_debounce, workflow=compiled.workflow, key=key)
    if (
        window is not None
        and not _ended_by_its_deadline(tx, window["run_id"], hooks)
        and _moved(tx, compiled, window["run_id"], key=key, delay=delay, deadline=deadline)
    ):
        return Submitted(window["run_id"], created=False)
    run_id = insert_run(tx, compiled, deadline=deadline, hooks=hooks)
    tx.one(Q.hold_debounced, run_id=run_id, workflow=compiled.workflow, key=key, delay=delay)
    return Submitted(run_id, created=True)


def _ended_by_its_deadline(tx: Tx, run_id: int, hooks: Hooks) -> bool:
    """Whether the window's run passed its deadline, which ends it now if no scanner has
    yet: a deadline that passed first wins, so the run is not given a new one."""
    return bool(waits.fail_past_deadline(tx, [{"id": run_id}], hooks))


def _moved(
    tx: Tx,
    compiled: CompiledRun,
    run_id: int,
    *,
    key: str,
    delay: timedelta,
    deadline: timedelta | None,
) -> bool:
    """Give the window's run the new input and deadline and a later start; False if it
    has started or is of another definition (a submit of another deploy)."""
    try:
        with tx.savepoint():
            row = tx.one(
                Q.move_debounced,
                run_id=run_id,
                workflow=compiled.workflow,
                key=key,
                def_version=compiled.def_version,
                delay=delay,
                deadline=deadline,
                input=compiled.input,
                nodes=[s.node for s in compiled.steps],
                inputs=[s.input for s in compiled.steps],
            )
            assert row is not None
            if row["runs"] != 1:
                return False
            if row["moved"] != len(compiled.steps):
                raise _Started  # claimed while it moved: undo the steps already moved
            tx.rows(Q.delete_run_gates, run_id=run_id)  # the new input may give new keys
            if compiled.flow is not None:
                gates.record(tx, [run_id], [compiled.flow])
            return True
    except _Started:
        return False


class _Started(Exception):
    """Internal: a step of the run was claimed while its window moved."""
