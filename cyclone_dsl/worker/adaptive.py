"""How many handlers a worker runs at once, when the user did not say.

:class:`Slots` is the worker's slot count, a semaphore whose limit can change while it
is in use. :class:`SlotController` moves that limit from what the worker saw over the
last interval (a :class:`Sample`):

* the last claim came back full (a backlog) and either were small (fast handlers free their
  slots while the next claim runs, so the limit sets the claim size, and a bigger claim
  costs less per step) or the fetch loop spent much of the interval waiting for a free
  slot (slow handlers hold the slots back): it doubles, or grows by a quarter when the
  wait is moderate. Sleeping or I/O-bound handlers hold their slots without using the
  CPU, so this goes on until claiming and completing (or the cap) limit the rate; for
  fast handlers it stops once claims average half of ``batch_size``;
* handlers that take most of the process's CPU (more threads would only contend for it)
  halve it, down to the number of cores;
* slots left unused (claims come back short: no backlog) make it decay back towards
  what was used, never below where it started.

Async handlers have a limit of their own (see :mod:`cyclone_dsl.worker.lanes`): they hold
no thread, so it starts at :data:`ASYNC_START` and may grow to :data:`MAX_ASYNC`; instead
of the CPU rule, it stops growing while the event loop's thread is busy most of the time
(more handlers on a saturated loop would only queue there).

Claims never take more steps than there are free slots, so the claim size follows.
No rate comparisons: on a loaded machine the rate of one interval is too noisy to tell
a better limit from a worse one; the share of time spent waiting for slots is not.
"""

from __future__ import annotations

import os
import threading

import attrs

#: Where an adaptive worker starts.
START = 10
#: The default cap of an adaptive worker.
MAX_CONCURRENCY = 256
#: The default cap when the worker serves transactional handlers (a connection each).
MAX_TRANSACTIONAL = 32
#: Where the limit of async handlers starts (one full claim)...
ASYNC_START = 100
#: ...and its default cap: an async handler waiting holds no thread, only its task.
MAX_ASYNC = 10_000
#: The event loop's thread busy this share of an interval: async handlers stop growing.
LOOP_BUSY = 0.8
#: The controller looks at the last interval once it is this long and at least
#: MIN_RETURNS handlers returned in it (or once it is LONGEST_INTERVAL_S long).
INTERVAL_S = 0.1
MIN_RETURNS = 20
LONGEST_INTERVAL_S = 2.0
#: Waiting for slots this share of the interval grows the limit by a quarter...
GROW_WAIT = 0.2
#: ...and this share doubles it.
DOUBLE_WAIT = 0.3
#: Claims averaging less than this share of ``batch_size`` are small.
SMALL_CLAIM = 0.5
#: Intervals with slots left unused before the limit decays.
IDLE_INTERVALS = 10
#: Handlers using this share of the process's CPU are CPU-bound.
CPU_BOUND_SHARE = 0.5


@attrs.frozen
class WorkerSettings:
    """A worker's effective settings now (see :meth:`Worker.settings`)."""

    #: Whether the slot limit adapts (no ``concurrency`` was given).
    adaptive: bool
    #: Handlers it may run at once now (the slot limit).
    concurrency: int
    #: The most the limit may grow to (``concurrency`` itself when fixed).
    max_concurrency: int
    #: The most steps one claim takes now: the smaller of ``batch_size`` and the limit.
    claim_size: int
    #: The cap on one claim (and one batch of completions).
    batch_size: int
    #: Handlers running now.
    slots_in_use: int
    #: Threads started for sync handlers (started as slots are used, never more than
    #: ``max_concurrency``).
    threads: int
    #: Async handlers it may run at once now (their own limit; it always adapts).
    async_concurrency: int
    #: The most that limit may grow to (``max_async``).
    max_async: int
    #: Async handlers running now (counted in ``slots_in_use`` too).
    async_in_use: int


