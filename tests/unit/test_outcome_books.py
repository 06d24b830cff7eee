"""How a batch's committed outcomes are told to a worker's observers (metrics, tracing):
each outcome settles once, as applied or fenced, also when a step reclaimed and claimed
again by the same worker has both its claims' outcomes in one batch."""

from __future__ import annotations

from collections.abc import Collection

from cyclone_dsl.engine import Failure, Success
from cyclone_dsl.worker.observe import WorkerObserver
from cyclone_dsl.worker.worker import Worker


class Books(WorkerObserver):
    def __init__(self) -> None:
        self.completed: list[int] = []
        self.failed: list[int] = []
        self.fenced: list[int] = []

    def on_completed(self, step_ids: Collection[int]) -> None:
        self.completed.extend(step_ids)

    def on_failed(self, step_ids: Collection[int], *, retried: bool) -> None:
        self.failed.extend(step_ids)

    def on_fenced(self, step_ids: Collection[int]) -> None:
        self.fenced.extend(step_ids)


def test_two_claims_of_one_step_in_a_batch_settle_as_one_applied_and_one_fenced() -> None:
    books = Books()
    stale, fresh, other = Success(7, 1, "1"), Success(7, 2, "2"), Success(8, 1, "3")
    Worker._observe_outcomes(books, [stale, fresh, other], {7, 8}, [])
    assert (sorted(books.completed), books.fenced) == ([7, 8], [7])


def test_two_failed_claims_of_one_step_in_a_batch_settle_once_each() -> None:
    books = Books()
    stale, fresh = Failure(7, 1, "boom", "error"), Failure(7, 2, "boom", "error")
    Worker._observe_outcomes(books, [stale, fresh], {7: "available"}, [])
    assert (books.failed, books.fenced) == ([7], [7])


def test_a_batch_whose_outcomes_all_applied_fences_nothing() -> None:
    books = Books()
    Worker._observe_outcomes(books, [Success(7, 1, "1"), Success(8, 1, None)], {7, 8}, [])
    assert (sorted(books.completed), books.fenced) == ([7, 8], [])
