"""A fixed pool of daemon threads for sync handlers.

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
    def __init__(self, size: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
            for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self) -> None:
        """Stop idle threads; busy ones finish their handler (or die with the process)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - the handler boundary: every failure is an outcome
                future.set_exception(exc)
            else:
                future.set_result(result)
