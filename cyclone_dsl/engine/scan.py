"""Scanner passes: expired leases and step timeouts (batched, paginated, guarded)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine import complete, events, gates, notify, sequences, tracecontext
from cyclone_dsl.engine.backoff import backoff_seconds
from cyclone_dsl.engine.transitions import Hooks, after_discards, end_past_deadline
from cyclone_dsl.failpoints import failpoint
from cyclone_dsl.sql import Q
from cyclone_dsl.states import ErrorKind, StepState

SCAN_LOCK_NAMESPACE = 0x0C7C5CA


def is_leader(tx: Tx, scanner: str) -> bool:
    row = tx.one(Q.try_scan_leader, namespace=SCAN_LOCK_NAMESPACE, scanner=scanner)
    leader = bool(row and row["leader"])
    if leader:
        failpoint("scan.leader")
    return leader


#: The scanner's default grace past a step's timeout (its worker fails it first).
TIMEOUT_GRACE = timedelta(seconds=5)

#: The passes :func:`probe` looks for work of, by the scanner's names for them.
PROBED_PASSES = frozenset(
    (
        "leases",
        "timeouts",
        "timers",
        "signal_timeouts",
        "deadlines",
        "children",
        "gates",
        "schedules",
        "retention",
    )
)

#: The retention pass walks every kept run (no index serves its condition), so it runs
#: once in this span for all scanners, or once per retention when that is shorter.
RETENTION_LOOK_EVERY = timedelta(minutes=1)


def retention_look_every(retention: timedelta | None) -> timedelta:
    """How long after any scanner's retention pass the next one of a scanner with this
    ``retention`` may run (``None``: it runs none; the probe still asks)."""
    return RETENTION_LOOK_EVERY if retention is None else min(RETENTION_LOOK_EVERY, retention)


def probe(
    tx: Tx, *, grace: timedelta = TIMEOUT_GRACE, retention_every: timedelta = RETENTION_LOOK_EVERY
) -> frozenset[str]:
    """The passes of :data:`PROBED_PASSES` that have something to do now: one statement,
    no locks (its conditions are those of the passes' page queries; retention's, that no
    scanner ran it within ``retention_every``)."""
    row = tx.one(Q.scan_probe, grace=grace, retention_every=retention_every)
    assert row is not None
    return frozenset(name for name in PROBED_PASSES if row[name])


def take_retention_look(tx: Tx, *, every: timedelta) -> bool:
    """Mark the retention pass as run now, unless any scanner ran it within ``every``:
    True when this scanner is the one to run it."""
    return tx.one(Q.take_retention_look, retention_every=every) is not None


def expired_page(
    tx: Tx, *, after_id: int, limit: int, grace: timedelta = TIMEOUT_GRACE
) -> list[Row]:
    return tx.rows(Q.expired_leases, after_id=after_id, limit=limit, grace=grace)


def reclaim(
    tx: Tx,
    page: list[Row],
    *,
    max_reclaims: Mapping[str, int],
    default_max_reclaims: int,
    hooks: Hooks,
) -> list[Row]:
    """Reclaim one page of expired leases (locks runs first); return the steps changed. A
    run past its deadline fails first: its deadline came before this reclaim."""
    if not page:
        return []
    end_past_deadline(tx, tx.rows(Q.lock_runs, run_ids=sorted({r["run_id"] for r in page})), hooks)
    kinds = sorted(max_reclaims)
    rows = tx.rows(
        Q.reclaim_steps,
        ids=[r["id"] for r in page],
        generations=[r["lease_generation"] for r in page],
        kinds=kinds,
        limits=[max_reclaims[k] for k in kinds],
        default_max_reclaims=default_max_reclaims,
    )
    generations = {r["id"]: r["lease_generation"] for r in page}
    events.fence(tx, [(r["id"], generations[r["id"]]) for r in rows])
    # Available again or discarded, each freed any slot it held (a key's, a queue cap's).
    gates.wake_freed(tx, [(r["id"], r["queue"]) for r in rows])
    discarded = [r for r in rows if r["state"] == StepState.DISCARDED]
    sequences.wake_next(tx, discarded)  # one made available again keeps its place
    if discarded:
        gates.park(tx, (r["id"] for r in discarded))
        after_discards(tx, discarded, hooks)
    if hooks.tracing is not None:
        tracecontext.on_reclaim(tx, hooks.tracing, rows)
    return rows


def timed_out_page(tx: Tx, *, after_id: int, limit: int, grace: timedelta) -> list[Row]:
    return tx.rows(Q.timed_out_steps, after_id=after_id, limit=limit, grace=grace)


def fail_timed_out(tx: Tx, page: list[Row], hooks: Hooks) -> dict[int, str]:
    """Fail steps that outlived their timeout (the worker running them is stuck or gone).
    Each frees any slot it held: its queue's claimers, and those waiting on its key in
    other queues, are woken (as they are by a worker's own timeout of a limited step)."""
    return complete.fail(
        tx,
        [
            complete.Failure(
                step_id=r["id"],
                generation=r["lease_generation"],
                error="the step ran past its timeout and its worker did not stop it",
                error_kind=ErrorKind.TIMEOUT,
                delay_s=backoff_seconds(r["attempt"] + 1),
                wake_queue=r["queue"],
            )
            for r in page
        ],
        hooks,
    )


def wake_due(tx: Tx) -> int:
    """Wake the queues of the available steps that came due since the last due pass of any
    scanner (a delayed start, a retry's backoff, a debounce window: no write makes them
    claimable at that time); return how many queues were woken."""
    queues = [r["queue"] for r in tx.rows(Q.wake_due_steps)]
    notify.wake_queues(tx, queues)
    return len(queues)
