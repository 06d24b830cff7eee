"""Flow control: the gates and limits of new runs, queue caps, and the bookkeeping of both.

The limits themselves are enforced by the claim (``claim_gated_steps`` and
``claim_capped_steps``): a step is leased only with every slot it needs, and a
slot is free again once its holder stopped running (or its run ended, or its
rate window passed), so no transition has anything to release. See
``migrations/ext/004_flow_control.sql``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine import notify
from cyclone_dsl.errors import RunNotFound
from cyclone_dsl.graph.rows import LimitRow, RunFlow
from cyclone_dsl.sql import Q

QUEUE_SCOPE_PREFIX = "queue:"


def record(tx: Tx, run_ids: Sequence[int], flows: Sequence[RunFlow | None]) -> None:
    """Write the gates of new runs' steps (``flows[i]`` for ``run_ids[i]``) and make sure
    the limits and slots they use exist. Runs without flow control write nothing."""
    limits: dict[str, LimitRow] = {}
    slot_keys: set[tuple[str, str]] = set()
    gates: dict[str, list[object]] = {
        name: []
        for name in (
            "run_ids",
            "nodes",
            "fair_keys",
            "step_scopes",
            "step_keys",
            "run_scopes",
            "run_keys",
            "rate_scopes",
            "rate_keys",
            "rate_units",
        )
    }
    for run_id, flow in zip(run_ids, flows, strict=True):
        if flow is None:
            continue
        limits.update((limit.scope, limit) for limit in flow.limits)
        slot_keys.update(flow.slot_keys())
        for gate in flow.gates:
            gates["run_ids"].append(run_id)
            gates["nodes"].append(gate.node)
            gates["fair_keys"].append(gate.fair_key)
            gates["step_scopes"].append(gate.step_scope)
            gates["step_keys"].append(gate.step_key)
            gates["run_scopes"].append(gate.run_scope)
            gates["run_keys"].append(gate.run_key)
            gates["rate_scopes"].append(gate.rate_scope)
            gates["rate_keys"].append(gate.rate_key)
            gates["rate_units"].append(gate.rate_units)
    if limits:
        ordered = [limits[scope] for scope in sorted(limits)]
        added = tx.rows(
            Q.upsert_limits,
            scopes=[limit.scope for limit in ordered],
            max_counts=[limit.max_count for limit in ordered],
            pers=[limit.per for limit in ordered],
        )
        if added:  # a raised limit: work queued under the old one may start now
            notify.wake_queues(tx, (r["queue"] for r in tx.rows(Q.gated_queues)))
    if slot_keys:
        ordered_keys = sorted(slot_keys)
        tx.rows(
            Q.ensure_slots,
            scopes=[scope for scope, _ in ordered_keys],
            keys=[key for _, key in ordered_keys],
        )
    if gates["run_ids"]:
        tx.rows(Q.insert_gates, **gates)


def gate_items(tx: Tx, fan_out_ids: Sequence[int]) -> None:
    """The items just created for these fan-out nodes take their node's gate, if it has one."""
    if fan_out_ids:
        tx.rows(Q.gate_fan_out_items, ids=list(fan_out_ids))


def release_run_slots(tx: Tx, run_id: int) -> None:
    """An ended run reopened by an operator retry lets go of its run slots (it waits for
    one again, under the limit as it is now)."""
    tx.rows(Q.release_run_slots, run_id=run_id)


def unpark(tx: Tx, run_id: int) -> None:
    """Steps of this run came back (an operator retry): their gates apply again."""
    tx.rows(Q.unpark_gates, run_id=run_id)


def park(tx: Tx, step_ids: Iterable[int]) -> None:
    """Park the gates of these steps, which just ended (completed, failed for good,
    cancelled): every gated claim walks its keys' gates in order, and each gate left in
    the queue made every later claim walk past it; past about 60 such keys, work behind
    them waited for a poll (the scanner's pass, :func:`park_ended`, parks what is left)."""
    ids = sorted(set(step_ids))
    if ids:
        tx.rows(Q.park_gates_of_steps, ids=ids)


