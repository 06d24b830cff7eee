"""The client side of operations in bulk: batch after batch, each its own transaction.

:func:`run_pages` yields a :class:`BulkResult` of the counts so far after each
committed batch; the clients call ``progress`` with it (the async client on its
event loop) and return the last one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

import attrs

from cyclone_dsl.db.tx import Tx
from cyclone_dsl.engine import MAX_BATCH_SIZE, BulkAction, BulkPage, Engine, RunFilter
from cyclone_dsl.errors import InvalidArgument

T = TypeVar("T")


class Transaction(Protocol):
    """Runs work in one transaction (the client's pooled ``transaction``)."""

    def __call__(self, work: Callable[[Tx], T], /) -> T: ...


#: How many skipped runs a result lists (the count covers them all).
SKIPPED_LISTED = 100


@attrs.frozen
class BulkResult:
    """What a bulk operation did (or, for a dry run or a progress report, would do or has
    done so far).

    ``matched`` runs were selected by the filter; ``acted`` of them were cancelled,
    retried or resumed; ``skipped`` were refused by the single-run transition (they
    changed meanwhile, or a retry could not finish them), the first
    ``SKIPPED_LISTED`` of them listed in ``skipped_runs`` as (run id, reason). A dry
    run counts ``matched`` and acts on nothing. ``done`` is False in the progress
    reports before the last batch.
    """

    action: str
    dry_run: bool
    matched: int
    acted: int
    skipped: int
    skipped_runs: tuple[tuple[int, str], ...] = ()
    done: bool = True

    def add(self, page: BulkPage) -> BulkResult:
        listed = self.skipped_runs + page.skipped[: SKIPPED_LISTED - len(self.skipped_runs)]
        return attrs.evolve(
            self,
            matched=self.matched + page.matched,
            acted=self.acted + len(page.acted),
            skipped=self.skipped + len(page.skipped),
            skipped_runs=listed,
            done=page.next_after is None,
        )


Progress = Callable[[BulkResult], object]


def check(
    where: object, batch_size: object, progress: object, *, awaits: bool = False
) -> RunFilter:
    if not isinstance(where, RunFilter):
        raise InvalidArgument(
            f"a bulk operation takes a RunFilter (RunFilter(workflows=..., states=...)), "
            f"not {where!r}"
        )
    if (
        not isinstance(batch_size, int)
        or isinstance(batch_size, bool)
        or not 1 <= batch_size <= MAX_BATCH_SIZE
    ):
        raise InvalidArgument(
            f"batch_size must be an integer from 1 to {MAX_BATCH_SIZE}, not {batch_size!r}"
        )
    if progress is not None and not callable(progress):
        raise InvalidArgument(f"progress must be a callable or None, not {progress!r}")
    if not awaits and inspect.iscoroutinefunction(progress):
        raise InvalidArgument(
            "progress is a coroutine function, which Client would call without awaiting: "
            "pass a plain function, or use AsyncClient, which awaits it"
        )
    return where


#: Rows per transaction when a bulk operation applies what came due first.
SETTLE_PAGE = 500


def settle_due(transaction: Transaction, engine: Engine) -> None:
    """Apply what came due in any run and no scanner applied yet (timers, signal timeouts,
    deadlines), page after page as the scanner's passes do, so that a bulk operation
    selects from the runs a prompt scanner would have left (a run whose signal timeout
    passed is failed, and ``retry_many`` of failed runs takes it)."""
    for settle in (engine.fire_timers, engine.time_out_signal_waits, engine.fail_past_deadlines):
        after: int | None = 0
        while after is not None:
            _, after = transaction(functools.partial(_settle_page, settle, after))


def _settle_page(
    settle: Callable[..., tuple[int, int | None]], after: int, tx: Tx
) -> tuple[int, int | None]:
    return settle(tx, after_id=after, limit=SETTLE_PAGE)


def dry_run(
    transaction: Transaction, engine: Engine, action: BulkAction, where: RunFilter
) -> BulkResult:
    """Count what ``action`` would select now (after applying what came due, as the
    operation would); act on nothing."""
    settle_due(transaction, engine)

    def counted(tx: Tx) -> int:
        return engine.count_bulk(tx, action, where, up_to=engine.bulk_bound(tx))

    matched = transaction(counted)
    return BulkResult(action=action.value, dry_run=True, matched=matched, acted=0, skipped=0)


def run_pages(
    transaction: Transaction,
    engine: Engine,
    action: BulkAction,
    where: RunFilter,
    batch_size: int,
) -> Iterator[BulkResult]:
    """Act batch after batch; yield the counts so far after each committed batch."""
    settle_due(transaction, engine)
    up_to = transaction(engine.bulk_bound)
    result = BulkResult(action=action.value, dry_run=False, matched=0, acted=0, skipped=0)
    after_id = 0
    while True:
        page = transaction(
            functools.partial(_page, engine, action, where, after_id, up_to, batch_size)
        )
        result = result.add(page)
        yield result
        if page.next_after is None:
            return
        after_id = page.next_after


def _page(
    engine: Engine,
    action: BulkAction,
    where: RunFilter,
    after_id: int,
    up_to: int,
    limit: int,
    tx: Tx,
) -> BulkPage:
    return engine.bulk_page(tx, action, where, after_id=after_id, up_to=up_to, limit=limit)
