"""A worker's two lanes of handlers: sync ones on threads, async ones on the event loop.

A sync handler holds a thread while it runs, so sync handlers (and transactional ones,
sync or async, which hold a connection) share the ``threads`` lane, capped by
``max_concurrency``. An async handler waiting holds only its task on the event loop's
one thread, so async handlers have a lane of their own, the ``loop`` lane, capped by
``max_async`` (thousands by default).

Each lane has its own slots and its own fetch loop, which claims only the lane's kinds,
and its own :class:`~cyclone_dsl.worker.adaptive.SlotController` fed with what that
lane saw: so a backlog of async handlers grows their limit without giving sync handlers
more threads, and sync handlers holding every thread never keep async ones from being
claimed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import attrs

from cyclone_dsl.worker import adaptive
from cyclone_dsl.worker.adaptive import Sample, SlotController, Slots


@attrs.define(eq=False)
class Lane:
    """The slots, the controller and one interval's counts of one lane.

    ``running``, ``returned`` and ``peak`` change under the worker's in-flight lock;
    the other counts only on the lane's fetch thread.
    """

    name: str
    kinds: list[str]
    slots: Slots
    controller: SlotController | None
    #: CPU seconds the lane's handler threads used so far, when it can be read at once
    #: (the loop lane: the event loop's thread); otherwise the handlers report theirs.
    cpu_clock: Callable[[], float] | None = None
    #: Handlers that must return in an interval before it is looked at (or it lasts
    #: LONGEST_INTERVAL_S): 0 for async handlers, whose held slots cost nothing.
    min_returns: int = adaptive.MIN_RETURNS
    wake: threading.Event = attrs.field(factory=threading.Event)
    running: int = 0  # handlers started and not returned
    returned: int = 0  # handlers returned (the controller's rate)
    claims: int = 0  # claims since the last sample
    asked: int = 0  # slots offered to them
    claimed: int = 0  # steps those claims returned
    last_claim_full: bool | None = None  # the last claim since the last sample filled its slots
    peak: int = 0  # most slots in use at once since the last sample
    slot_wait: float = 0.0  # seconds the fetch loop waited for slots since the last sample
    handler_cpu: list[float] = attrs.field(factory=list)  # sync handlers' thread CPU
    _sampled_at: float = 0.0
    _sampled_returned: int = 0
    _sampled_cpu: float = 0.0
    _sampled_clock: float = 0.0

    @property
    def cap(self) -> int:
        return self.controller.cap if self.controller is not None else self.slots.limit

    def begin(self) -> None:
        """Start the first interval now."""
        self._sampled_at = time.monotonic()
        self._sampled_cpu = time.process_time()
        self._sampled_clock = self.cpu_clock() if self.cpu_clock is not None else 0.0

    def adapt(self) -> tuple[int, int, Sample] | None:
        """Move the slot limit, once per interval, from what the last one showed; return
        (before, after, the sample) when it moved."""
        controller = self.controller
        if controller is None:
            return None
        now = time.monotonic()
        seconds = now - self._sampled_at
        returned = self.returned - self._sampled_returned
        if seconds < adaptive.INTERVAL_S or (
            returned < self.min_returns and seconds < adaptive.LONGEST_INTERVAL_S
        ):
            return None
        cpu = time.process_time()
        if self.cpu_clock is not None:
            clock = self.cpu_clock()
            handler_cpu = clock - self._sampled_clock
            self._sampled_clock = clock
        else:
            spent, self.handler_cpu = self.handler_cpu, []
            handler_cpu = sum(spent)
        sample = Sample(
            seconds=seconds,
            returned=returned,
            claims=self.claims,
            asked=self.asked,
            claimed=self.claimed,
            slot_wait=self.slot_wait,
            peak=max(self.peak, self.running),
            handler_cpu=handler_cpu,
            process_cpu=cpu - self._sampled_cpu,
            last_claim_full=self.last_claim_full,
        )
        self._sampled_at, self._sampled_returned, self._sampled_cpu = now, self.returned, cpu
        self.claims = self.asked = self.claimed = self.peak = 0
        self.last_claim_full = None
        self.slot_wait = 0.0
        before = self.slots.limit
        limit = controller.update(sample)
        if limit == before:
            return None
        self.slots.set_limit(limit)
        return before, limit, sample


def thread_cpu_clock(thread: threading.Thread) -> Callable[[], float] | None:
    """A function reading the CPU seconds ``thread`` used so far (None where the platform
    cannot read another thread's CPU time; 0.0 once the thread is gone)."""
    if not hasattr(time, "pthread_getcpuclockid") or thread.ident is None:
        return None
    ident = thread.ident

    def read() -> float:
        if not thread.is_alive():  # its id may name another thread, or none, by now
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except OSError:
            return 0.0

    return read