def park_ended(tx: Tx, *, after_id: int, limit: int) -> tuple[int, int | None]:
    """Park one page of gates of ended steps; return (parked, next page's cursor or None)."""
    row = tx.one(Q.park_ended_gates, after_id=after_id, limit=limit)
    assert row is not None
    more = row["seen"] >= limit and row["last_id"] is not None
    return int(row["parked"]), (int(row["last_id"]) if more else None)


def clear_lost_holders(tx: Tx) -> int:
    """Free the slots whose holder was purged; return how many. A claim takes only slots
    without a holder, or whose holder it sees has ended: a deleted one would hold its slot
    until this ran (each purge and retention batch runs it, and the scanner's slow pass)."""
    return len(tx.rows(Q.clear_lost_holders))


def set_queue_cap(tx: Tx, queue: str, cap: int | None) -> None:
    """Cap the steps of ``queue`` running at once across all workers (None: no cap). The
    steps of it already running count (they take its slots). Its claimers are woken: a cap
    raised or removed may let waiting steps start."""
    scope = QUEUE_SCOPE_PREFIX + queue
    if cap is None:
        tx.rows(Q.delete_limit, scope=scope)
    else:
        tx.rows(Q.upsert_limits, scopes=[scope], max_counts=[cap], pers=[None])
        tx.rows(Q.ensure_slots, scopes=[scope], keys=[""])
        tx.run(Q.hold_queue_slots, scope=scope, queue=queue)
    notify.wake_queues(tx, [queue])


def queue_caps(tx: Tx) -> dict[str, int]:
    return {r["queue"]: r["max_count"] for r in tx.rows(Q.queue_caps)}


def queues_with_gates(tx: Tx, queues: Sequence[str]) -> set[str]:
    """The queues among these that hold limited work (its gates not parked)."""
    return {r["queue"] for r in tx.rows(Q.queues_with_gates, queues=list(queues))}


def wake_run_slot_waiters(tx: Tx, ended: Sequence[Row]) -> None:
    """These runs ended: wake the claimers of the steps waiting for a run slot one of the
    limited ones held (a run slot frees with no write of its own, so no claim's commit
    would)."""
    limited = sorted(r["id"] for r in ended if r["run_limited"])
    if limited:
        rows = tx.rows(Q.queues_waiting_for_run_slots, run_ids=limited)
        notify.wake_queues(tx, (r["queue"] for r in rows))


def wake_freed(tx: Tx, freed: Iterable[tuple[int, str]], also: Iterable[str] = ()) -> None:
    """These steps (id, queue) stopped running, each freeing any slot it held, which writes
    nothing to the slot: wake their queues' claimers (a queue cap's slot), those of every
    queue with a step waiting on a step slot one of them held (a kind's key is the same in
    every queue), and ``also``."""
    freed = list(freed)
    ids = sorted({step_id for step_id, _ in freed})
    waiting = tx.rows(Q.queues_waiting_for_step_slots, ids=ids) if ids else []
    notify.wake_queues(tx, [*also, *(q for _, q in freed), *(r["queue"] for r in waiting)])


def cancelled(tx: Tx, rows: Sequence[Row]) -> None:
    """Steps were cancelled (rows with id, queue, was_running): those that were running
    freed their slots (see :func:`wake_freed`), and all leave the claims' walk (:func:`park`)."""
    wake_freed(tx, [(r["id"], r["queue"]) for r in rows if r["was_running"]])
    park(tx, (r["id"] for r in rows))


def charge_units(tx: Tx, extra: Sequence[tuple[int, int]]) -> None:
    """Charge rate-limit units that handlers reported beyond their claim's (step id, units)."""
    extra = [(step_id, units) for step_id, units in extra if units > 0]
    if extra:
        tx.rows(
            Q.charge_rate_units,
            ids=[step_id for step_id, _ in extra],
            extra=[units for _, units in extra],
        )


def flow_stats(tx: Tx) -> list[Row]:
    """Per limited (scope, key): the limit, the slots in use and the steps waiting."""
    return tx.rows(Q.flow_stats)


def wait_reasons(tx: Tx, run_id: int) -> list[Row]:
    """Why the due steps of a run that limits apply to are not running yet
    (:class:`RunNotFound` for a run that does not exist, or was purged)."""
    rows = tx.rows(Q.gate_wait_reasons, run_id=run_id)
    if not rows and tx.one(Q.get_run, run_id=run_id) is None:
        raise RunNotFound(run_id)
    return rows