@attrs.define
class Sample:
    """What the worker saw over one interval."""

    seconds: float
    returned: int  # handlers that returned
    claims: int  # claims made
    asked: int  # slots offered to claims
    claimed: int  # steps those claims returned
    slot_wait: float  # seconds the fetch loop waited for a free slot
    peak: int  # most slots in use at once
    handler_cpu: float  # CPU seconds the handlers' threads used (async: the loop's thread)
    process_cpu: float  # CPU seconds the whole process used
    #: Whether the interval's last claim filled every slot it was offered (None: no
    #: claim). The backlog is judged by it: idle polls earlier in the interval say nothing
    #: of the work that arrived since, and while every slot is held no claim is made.
    last_claim_full: bool | None = None


class SlotController:
    """Moves a slot limit between ``floor`` and ``cap``, one :class:`Sample` at a time.

    With ``busy`` (async handlers, on one event loop thread), handlers whose thread used
    that share of the interval hold the limit where it is, instead of halving it.
    """

    def __init__(
        self,
        start: int,
        cap: int,
        batch_size: int,
        floor: int | None = None,
        busy: float | None = None,
    ) -> None:
        self.cap = cap
        self.busy = busy
        self.batch_size = batch_size
        self.start = min(start, cap)
        self.floor = min(self.start, floor if floor is not None else max(2, os.cpu_count() or 2))
        self.limit = self.start
        self._idle = 0
        self._backlog = False

    def update(self, s: Sample) -> int:
        """Take one interval's sample; return the new limit."""
        if s.last_claim_full is not None:
            self._backlog = s.last_claim_full
        elif s.asked:
            self._backlog = s.claimed >= 0.9 * s.asked
        waited = s.slot_wait / s.seconds if s.seconds > 0 else 0.0
        small_claims = s.claims > 0 and s.asked < SMALL_CLAIM * self.batch_size * s.claims
        if self.busy is not None and s.handler_cpu >= self.busy * s.seconds:
            self._idle = 0  # the loop is saturated: hold
        elif (
            self.busy is None
            and s.process_cpu > 0.1 * s.seconds
            and s.handler_cpu >= CPU_BOUND_SHARE * s.process_cpu
        ):
            self._idle = 0
            self.limit = max(self.floor, min(self.limit, self.limit // 2))
        elif self._backlog and (small_claims or waited >= GROW_WAIT):
            self._idle = 0
            step = self.limit if small_claims or waited >= DOUBLE_WAIT else max(1, self.limit // 4)
            self.limit = min(self.cap, self.limit + step)
        elif not self._backlog and s.peak < self.limit:
            self._idle += 1
            if self._idle >= IDLE_INTERVALS and self.limit > self.start:
                self.limit = max(self.start, s.peak, self.limit * 3 // 4)
        else:
            self._idle = 0
        return self.limit


class Slots:
    """A counting semaphore whose limit can change while slots are taken (a smaller limit
    takes effect as taken slots are released)."""

    def __init__(self, limit: int) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._limit = limit
        self._used = 0
        self._woken = 0

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def used(self) -> int:
        return self._used

    def acquire(self, timeout: float = 0.0) -> bool:
        """Take a slot, waiting up to ``timeout`` seconds; False if none came (or
        :meth:`wake` was called meanwhile)."""
        with self._cond:
            if self._used < self._limit:
                self._used += 1
                return True
            if timeout <= 0:
                return False
            woken = self._woken
            self._cond.wait_for(lambda: self._used < self._limit or self._woken != woken, timeout)
            if self._woken != woken or self._used >= self._limit:
                return False
            self._used += 1
            return True

    def release(self, count: int = 1) -> None:
        with self._cond:
            self._used -= count
            self._cond.notify(count)

    def set_limit(self, limit: int) -> None:
        with self._cond:
            grew = limit > self._limit
            self._limit = limit
            if grew:
                self._cond.notify_all()

    def wake(self) -> None:
        """Make every waiting :meth:`acquire` return False now."""
        with self._cond:
            self._woken += 1
            self._cond.notify_all()
