"""Waiting for runs to end and following their events: one watcher per client, for every
``wait()``, ``result()`` and ``events()`` in flight.

A watcher holds one connection and one thread, however many waits and followers there
are: the thread LISTENs on ``cyclone_run_done`` (and on ``cyclone_events`` while a
follower is in flight: a client that only waits is not sent every event's notification)
and reads, in one statement each time, the state of a new wait's run at once, of the
runs a notification names, and of every run waited for each
:data:`~cyclone_dsl.client.handle.RECHECK_SECONDS` as a fallback (without LISTEN, a
pooled DSN and no ``listen_dsn``: every :data:`~cyclone_dsl.client.handle.POLL_SECONDS`).
Followers are read the same way, each from its cursor, a page at a time: a new one at
once, those whose run a notification names, every one at each fallback read, and one
whose last page was full as soon as its consumer took that page (never before: a slow
consumer has at most one page read ahead). Each wait or follower blocks on an event of
its own (sync) or awaits one on its loop (async), and keeps its own deadline.

Every read is bounded (:func:`~cyclone_dsl.db.listen.answer_within`), so a lost or
half-open connection is replaced within the ping timeout, and a wait past its deadline
ends with ``TimeoutError`` once the watcher has answered for its run at least once, or
failed since it began. The connection closes when the client closes, or after
:data:`IDLE_SECONDS` without a wait or a follower. A watcher survives ``os.fork()``: the
child never uses nor closes the parent's connection, and starts its own on its first wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import attrs

from cyclone_dsl.client.handle import EVENTS_PAGE, RECONNECT_SECONDS, WaitRoute, deadline_of
from cyclone_dsl.client.model import StepEvent
from cyclone_dsl.db.errors import own_copy
from cyclone_dsl.db.listen import PING_TIMEOUT_S
from cyclone_dsl.db.listener import ConnectionLost, Listener, poke, readable, wake_pair
from cyclone_dsl.engine import EVENTS_CHANNEL, RUN_DONE_CHANNEL, run_ids_of
from cyclone_dsl.errors import ClientClosed, RunNotFound
from cyclone_dsl.sql import Q
from cyclone_dsl.states import RunState

#: A watcher with no wait nor follower closes its connection (and its thread ends) after
#: this long.
IDLE_SECONDS = 10.0
#: Past its deadline, a wait whose run the watcher has not read yet looks again this often
#: (the watcher's first read is under way; it is bounded by the ping timeout).
FIRST_ANSWER_POLL = 0.1

#: What a watcher LISTENs on while only waits are in flight (followers add EVENTS_CHANNEL).
WAIT_CHANNELS = (RUN_DONE_CHANNEL,)

#: Every watcher of this process, for the after-fork hook.
_LIVE: weakref.WeakSet[RunWatcher] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for watcher in list(_LIVE):
        watcher._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@attrs.define(eq=False)
class _Wait:
    """One wait in flight. The watcher's thread writes its fields, then calls ``wake``."""

    run_id: int
    wake: Callable[[], None]
    #: The watcher's failure count when the wait began.
    failures_before: int
    #: Waits are numbered as they begin: a read answers only those that began before it
    #: was sent (a later one could be told a state its run had already left).
    number: int
    ended: str | None = None
    error: BaseException | None = None
    last_state: str | None = None
    answered: bool = False


@attrs.define(eq=False)
class _Follow:
    """One follower of a run's events. The watcher's thread reads the page after ``cursor``
    into ``pending`` (only when it is empty), then calls ``wake``; the consumer takes it."""

    run_id: int
    wake: Callable[[], None]
    failures_before: int
    cursor: int
    pending: list[StepEvent] = attrs.Factory(list)
    #: Read at the next chance: new, named by a notification, or its last page was full.
    due: bool = True
    #: The run is terminal and every event it recorded is in ``pending`` or was taken.
    ended: bool = False
    error: BaseException | None = None
    last_state: str | None = None
    answered: bool = False


class _LoopEvent:
    """An event of the running loop that the watcher's thread sets."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self, seconds: float | None) -> None:
        """Until set, or ``seconds`` (None: no limit); then cleared."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._event.wait()
        self._event.clear()


