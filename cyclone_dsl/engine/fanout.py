"""for_each: expansion into item tasks, the max_parallel gate, collection, item failure."""

from __future__ import annotations

import threading

from cyclone_dsl import payload
from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine import gates, notify
from cyclone_dsl.engine.transitions import (
    Hooks,
    after_completions,
    after_discards,
    nodes_cancelled,
)
from cyclone_dsl.failpoints import failpoint
from cyclone_dsl.sql import Q
from cyclone_dsl.states import ErrorKind, StepState


def _from(source: Row) -> str:
    """Where a fan-out's list comes from, for its messages (the run input: nothing)."""
    return f" from {source['input_from']!r}" if source.get("input_from") else ""


def expand_on_activation(tx: Tx, activated: list[Row], hooks: Hooks) -> None:
    """Activation hook: an activated fan-out node (still ``pending``) creates its items.

    A list longer than the node's ``max_items`` guard fails the node
    (``item_limit``) and creates nothing.
    """
    ids = [
        r["id"]
        for r in activated
        if r["fan_out_parallel"] is not None and r["state"] == StepState.PENDING
    ]
    if not ids:
        return
    sources = tx.rows(Q.fan_out_sources, ids=ids)
    over = [s for s in sources if s["max_items"] is not None and s["length"] > s["max_items"]]
    if over:
        ids = [i for i in ids if i not in {s["id"] for s in over}]
    items = tx.rows(Q.expand_fan_outs, ids=ids) if ids else []
    if items:
        gates.gate_items(tx, ids)
    failpoint("fanout.after_expand")
    _started(tx, items, hooks)
    for source in sources:
        if source in over:
            failed = tx.rows(
                Q.discard_node,
                id=source["id"],
                error=(
                    f"for_each {source['node']!r} got {source['length']} items{_from(source)}, "
                    "over its "
                    f"max_items of {source['max_items']}: no item was started"
                ),
                error_kind=ErrorKind.ITEM_LIMIT.value,
            )
            after_discards(tx, failed, hooks)
        elif source["list_type"] != "array":
            failed = tx.rows(
                Q.discard_node,
                id=source["id"],
                error=(
                    f"for_each {source['node']!r} needs a JSON list{_from(source)}, "
                    f"got {source['list_type'] or 'nothing'}"
                ),
                error_kind=ErrorKind.INVALID_INPUT.value,
            )
            after_discards(tx, failed, hooks)
        elif source["length"] == 0:
            empty = None if source["fan_out_max_bytes"] is None else "[]"
            done = tx.rows(Q.complete_node, id=source["id"], output=empty)
            after_completions(tx, done, hooks)


def _started(tx: Tx, items: list[Row], hooks: Hooks) -> None:
    """Items just made ready: workers hear of step items; child items start their runs."""
    notify.wake_queues(tx, (i["queue"] for i in items if i["state"] == StepState.AVAILABLE))
    children = [i for i in items if i["state"] == StepState.WAITING_CHILD]
    if children:
        for hook in hooks.on_activated:
            hook(tx, children, hooks)


def items_finished(tx: Tx, items: list[Row], hooks: Hooks) -> None:
    """After item tasks completed: start the next ones, complete finished fan-outs."""
    for run_id, node in sorted({(r["run_id"], r["item_of"]) for r in items}):
        advance(tx, run_id, node, hooks)


#: The fan-outs each thread is advancing, by (transaction, run, node): True when an item
#: ended while its start was under way (a child run that ends as it starts) and the
#: advance must go round again.
_advancing = threading.local()


def advance(tx: Tx, run_id: int, node: str, hooks: Hooks) -> None:
    """Start a pending fan-out's next items up to max_parallel; finish it if all completed.

    An item that ends as it starts (a child run with nothing to run) advances its fan-out
    again from inside this call: that call only marks the fan-out, and this one goes round
    again, so a thousand such items are a loop, not a recursion that Python's stack limit
    stops.
    """
    rounds: dict[tuple[int, int, str], bool] = _advancing.__dict__.setdefault("rounds", {})
    key = (id(tx), run_id, node)
    if key in rounds:
        rounds[key] = True
        return
    rounds[key] = True
    try:
        while rounds[key]:
            rounds[key] = False
            _started(tx, tx.rows(Q.activate_next_items, run_id=run_id, node=node), hooks)
    finally:
        del rounds[key]
    done = tx.rows(Q.finish_fan_out, run_id=run_id, node=node)
    if not done:
        return
    row = done[0]
    limit = row["fan_out_max_bytes"]
    large = row["collected_if_large"]
    size = None if large is None else payload.encoded_size(large)
    if limit and size is not None and size > limit:
        failed = tx.rows(
            Q.discard_node_completed,
            id=row["id"],
            error=(
                f"the collected output of {node!r} is {size} bytes, over its max_bytes of {limit}"
            ),
            error_kind=ErrorKind.OUTPUT_LIMIT.value,
        )
        after_discards(tx, failed, hooks)
        return
    after_completions(tx, done, hooks)


def items_discarded(tx: Tx, items: list[Row], hooks: Hooks) -> None:
    """An item that failed for good fails its fan-out node (then on_dep_failure applies)."""
    for run_id, node in sorted({(r["run_id"], r["item_of"]) for r in items}):
        first = next(r for r in items if r["run_id"] == run_id and r["item_of"] == node)
        error = f"item {first['node']!r} failed: {first.get('error') or 'no detail'}"
        cancelled = tx.rows(Q.cancel_items, run_id=run_id, node=node, error=f"cancelled: {error}")
        if any(c["was_running"] for c in cancelled):
            notify.steps_cancelled(tx, [run_id])
        gates.cancelled(tx, cancelled)
        nodes_cancelled(tx, run_id, cancelled, hooks)
        fan_out = tx.one(Q.fan_out_node, run_id=run_id, node=node)
        if fan_out is None:
            continue
        failed = tx.rows(
            Q.discard_node, id=fan_out["id"], error=error, error_kind=ErrorKind.DEP_FAILED.value
        )
        if failed:
            after_discards(tx, failed, hooks)


def gate_on_resume(tx: Tx, run: Row, hooks: Hooks) -> None:
    """Resume hook: items set back to pending start again, up to max_parallel.

    A run without fan-out (``has_fan_out``, read with the run lock) has none to look for.
    """
    if not run["has_fan_out"]:
        return
    for row in tx.rows(Q.fan_out_nodes_of_run, run_id=run["id"]):
        advance(tx, run["id"], row["node"], hooks)
