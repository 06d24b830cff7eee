"""A pool of daemon threads for sync handlers, started as they are needed.

Unlike :class:`concurrent.futures.ThreadPoolExecutor`, whose threads the
interpreter joins at exit, a handler still running after the grace period
cannot keep a stopping worker process alive: its lease was released and
another worker runs the step again.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol


class Settled(Protocol):
    """A finished call, as :class:`concurrent.futures.Future` shows one (the async
    handlers' futures are those)."""

    def cancelled(self) -> bool: ...

    def exception(self) -> BaseException | None: ...

    def result(self) -> Any: ...


class Returned:
    """What a pool thread hands its callback: a Future costs a Condition and its lock per
    call, more than the rest of a no-op step's dispatch, and nobody waits on these."""

    __slots__ = ("_exception", "_result")

    def __init__(self, result: Any, exception: BaseException | None) -> None:
        self._result = result
        self._exception = exception

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return self._exception

    def result(self) -> Any:
        if self._exception is not None:
            raise self._exception
        return self._result


log = logging.getLogger("cyclone.worker")

_Job = tuple[Callable[[Settled], None], Callable[..., Any], tuple[Any, ...]]


class DaemonThreadPool:
    """Up to ``size`` threads; one is started when a job comes and none is idle (the
    worker's slots bound the jobs in flight, so threads follow the slots used)."""

    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def threads(self) -> int:
        """Threads started so far."""
        return len(self._threads)

    def owns(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` is one of this pool's."""
        with self._lock:
            return thread in self._threads

    def submit(
        self, on_done: Callable[[Settled], None], fn: Callable[..., Any], *args: Any
    ) -> None:
        """Call ``fn(*args)`` on a pool thread, then ``on_done`` there with its outcome."""
        self._jobs.put((on_done, fn, args))
        if not self._idle.acquire(blocking=False):
            with self._lock:
                if len(self._threads) < self._size:
                    thread = threading.Thread(
                        target=self._loop, name=f"{self._name}-{len(self._threads)}", daemon=True
                    )
                    thread.start()
                    self._threads.append(thread)

    def shutdown(self) -> None:
        """Stop idle threads; busy ones finish their handler (or die with the process)."""
        with self._lock:
            for _ in self._threads:
                self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run(*job)
            self._idle.release()

    @staticmethod
    def _run(
        on_done: Callable[[Settled], None], fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        try:
            outcome = Returned(fn(*args), None)
        except BaseException as exc:  # noqa: BLE001 - the handler boundary: every failure is an outcome
            outcome = Returned(None, exc)
        try:
            on_done(outcome)
        except Exception:  # as a Future's callbacks: logged, and the thread goes on
            log.exception("a handler's completion callback raised")
