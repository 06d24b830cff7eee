"""The maintenance scanner: periodic, paginated passes, one leader per pass via advisory lock.

Each pass is a call of the :class:`~cyclone_dsl.engine.Engine`, one page per
transaction; the leader lock of a pass is taken in the same transaction. A probe (one
statement) first says which passes have work; the others are skipped, but for one pass in
:data:`FULL_PASS_EVERY` (the first among them), which runs them all. Retention runs once
a minute (or once per retention, when shorter) for all scanners: the first look past
that span takes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta

from cyclone_dsl.db.connect import Pool
from cyclone_dsl.db.errors import DatabaseError
from cyclone_dsl.db.tx import Row, Tx, in_transaction
from cyclone_dsl.engine import (
    PROBED_PASSES,
    TIMEOUT_GRACE,
    CatchUp,
    Engine,
    Page,
    retention_look_every,
)

log = logging.getLogger("cyclone.scanner")

PAGE = 500
RETENTION_BATCH = 1000
SCHEDULE_LEASE = timedelta(seconds=30)
#: Passes over whole small tables (workers, limit slots) run once every this many passes.
SLOW_PASS_EVERY = 30
#: Once every this many passes, every pass runs whatever the probe found: a bound on how
#: long work the probe would miss could wait (none should: its conditions are the passes').
FULL_PASS_EVERY = 10


class Scanner:
    """Runs every maintenance pass each ``interval`` seconds until ``stopping`` is set."""

    def __init__(
        self,
        pool: Pool,
        engine: Engine,
        *,
        interval: float,
        max_reclaims: Mapping[str, int],
        default_max_reclaims: int,
        stopping: threading.Event,
        timeout_grace: timedelta = TIMEOUT_GRACE,
        owner: str = "scanner",
        catch_up: CatchUp = "latest",
        retention: timedelta | None = None,
        retention_every: timedelta | None = None,
        on_reclaimed: Callable[[int], None] | None = None,
    ) -> None:
        self.pool = pool
        self.engine = engine
        self.interval = interval
        self.max_reclaims = dict(max_reclaims)
        self.default_max_reclaims = default_max_reclaims
        self.stopping = stopping
        self.timeout_grace = timeout_grace
        self.owner = owner
        self.catch_up: CatchUp = catch_up
        self.retention = retention
        #: The least time between two retention passes of any scanners.
        self.retention_every = (
            retention_look_every(retention) if retention_every is None else retention_every
        )
        self.on_reclaimed = on_reclaimed
        self.passes = 0

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.scan_once()
            except DatabaseError as exc:
                log.warning("scan pass failed (%s); the next pass retries", exc)
            except Exception:
                log.exception("scan pass failed; the next pass retries")
            self.stopping.wait(self.interval)

    def scan_once(self) -> int:
        """Run every pass once; return how many rows changed.

        A pass that raises does not keep the later ones from running (one bad row must not
        stop reclaims or timers): the first error is raised once every pass has run.
        """
        engine = self.engine
        errors: list[Exception] = []

        def guarded(run: Callable[[], int]) -> int:
            try:
                return run()
            except Exception as exc:  # noqa: BLE001 - raised below, after the other passes
                errors.append(exc)
                return 0

        found = self._passes_with_work(errors)

        def paged(name: str, page_fn: Callable[[Tx, int], Page]) -> int:
            if name in PROBED_PASSES and name not in found:
                return 0
            return guarded(lambda: self._paginate(name, page_fn))

        reclaimed = paged(
            "leases",
            lambda tx, after: engine.reclaim_expired_leases(
                tx,
                after_id=after,
                limit=PAGE,
                max_reclaims=self.max_reclaims,
                default_max_reclaims=self.default_max_reclaims,
                grace=self.timeout_grace,
            ),
        )
        if reclaimed and self.on_reclaimed is not None:
            self.on_reclaimed(reclaimed)
        changed = reclaimed
        changed += paged(
            "timeouts",
            lambda tx, after: engine.fail_timed_out_steps(
                tx, after_id=after, limit=PAGE, grace=self.timeout_grace
            ),
        )
        changed += paged(
            "timers", lambda tx, after: engine.fire_timers(tx, after_id=after, limit=PAGE)
        )
        # Wake-ups only: nothing changes (the wake-up's mark aside).
        paged("due", lambda tx, _: (engine.wake_due_steps(tx), None))
        changed += paged(
            "signal_timeouts",
            lambda tx, after: engine.time_out_signal_waits(tx, after_id=after, limit=PAGE),
        )
        changed += paged(
            "deadlines",
            lambda tx, after: engine.fail_past_deadlines(tx, after_id=after, limit=PAGE),
        )
        settled = paged(
            "children",
            lambda tx, after: engine.settle_ended_children(tx, after_id=after, limit=PAGE),
        )
        if settled:
            log.warning("settled %d parent nodes whose child run had ended", settled)
        changed += settled
        if engine.fires_schedules and "schedules" in found:
            changed += guarded(self.fire_schedules)
        if self.retention is not None and "retention" in found:
            changed += guarded(self.expire_runs)
        changed += paged(
            "gates", lambda tx, after: engine.park_ended_gates(tx, after_id=after, limit=PAGE)
        )
        if self.passes % SLOW_PASS_EVERY == 0:
            changed += paged("slots", lambda tx, _: (engine.clear_lost_slot_holders(tx), None))
            changed += paged("workers", lambda tx, _: (engine.prune_workers(tx), None))
        self.passes += 1
        if errors:
            raise errors[0]
        return changed

    def _passes_with_work(self, errors: list[Exception]) -> frozenset[str]:
        """The probed passes to run: all of them once every :data:`FULL_PASS_EVERY` passes
        and when the probe fails, else those the probe found work for."""
        if self.passes % FULL_PASS_EVERY == 0:
            return PROBED_PASSES
        try:
            return in_transaction(
                self.pool,
                lambda tx: self.engine.scan_passes_with_work(
                    tx, grace=self.timeout_grace, retention_every=self.retention_every
                ),
            )
        except Exception as exc:  # noqa: BLE001 - raised after the passes, which all run
            errors.append(exc)
            return PROBED_PASSES

    def _paginate(self, name: str, page_fn: Callable[[Tx, int], Page]) -> int:
        """Run ``page_fn`` page after page, each in its own transaction under the leader lock."""
        cursor, total = 0, 0
        while not self.stopping.is_set():

            def one_page(tx: Tx, after: int = cursor) -> Page | None:
                if not self.engine.is_scan_leader(tx, name):
                    return None
                return page_fn(tx, after)

            result = in_transaction(self.pool, one_page)
            if result is None:
                return total
            changed, next_cursor = result
            total += changed
            if next_cursor is None:
                return total
            cursor = next_cursor
        return total

    def fire_schedules(self) -> int:
        """Lease due schedules, then fire each in its own transaction."""
        due = in_transaction(
            self.pool,
            lambda tx: self.engine.lease_due_schedules(
                tx, owner=self.owner, limit=50, lease=SCHEDULE_LEASE
            ),
        )
        fired = 0
        error: Exception | None = None
        for row in due:

            def fire_one(tx: Tx, row: Row = row) -> int | None:
                return self.engine.fire_schedule(tx, row, owner=self.owner, catch_up=self.catch_up)

            try:
                fired += in_transaction(self.pool, fire_one) is not None
            except Exception as exc:  # noqa: BLE001 - the others fire; raised below
                error = error or exc
        if error is not None:
            raise error
        return fired

    def expire_runs(self) -> int:
        """Delete terminal runs past their retention, a batch per transaction, until a
        batch deletes none (one that deleted a parent frees its ended child runs). Only
        when no scanner did so within the span of :func:`retention_look_every`: the
        batches walk every kept run."""
        retention = self.retention
        assert retention is not None
        every = self.retention_every
        if not in_transaction(
            self.pool, lambda tx: self.engine.take_retention_look(tx, every=every)
        ):
            return 0
        total = 0
        while not self.stopping.is_set():
            deleted = in_transaction(
                self.pool,
                lambda tx: self.engine.expire_runs(
                    tx, default_retention=retention, limit=RETENTION_BATCH
                ),
            )
            total += deleted
            if deleted == 0:
                return total
        return total