class RunWatcher:
    """Waits for runs to end on ``route`` for one client (see the module's docstring)."""

    def __init__(self, route: WaitRoute, *, closed: Callable[[], bool]) -> None:
        self.route = route
        self._client_closed = closed
        self._lock = threading.Lock()
        self._waits: dict[int, list[_Wait]] = {}
        self._fresh: set[int] = set()  # runs whose waits began since the last read
        self._follows: list[_Follow] = []
        self._closed = False
        self._failures = 0
        self._begun = 0  # the number of the last wait that began
        self._thread: threading.Thread | None = None
        self._listener = self._new_listener()
        # The thread's wake-up: a socket pair it selects on with its connection (made
        # with the thread, closed when it ends).
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._pid = os.getpid()
        _LIVE.add(self)

    # -- the waits ---------------------------------------------------------------------------

    def wait(self, run_id: int, timeout: float | None) -> str:
        """Block until run ``run_id`` is terminal; return its state. Raises
        :class:`RunNotFound`, ``TimeoutError`` after ``timeout`` seconds, or
        :class:`ClientClosed` when the client closes meanwhile."""
        deadline = deadline_of(timeout)
        woken = threading.Event()
        wait = self._begin(run_id, woken.set)
        try:
            while True:
                ended = self._outcome(wait, deadline, timeout)
                if ended is not None:
                    return ended
                woken.wait(self._pause(deadline))
                woken.clear()
        finally:
            self._end(wait)

    async def wait_async(self, run_id: int, timeout: float | None) -> str:
        """:meth:`wait` for a coroutine: never blocks its event loop."""
        deadline = deadline_of(timeout)
        woken = _LoopEvent()
        wait = self._begin(run_id, woken.set)
        try:
            while True:
                ended = self._outcome(wait, deadline, timeout)
                if ended is not None:
                    return ended
                await woken.wait(self._pause(deadline))
        finally:
            self._end(wait)

    def follow(self, run_id: int, after: int, timeout: float | None) -> Iterator[StepEvent]:
        """Yield run ``run_id``'s events after seq ``after``, in order, as they are recorded;
        end once the run is terminal and every event was yielded. Raises
        :class:`RunNotFound`, ``TimeoutError`` when the run has not ended after ``timeout``
        seconds, or :class:`ClientClosed`."""
        deadline = deadline_of(timeout)
        woken = threading.Event()
        follow = self._begin_follow(run_id, after, woken.set)
        try:
            while True:
                events, done = self._next_events(follow, deadline, timeout)
                yield from events
                if done:
                    return
                if not events:
                    woken.wait(self._pause(deadline))
                    woken.clear()
        finally:
            self._end_follow(follow)

    async def follow_async(
        self, run_id: int, after: int, timeout: float | None
    ) -> AsyncIterator[StepEvent]:
        """:meth:`follow` for a coroutine: never blocks its event loop."""
        deadline = deadline_of(timeout)
        woken = _LoopEvent()
        follow = self._begin_follow(run_id, after, woken.set)
        try:
            while True:
                events, done = self._next_events(follow, deadline, timeout)
                for event in events:
                    yield event
                if done:
                    return
                if not events:
                    await woken.wait(self._pause(deadline))
        finally:
            self._end_follow(follow)

    def in_flight(self) -> int:
        """How many waits and followers are in flight."""
        with self._lock:
            return len(self._all_waits()) + len(self._follows)

    def close(self) -> None:
        """End every wait in flight with :class:`ClientClosed`, and the thread."""
        with self._lock:
            self._closed = True
            waiters = self._all_waiters()
            thread = self._thread
        for waiter in waiters:
            waiter.wake()
        self._poke()
        if thread is not None and thread is not threading.current_thread():
            thread.join(PING_TIMEOUT_S + 1)

    def _begin(self, run_id: int, wake: Callable[[], None]) -> _Wait:
        with self._starting():
            self._begun += 1
            wait = _Wait(run_id, wake, self._failures, self._begun)
            self._waits.setdefault(run_id, []).append(wait)
            self._fresh.add(run_id)
        return wait

    def _begin_follow(self, run_id: int, after: int, wake: Callable[[], None]) -> _Follow:
        with self._starting():
            follow = _Follow(run_id, wake, self._failures, after)
            self._follows.append(follow)
        return follow

    @contextlib.contextmanager
    def _starting(self) -> Iterator[None]:
        """Under the lock, a wait or a follower begins (ClientClosed once closed); then the
        thread is started if need be, and poked."""
        self._forked()  # a no-op but in a child that forked without the at-fork hook
        with self._lock:
            if self._closed or self._client_closed():
                raise ClientClosed("the client was closed: open a new one")
            yield
            if self._thread is None:
                self._wake = wake_pair()
                self._thread = threading.Thread(
                    target=self._watch, args=(self._wake[0],), name="cyclone-wait", daemon=True
                )
                self._thread.start()
        self._poke()

    def _end(self, wait: _Wait) -> None:
        with self._lock:
            waits = self._waits.get(wait.run_id, [])
            if wait in waits:
                waits.remove(wait)
            if not waits:
                self._waits.pop(wait.run_id, None)

    def _end_follow(self, follow: _Follow) -> None:
        with self._lock:
            if follow in self._follows:
                self._follows.remove(follow)

    def _next_events(
        self, follow: _Follow, deadline: float | None, timeout: float | None
    ) -> tuple[list[StepEvent], bool]:
        """The events read for the follower since the last call, and whether it is done;
        or raise what ended it."""
        if self._closed or self._client_closed():
            raise ClientClosed(
                f"the client was closed while following the events of run {follow.run_id}"
            )
        poke = False
        with self._lock:
            if follow.error is not None:
                raise follow.error
            if follow.pending:
                events, follow.pending = follow.pending, []
                poke = follow.due  # its last page was full: the next one is read now
            elif follow.ended:
                return [], True
            else:
                events = []
        if events:
            if poke:
                self._poke()
            return events, False
        self._check_deadline(follow, deadline, timeout)
        return [], False

    def _outcome(self, wait: _Wait, deadline: float | None, timeout: float | None) -> str | None:
        """The run's terminal state; None to keep waiting; or raise what ended the wait."""
        if wait.error is not None:
            raise wait.error
        if wait.ended is not None:
            return wait.ended
        if self._closed or self._client_closed():
            raise ClientClosed(f"the client was closed while waiting for run {wait.run_id}")
        self._check_deadline(wait, deadline, timeout)
        return None

    def _check_deadline(
        self, waiter: _Wait | _Follow, deadline: float | None, timeout: float | None
    ) -> None:
        """Past its deadline, a wait or follower ends with ``TimeoutError`` once the watcher
        answered that its run is still going, or failed since it began (a follower of an
        ended run reads its last pages however long that takes)."""
        if deadline is None or time.monotonic() < deadline:
            return
        going = waiter.last_state is not None and not RunState(waiter.last_state).is_terminal
        if waiter.answered and going:
            raise TimeoutError(f"run {waiter.run_id} is still {waiter.last_state} after {timeout}s")
        if self._failures > waiter.failures_before:
            raise TimeoutError(f"run {waiter.run_id}: no answer from PostgreSQL in {timeout}s")

    @staticmethod
    def _pause(deadline: float | None) -> float | None:
        if deadline is None:
            return None
        # A thread waits at most TIMEOUT_MAX (about 292 years) at a time: a longer finite
        # timeout raised OverflowError; the loop waits again until the deadline.
        return min(max(deadline - time.monotonic(), FIRST_ANSWER_POLL), threading.TIMEOUT_MAX)

    # -- the thread ----------------------------------------------------------------------

    def _watch(self, wake: socket.socket) -> None:
        try:
            self._watch_until_idle(wake)
        except Exception as exc:  # a bug of the watcher's own: no wait is left hanging on it
            self._fail_waits(exc)
            raise
        finally:
            self._retire()

    def _watch_until_idle(self, wake: socket.socket) -> None:
        idle_since: float | None = None
        next_full_read = 0.0  # every run waited for or followed is read again at this time
        heard: set[int] = set()  # runs named by the last notifications of run ends
        heard_events: set[int] = set()  # runs named by the last notifications of events
        while True:
            with self._lock:
                if self._closed:
                    return
                if self._waits or self._follows:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= IDLE_SECONDS:
                    # In the same locked section as the check: a wait that begins from now
                    # on starts a new thread, with a listener of its own.
                    _shut(*self._detach())
                    return
                ids = set(self._waits)
                due = (self._fresh | heard) & ids
                self._fresh = set()
                full_read = time.monotonic() >= next_full_read
                for follow in self._follows:
                    if full_read or follow.run_id in heard or follow.run_id in heard_events:
                        follow.due = True
                follows = [
                    f
                    for f in self._follows
                    if f.due and not f.pending and not f.ended and f.error is None
                ]
                watching = bool(ids or self._follows)
                # Event notifications are only listened to while someone follows events.
                channels = (RUN_DONE_CHANNEL, EVENTS_CHANNEL) if self._follows else WAIT_CHANNELS
            heard, heard_events = set(), set()
            try:
                self._listener.listen_to(channels)
                if full_read and watching:
                    next_full_read = time.monotonic() + self.route.recheck
                if ids and full_read:
                    self._read(sorted(ids))
                elif due:
                    self._read(sorted(due))
                if follows:
                    self._read_events(follows)
                wait_for = IDLE_SECONDS if not watching else next_full_read - time.monotonic()
                notifications, _ = self._listener.wait(max(0.0, wait_for), wake)
                for channel, payload in notifications:
                    named = heard_events if channel == EVENTS_CHANNEL else heard
                    named.update(run_ids_of(payload))
            except ConnectionLost:
                next_full_read = 0.0  # once reconnected
                self._lost(wake)
            except Exception as exc:  # noqa: BLE001 - handed to the waits, which raise it
                self._fail_waits(exc)

    def _retire(self) -> None:
        """The thread ends (closed, or on an error of its own): the next wait starts one."""
        with self._lock:
            if self._thread is not threading.current_thread():
                return
            detached = self._detach()
        _shut(*detached)

    def _detach(self) -> tuple[Listener, tuple[socket.socket, socket.socket] | None]:
        """Under the lock, as the thread ends: its listener and wake-up sockets, to be shut
        (:func:`_shut`); the next wait starts a thread with new ones."""
        self._thread = None
        listener, self._listener = self._listener, self._new_listener()
        pair, self._wake = self._wake, None
        return listener, pair

    def _all_waits(self) -> list[_Wait]:
        """Every wait in flight (under the lock)."""
        return [w for ws in self._waits.values() for w in ws]

    def _all_waiters(self) -> list[_Wait | _Follow]:
        """Every wait and follower in flight (under the lock)."""
        return [*self._all_waits(), *self._follows]

    def _read(self, ids: list[int]) -> None:
        """Read the runs' states (connecting first if need be) and answer the waits that
        began before the read."""
        with self._lock:
            before = self._begun
        rows = self._listener.rows(Q.get_run_states, {"run_ids": ids})
        states = {int(r["id"]): str(r["state"]) for r in rows}
        woken: list[_Wait] = []
        with self._lock:
            for run_id in ids:
                state = states.get(run_id)
                for wait in self._waits.get(run_id, []):
                    if wait.number > before:
                        continue  # its own read comes next (it is fresh)
                    if state is None:
                        wait.error = RunNotFound(run_id)
                    elif RunState(state).is_terminal:
                        wait.ended = state
                    wait.last_state = state
                    wait.answered = True
                    woken.append(wait)
        for wait in woken:
            wait.wake()

    def _read_events(self, follows: list[_Follow]) -> None:
        """Read the next page of each follower's events (connecting first if need be) and
        hand each its page."""
        rows = self._listener.rows(
            Q.followed_events,
            {
                "run_ids": [f.run_id for f in follows],
                "afters": [f.cursor for f in follows],
                "limit": EVENTS_PAGE,
            },
        )
        pages: defaultdict[int, list[dict[str, Any]]] = defaultdict(list)
        for row in rows:
            pages[int(row["follower"])].append(row)
        with self._lock:
            for number, follow in enumerate(follows, 1):
                page = pages.get(number)
                if not page:
                    follow.error = RunNotFound(follow.run_id)
                    continue
                events = [
                    StepEvent.from_row(follow.run_id, r) for r in page if r["seq"] is not None
                ]
                follow.pending.extend(events)
                if events:
                    follow.cursor = events[-1].seq
                follow.due = len(events) >= EVENTS_PAGE
                follow.last_state = str(page[0]["run_state"])
                follow.ended = RunState(follow.last_state).is_terminal and not follow.due
                follow.answered = True
        for follow in follows:
            follow.wake()

    def _new_listener(self) -> Listener:
        route = self.route
        return Listener(
            route.dsn,
            name=f"cyclone-wait-{os.getpid()}",
            channels=WAIT_CHANNELS,
            listen=route.listen,
            pooled=route.pooled,
        )

    def _lost(self, wake: socket.socket) -> None:
        """The connection failed (or could not be made): count it, let the waits past their
        deadline end, and pause before the next try (a new wait or a close cuts it short)."""
        with self._lock:
            self._failures += 1
            waiters = self._all_waiters()
        for waiter in waiters:
            waiter.wake()
        readable([wake.fileno()], RECONNECT_SECONDS)

    def _fail_waits(self, exc: Exception) -> None:
        """An error that is not a lost connection (the schema is missing, a permission):
        every wait in flight raises it, as its own read would have (a copy each, caused by
        ``exc``: one exception object raised in several threads at once would carry their
        tracebacks mixed)."""
        self._listener.close()
        with self._lock:
            waiters = self._all_waiters()
            for waiter in waiters:
                waiter.error = own_copy(exc)
        for waiter in waiters:
            waiter.wake()

    def _poke(self) -> None:
        """Wake the thread (a new wait, or the close)."""
        poke(self._wake)

    def _forked(self) -> None:
        """In a child just forked: the parent's thread is not here, and its connection is
        left alone (see :meth:`Listener.abandon`); the child's first wait starts anew."""
        if self._pid == os.getpid():
            return
        self._lock = threading.Lock()  # the parent's thread may have held it
        self._waits = {}
        self._fresh = set()
        self._follows = []
        listener, pair = self._detach()
        listener.abandon()
        _close_pair(pair)  # the child's copies: the parent's stay open
        self._pid = os.getpid()


def _close_pair(pair: tuple[socket.socket, socket.socket] | None) -> None:
    if pair is not None:
        for sock in pair:
            sock.close()


def _shut(listener: Listener, pair: tuple[socket.socket, socket.socket] | None) -> None:
    listener.close()
    _close_pair(pair)


__all__ = ["IDLE_SECONDS", "RunWatcher"]
