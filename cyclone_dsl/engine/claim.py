"""Claims, heartbeats and lease release: the lease side of the engine."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta

import attrs

from cyclone_dsl.db.errors import ConnectionFailure
from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine import events, gates
from cyclone_dsl.failpoints import failpoint
from cyclone_dsl.payload import JSONValue
from cyclone_dsl.sql import Q

log = logging.getLogger("cyclone.engine")


@attrs.frozen
class Claimed:
    """A step leased to a worker, with its assembled handler input."""

    id: int
    run_id: int
    node: str
    kind: str
    queue: str
    attempt: int
    max_attempts: int
    generation: int
    timeout_s: float | None
    lease_s: float
    item_of: str | None
    item_index: int | None
    input: JSONValue
    no_input: bool
    workflow: str
    def_version: str
    deadline_at: datetime | None
    #: A limit applies to it (claimed through the gated path, or from a capped queue): its
    #: end frees a slot, and wakes the claimers of its queue.
    gated: bool = False


#: A gated claim looks at this many keys at least (then as many from the first), however
#: little room the claimer has: a few keys whose slots are all taken must not hide the
#: others from a claimer with one free handler.
MIN_GATE_KEYS = 16
#: Windows of keys one claim looks at, at most, when they yield nothing (the cursor moves
#: on from each: the next claim goes on from there).
MAX_GATE_WINDOWS = 4
#: Claims again of the keys that gave all a claim looked at of them, at most.
MAX_GATE_REFILLS = 3


def _claim_gated(
    tx: Tx,
    params: dict[str, object],
    *,
    queue: str,
    room: int,
    capped: bool,
    cursors: dict[str, str] | None,
) -> list[Row]:
    """The gated claim of one queue, fair across its keys from ``cursors[queue]`` on. A
    window of keys that yields nothing (every slot they need is taken) moves the cursor
    past it, and the next window is tried at once, until one yields, the windows have
    looked at every key, or :data:`MAX_GATE_WINDOWS` were tried."""
    origin = after = cursors.get(queue, "") if cursors is not None else ""
    window = {"queue": queue, "max_keys": max(room, MIN_GATE_KEYS)}
    gated = {**params, "capped": capped}
    for _ in range(MAX_GATE_WINDOWS):
        got = tx.rows(
            Q.claim_gated_steps, **gated, **window, limit=room, after_key=after, only_keys=None
        )
        if got:
            if cursors is not None:
                cursors[queue] = max(got, key=lambda r: (r["turn"], r["key_ord"]))["fair_key"]
            return got + _refill(tx, gated, window, room - len(got), got)
        end = tx.one(Q.gate_window_end, **window, after_key=after, origin=origin)
        if end is None:
            return []
        after = end["fair_key"]
        if cursors is not None:
            cursors[queue] = after
        if end["went_round"]:
            return []
    return []


def _refill(
    tx: Tx, gated: dict[str, object], window: dict[str, object], room: int, got: list[Row]
) -> list[Row]:
    """A claim shares its room among the keys of its window, also those with nothing it
    can take (at their limit, or only running steps): a key that gave every step the claim
    looked at may have more, and a worker with free handlers would leave them for the next
    wake-up or poll. Such keys are claimed again, alone, while room is left."""
    more: list[Row] = []
    for _ in range(MAX_GATE_REFILLS):
        taken = Counter(r["fair_key"] for r in got)
        full = sorted(key for key, n in taken.items() if n >= got[0]["per_key"])
        if room <= 0 or not full:
            break
        got = tx.rows(
            Q.claim_gated_steps, **gated, **window, limit=room, after_key="", only_keys=full
        )
        if not got:
            break
        more += got
        room -= len(got)
    return more


def claim(
    tx: Tx,
    *,
    owner: str,
    queues: Sequence[str],
    kinds: Sequence[str],
    versions: Sequence[tuple[str, str]],
    limit: int,
    lease: timedelta,
    gated: bool = False,
    capped: Collection[str] = (),
    per_queue: Mapping[str, int] | None = None,
    cursors: dict[str, str] | None = None,
) -> list[Claimed]:
    """Lease up to ``limit`` available steps: queue by queue, priority DESC then scheduled_at.

    Only steps of the ``kinds`` given, in runs whose ``(workflow, def_version)``
    is one of ``versions`` (the definitions the claimer has), are taken; at most
    ``per_queue[q]`` from queue ``q``. With ``gated``, steps that limits apply to
    are taken first, fairly across their keys (``cursors[q]``, the key a queue's
    last claim ended on, is moved on); a queue in ``capped`` has a cap across all
    workers, and each of its steps takes one of its slots.

    Each queue's claim is one statement, complete on its own: ``tx`` may be an
    autocommit connection (the worker's), so a claim costs one round trip. With ``gated``,
    one more statement first finds which queues hold limited work at all: the gated claim
    runs only on those (planning it costs milliseconds of server time, and most polls find
    no limited work). A step gated after that look is left alone by the plain claim
    (``ungated``) and taken by the next one: its commit wakes the claimer again.
    """
    if limit <= 0 or not kinds or not queues or not versions:
        return []
    # In autocommit mode each queue's claim commits on its own: if a later one fails,
    # the steps already claimed are leased to this worker and must be returned to it,
    # not left to run only after their lease expires.
    own_commits = tx.commits_each_statement
    rows: list[Row] = []
    params: dict[str, object] = {
        "owner": owner,
        "kinds": list(kinds),
        "workflows": [w for w, _ in versions],
        "versions": [v for _, v in versions],
        "lease": lease,
    }
    holding_gates: set[str] = set()
    if gated:
        holding_gates = gates.queues_with_gates(tx, queues)
        failpoint("claim.after_gate_look")
    for queue in queues:
        room = limit - len(rows)
        if per_queue is not None and queue in per_queue:
            room = min(room, per_queue[queue])
        if room <= 0:
            continue
        try:
            if rows:
                failpoint("claim.between_queues")
            if queue in holding_gates:
                got = _claim_gated(
                    tx, params, queue=queue, room=room, capped=queue in capped, cursors=cursors
                )
                rows += got
                room -= len(got)
            if room > 0:
                statement = Q.claim_capped_steps if queue in capped else Q.claim_steps
                rows += tx.rows(statement, **params, queue=queue, limit=room)
        except ConnectionFailure:
            if rows and own_commits:
                log.warning(
                    "claiming queue %r failed; keeping the %d steps claimed", queue, len(rows)
                )
                break
            raise
        if len(rows) >= limit:
            break
    return [
        Claimed(
            id=r["id"],
            run_id=r["run_id"],
            node=r["node"],
            kind=r["kind"],
            queue=r["queue"],
            attempt=r["attempt"],
            max_attempts=r["max_attempts"],
            generation=r["lease_generation"],
            timeout_s=r["timeout_s"],
            lease_s=r["lease_s"],
            item_of=r["item_of"],
            item_index=r["item_index"],
            input=r["input"],
            no_input=r["no_input"],
            workflow=r["workflow"],
            def_version=r["def_version"],
            deadline_at=r["deadline_at"],
            gated="fair_key" in r or r["queue"] in capped,
        )
        for r in rows
    ]


def heartbeat(tx: Tx, leases: Sequence[tuple[int, int]], lease: timedelta) -> set[tuple[int, int]]:
    """Extend the given (step id, generation) leases; return those still held (a step
    reclaimed and claimed again is held at its new generation only)."""
    if not leases:
        return set()
    rows = tx.rows(
        Q.heartbeat_steps,
        ids=[i for i, _ in leases],
        generations=[g for _, g in leases],
        lease=lease,
    )
    return {(r["id"], r["lease_generation"]) for r in rows}


def leases_held(tx: Tx, leases: Sequence[tuple[int, int]]) -> set[tuple[int, int]]:
    """Of the given (step id, generation) leases, those still held, without renewing
    them: the leases :func:`hold_lease` keeps."""
    if not leases:
        return set()
    rows = tx.rows(Q.leases_held, ids=[i for i, _ in leases], generations=[g for _, g in leases])
    return {(r["id"], r["lease_generation"]) for r in rows}


def hold_lease(tx: Tx, step_id: int) -> bool:
    """Keep this step's lease for as long as ``tx`` is open, instead of heartbeats, which
    update the step's row: the first statement of a transaction at repeatable read or
    serializable, whose completion would conflict with such an update. False: another
    step's lock holds the key (see the query)."""
    row = tx.one(Q.hold_lease, id=step_id)
    return bool(row is not None and row["held"])


def release(tx: Tx, leases: Sequence[tuple[int, int]]) -> set[int]:
    """Give leases back (graceful shutdown): available at once, the attempt not consumed."""
    if not leases:
        return set()
    rows = tx.rows(Q.release_steps, ids=[i for i, _ in leases], generations=[g for _, g in leases])
    released = {r["id"] for r in rows}
    events.fence(tx, [(i, g) for i, g in leases if i in released])
    gates.wake_freed(tx, [(r["id"], r["queue"]) for r in rows])
    return released


def lease_states(tx: Tx, ids: Sequence[int]) -> dict[int, str]:
    """The current state of each of these steps (a step purged meanwhile is missing)."""
    if not ids:
        return {}
    return {r["id"]: r["state"] for r in tx.rows(Q.lease_states, ids=list(ids))}
