"""The worker registry: which live workers serve which kinds, handlers and versions.

A worker records itself at start and beats every few seconds; a worker is
*live* while its last beat is younger than :data:`LIVE_FOR`. What live
workers serve is what makes work runnable: work that none of them serves is
reported by :func:`unserved` (``Client.stats()``, the dashboard, and a
warning in the log of a worker whose queues hold it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

from cyclone_dsl._version import __version__
from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.errors import HandlerConflict
from cyclone_dsl.sql import Q

#: A worker whose last beat is older than this is not live (it beats every few seconds).
LIVE_FOR = timedelta(seconds=30)
#: Stopped or silent workers are forgotten after this long.
KEEP_FOR = timedelta(days=1)
#: Unserved work is looked for among this many due steps at most.
UNSERVED_SAMPLE = 10_000

REGISTRY_LOCK_NAMESPACE = 0x0C7C0AB


def register(
    tx: Tx,
    *,
    worker_id: str,
    host: str,
    pid: int,
    queues: Sequence[str],
    concurrency: int,
    identities: Mapping[str, str],
    versions: Sequence[tuple[str, str]],
    refuse_conflicts: bool = True,
) -> list[Row]:
    """Record a worker and what it serves; return the live conflicts it ignored.

    With ``refuse_conflicts`` (at start), a live worker serving one of these
    kinds with another handler raises :class:`HandlerConflict` and nothing is
    written; a re-registration after a pause logs them instead.
    """
    tx.one(Q.lock_worker_registry, namespace=REGISTRY_LOCK_NAMESPACE)
    kinds = sorted(identities)
    conflicts = conflicting(tx, worker_id=worker_id, identities=identities)
    if conflicts and refuse_conflicts:
        raise HandlerConflict(
            [(c["kind"], c["mine"], c["theirs"], c["worker_id"]) for c in conflicts]
        )
    tx.one(
        Q.register_worker,
        id=worker_id,
        host=host,
        pid=pid,
        queues=list(queues),
        concurrency=concurrency,
        package_version=__version__,
        kinds=kinds,
        identities=[identities[k] for k in kinds],
        workflows=[w for w, _ in versions],
        versions=[v for _, v in versions],
    )
    return conflicts


def conflicting(tx: Tx, *, worker_id: str, identities: Mapping[str, str]) -> list[Row]:
    """Live workers (other than ``worker_id``) serving one of these kinds with another
    handler. Reads only: a supervisor checks this before it starts worker processes."""
    kinds = sorted(identities)
    return tx.rows(
        Q.handler_conflicts,
        kinds=kinds,
        identities=[identities[k] for k in kinds],
        worker_id=worker_id,
        live_for=LIVE_FOR,
    )


def beat(tx: Tx, worker_id: str) -> bool:
    """Record that the worker is alive; False if its row is gone (register again)."""
    return tx.one(Q.beat_worker, id=worker_id) is not None


def stop(tx: Tx, worker_id: str) -> None:
    tx.rows(Q.stop_worker, id=worker_id)


def prune(tx: Tx, keep: timedelta = KEEP_FOR) -> int:
    return len(tx.rows(Q.prune_workers, keep=keep))


def listing(tx: Tx, live_for: timedelta = LIVE_FOR) -> list[Row]:
    """Known workers, live ones first, with ``slots_in_use`` (running steps they hold)."""
    return tx.rows(Q.list_workers, live_for=live_for)


def unserved(
    tx: Tx, queues: Sequence[str] | None = None, live_for: timedelta = LIVE_FOR
) -> list[Row]:
    """Due available work no live worker serves, by queue, kind, workflow and version."""
    return tx.rows(
        Q.unserved_work,
        queues=list(queues) if queues is not None else None,
        live_for=live_for,
        sample=UNSERVED_SAMPLE,
    )
