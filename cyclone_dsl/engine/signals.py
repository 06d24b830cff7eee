"""The signal mailbox: deliver, buffer within the wait's capacity, consume on activation."""

from __future__ import annotations

import json
from enum import StrEnum

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine.transitions import Hooks, after_completions, lock_run_checking_deadline
from cyclone_dsl.errors import (
    AlreadyTerminal,
    MailboxFull,
    RunNotFound,
    SignalNotDeliverable,
)
from cyclone_dsl.graph.rows import KIND_SIGNAL
from cyclone_dsl.payload import JSONValue
from cyclone_dsl.sql import Q
from cyclone_dsl.states import RunState, StepState


class Delivery(StrEnum):
    """What happened to a signal."""

    CONSUMED = "consumed"  # the waiting node took it now
    BUFFERED = "buffered"  # stored until its wait activates
    NOT_STORED = "not_stored"  # its wait had ended, or its timeout passed: dropped


def _names(wait: Row) -> list[str]:
    return list(wait["signal_names"]) if wait["signal_names"] else [wait["signal_name"]]


def _capacity(wait: Row) -> int:
    return int(wait["wait_count"] or 1)


def deliver(tx: Tx, run_id: int, name: str, payload_text: str, hooks: Hooks) -> Delivery:
    """Deliver one signal (the run row is locked first, so senders serialise per run)."""
    run = lock_run_checking_deadline(tx, run_id)  # refused, not consumed, past a deadline
    if run is None:
        raise RunNotFound(run_id)
    state = RunState(run["state"])
    if state.is_terminal:
        raise AlreadyTerminal(run_id, state.value)
    wait = tx.one(Q.find_signal_wait, run_id=run_id, name=name)
    if wait is None:
        raise SignalNotDeliverable(
            f"run {run_id} has no wait for a signal named {name!r}: check the name against "
            "the workflow's wait_signal / wait_n / wait_any nodes"
        )
    step_state = StepState(wait["state"])
    if step_state.is_terminal:
        return Delivery.NOT_STORED
    if step_state == StepState.WAITING_SIGNAL and wait["timed_out"]:
        # Its timeout came first, however late the scanner is. In a running run the
        # operation failed the wait before this (Engine._due_first); a paused run's fails
        # at the resume.
        return Delivery.NOT_STORED
    if step_state == StepState.WAITING_SIGNAL:
        tx.one(
            Q.insert_signal,
            run_id=run_id,
            name=name,
            payload=payload_text,
            consumed_by=wait["node"],
        )
        _consume(tx, run_id, wait, [(name, json.loads(payload_text))], hooks)
        return Delivery.CONSUMED
    buffered = tx.one(Q.count_buffered_signals, run_id=run_id, names=_names(wait))
    if buffered is not None and buffered["buffered"] >= _capacity(wait):
        raise MailboxFull(run_id, name, _capacity(wait))
    tx.one(Q.insert_signal, run_id=run_id, name=name, payload=payload_text, consumed_by=None)
    return Delivery.BUFFERED


def _consume(
    tx: Tx, run_id: int, wait: Row, received: list[tuple[str, JSONValue]], hooks: Hooks
) -> None:
    """Apply deliveries to a waiting node: complete it, or record a partial quorum."""
    if wait["signal_names"]:
        name, value = received[0]
        output: JSONValue = {"name": name, "payload": value}
    elif wait["wait_count"] is not None:
        so_far = list(wait["output"] or [])
        so_far.extend(value for _, value in received)
        if len(so_far) < _capacity(wait):
            tx.run(Q.record_partial_quorum, id=wait["id"], output=json.dumps(so_far))
            return
        output = so_far
    else:
        output = received[0][1]
    done = tx.rows(Q.complete_wait, id=wait["id"], output=json.dumps(output))
    after_completions(tx, done, hooks)


def consume_buffered_on_activation(tx: Tx, activated: list[Row], hooks: Hooks) -> None:
    """Activation hook: a wait that just became waiting takes what its mailbox holds."""
    waits = [
        row
        for row in activated
        if row["kind"] == KIND_SIGNAL and row["state"] == StepState.WAITING_SIGNAL
    ]
    if not waits:
        return
    with_mail = {
        r["run_id"]
        for r in tx.rows(
            Q.runs_with_buffered_signals, run_ids=sorted({row["run_id"] for row in waits})
        )
    }
    for row in waits:
        if row["run_id"] not in with_mail:
            continue
        wait = tx.one(Q.find_wait_by_id, id=row["id"])
        if wait is None:
            continue
        capacity = 1 if wait["signal_names"] else _capacity(wait)
        taken = tx.rows(
            Q.take_buffered_signals,
            run_id=row["run_id"],
            names=_names(wait),
            limit=capacity,
            node=wait["node"],
        )
        if taken:
            _consume(tx, row["run_id"], wait, [(t["name"], t["payload"]) for t in taken], hooks)
