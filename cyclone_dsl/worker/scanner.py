"""The maintenance scanner: periodic, paginated passes, one leader per pass via advisory lock."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from cyclone_dsl.db.tx import Row, Tx, in_transaction
from cyclone_dsl.engine import children, scan, schedules, waits
from cyclone_dsl.engine.transitions import Hooks
from cyclone_dsl.sql import Q

log = logging.getLogger("cyclone.scanner")

PAGE = 500
RETENTION_BATCH = 1000
SCHEDULE_LEASE = timedelta(seconds=30)


class Scanner:
    """Runs every maintenance pass each ``interval`` seconds until ``stopping`` is set."""

    def __init__(
        self,
        pool: ConnectionPool[Any],
        *,
        interval: float,
        max_reclaims: Mapping[str, int],
        default_max_reclaims: int,
        hooks: Hooks,
        shift: timedelta,
        stopping: threading.Event,
        timeout_grace: timedelta = timedelta(seconds=5),
        owner: str = "scanner",
        compile_target: schedules.Compiler | None = None,
        catch_up: schedules.CatchUp = "latest",
        retention: timedelta | None = None,
    ) -> None:
        self.pool = pool
        self.interval = interval
        self.max_reclaims = dict(max_reclaims)
        self.default_max_reclaims = default_max_reclaims
        self.hooks = hooks
        self.shift = shift
        self.stopping = stopping
        self.timeout_grace = timeout_grace
        self.owner = owner
        self.compile_target = compile_target
        self.catch_up: schedules.CatchUp = catch_up
        self.retention = retention
        self.passes = 0

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.scan_once()
            except psycopg.Error as exc:
                log.warning("scan pass failed (%s); the next pass retries", exc)
            except Exception:
                log.exception("scan pass failed; the next pass retries")
            self.stopping.wait(self.interval)

    def scan_once(self) -> int:
        """Run every pass once; return how many rows changed."""
        changed = self._paginate("leases", self._reclaim_page)
        changed += self._paginate("timeouts", self._timeout_page)
        changed += self._paginate("timers", self._timer_page)
        changed += self._paginate("signal_timeouts", self._signal_timeout_page)
        changed += self._paginate("deadlines", self._deadline_page)
        changed += self._paginate("children", self._child_repair_page)
        if self.compile_target is not None:
            changed += self.fire_schedules()
        if self.retention is not None:
            changed += self.expire_runs()
        self.passes += 1
        return changed

    def _paginate(self, name: str, page_fn: Callable[[Tx, int], tuple[int, int | None]]) -> int:
        """Run ``page_fn`` page after page, each in its own transaction under the leader lock."""
        cursor, total = 0, 0
        while not self.stopping.is_set():

            def one_page(tx: Tx, after: int = cursor) -> tuple[int, int | None] | None:
                if not scan.is_leader(tx, name):
                    return None
                return page_fn(tx, after)

            result = in_transaction(self.pool, one_page, shift=self.shift)
            if result is None:
                return total
            changed, next_cursor = result
            total += changed
            if next_cursor is None:
                return total
            cursor = next_cursor
        return total

    def _reclaim_page(self, tx: Tx, after: int) -> tuple[int, int | None]:
        page = scan.expired_page(tx, after_id=after, limit=PAGE)
        rows = scan.reclaim(
            tx,
            page,
            max_reclaims=self.max_reclaims,
            default_max_reclaims=self.default_max_reclaims,
            hooks=self.hooks,
        )
        if rows:
            log.info("reclaimed %d expired leases", len(rows))
        return len(rows), _next_cursor(page)

    def _timeout_page(self, tx: Tx, after: int) -> tuple[int, int | None]:
        page = scan.timed_out_page(tx, after_id=after, limit=PAGE, grace=self.timeout_grace)
        changed = scan.fail_timed_out(tx, page, self.hooks)
        return len(changed), _next_cursor(page)

    def _timer_page(self, tx: Tx, after: int) -> tuple[int, int | None]:
        page = tx.rows(Q.due_timers, after_id=after, limit=PAGE)
        return waits.fire_timers(tx, page, self.hooks), _next_cursor(page)

    def _signal_timeout_page(self, tx: Tx, after: int) -> tuple[int, int | None]:
        page = tx.rows(Q.expired_signal_waits, after_id=after, limit=PAGE)
        return waits.time_out_signal_waits(tx, page, self.hooks), _next_cursor(page)

    def _deadline_page(self, tx: Tx, after: int) -> tuple[int, int | None]:
        page = tx.rows(Q.expired_deadlines, after_id=after, limit=PAGE)
        return waits.fail_past_deadline(tx, page, self.hooks), _next_cursor(page)

    def _child_repair_page(self, tx: Tx, after: int) -> tuple[int, int | None]:
        ended = children.repair_ended(tx, after_id=after, limit=PAGE, hooks=self.hooks)
        if ended:
            log.warning("settled %d parent nodes whose child run had ended", len(ended))
        return len(ended), None  # settled rows leave the page: the next pass starts over

    def fire_schedules(self) -> int:
        """Lease due schedules, then fire each in its own transaction."""
        compile_target = self.compile_target
        assert compile_target is not None
        due = in_transaction(
            self.pool,
            lambda tx: schedules.lease_due(tx, owner=self.owner, limit=50, lease=SCHEDULE_LEASE),
            shift=self.shift,
        )
        fired = 0
        for row in due:

            def fire_one(tx: Tx, row: Row = row) -> int | None:
                return schedules.fire(
                    tx,
                    row,
                    owner=self.owner,
                    compile_target=compile_target,
                    hooks=self.hooks,
                    catch_up=self.catch_up,
                )

            fired += in_transaction(self.pool, fire_one, shift=self.shift) is not None
        return fired

    def expire_runs(self) -> int:
        """Delete terminal runs past their retention, a batch per transaction."""
        total = 0
        while not self.stopping.is_set():
            deleted = in_transaction(
                self.pool,
                lambda tx: tx.rows(
                    Q.expire_runs, default_retention=self.retention, limit=RETENTION_BATCH
                ),
                shift=self.shift,
            )
            total += len(deleted)
            if len(deleted) < RETENTION_BATCH:
                return total
        return total


def _next_cursor(page: list[Row]) -> int | None:
    return page[-1]["id"] if len(page) >= PAGE else None
