"""A pool of daemon threads for sync handlers, started as they are needed.

Unlike :class:`concurrent.futures.ThreadPoolExecutor`, whose threads the
interpreter joins at exit, a handler still running after the grace period
cannot keep a stopping worker process alive: its lease was released and
another worker runs the step again.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

_Job = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


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

    def submit(
        self, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        if not self._idle.acquire(blocking=False):
            with self._lock:
                if len(self._threads) < self._size:
                    thread = threading.Thread(
                        target=self._loop, name=f"{self._name}-{len(self._threads)}", daemon=True
                    )
                    thread.start()
                    self._threads.append(thread)
        return future

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
        future: concurrent.futures.Future[Any],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the handler boundary: every failure is an outcome
            future.set_exception(exc)
        else:
            future.set_result(result)
