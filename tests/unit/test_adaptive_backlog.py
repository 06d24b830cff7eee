"""The sync slot limit (no database): a backlog is judged by the interval's last claim,
so work that arrives after idle polls, and takes every free slot, still counts as one."""

from __future__ import annotations

from cyclone_dsl.worker.adaptive import START, Sample, SlotController


def interval(*, claims: int, asked: int, claimed: int, last_full: bool | None) -> Sample:
    """Two seconds without a returned handler, the fetch loop waiting for slots through
    most of it (handlers that wait on a slow service)."""
    return Sample(
        seconds=2.0,
        returned=0,
        claims=claims,
        asked=asked,
        claimed=claimed,
        slot_wait=1.8,
        peak=START,
        handler_cpu=0.0,
        process_cpu=0.01,
        last_claim_full=last_full,
    )


def test_a_backlog_that_arrives_after_idle_polls_grows_the_limit() -> None:
    controller = SlotController(START, 256, 100)
    # Twenty idle polls, then one step (its claim short), then 39 more: the last claim
    # took every one of the 9 free slots.
    first = controller.update(interval(claims=22, asked=219, claimed=10, last_full=True))
    # Then no claim at all: every slot is held, the fetch loop only waits.
    second = controller.update(interval(claims=0, asked=0, claimed=0, last_full=None))
    assert START < first < second


def test_a_last_claim_that_came_back_short_is_no_backlog() -> None:
    controller = SlotController(START, 256, 100)
    assert controller.update(interval(claims=3, asked=30, claimed=29, last_full=False)) == START
    assert controller.update(interval(claims=0, asked=0, claimed=0, last_full=None)) == START
