"""Reads that every open dashboard page polls, shared by all of them.

Counting the runs by state walks every kept run (no index gives the count of ended runs):
98 ms of server time with 1,000,000 runs kept, and each open page asked for it every 2
seconds; the queues page's chart reads the stats, whose cost follows the open work (175
ms with 100,000 runs queued). A :class:`Throttled` read is done again only once its last
value is older than ``share`` times what that read took (at least ``fresh_for``
seconds): however many pages poll it, the dashboard keeps the server busy with it at
most about 1/``share`` of the time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from cyclone_dsl.client.sync import Client

T = TypeVar("T")


class Throttled(Generic[T]):
    """The last value of ``read(client)``, read again when it is stale (see the module)."""

    def __init__(
        self, read: Callable[[Client], T], *, fresh_for: float = 1.0, share: float = 20.0
    ) -> None:
        self._read = read
        self.fresh_for = fresh_for
        self.share = share
        self._lock = threading.Lock()  # one read at a time; the others wait for its value
        self._last: tuple[Client, T, float] | None = None  # client, value, fresh until

    def get(self, client: Client) -> T:
        """The value read from ``client`` (a primary or a replica), read now when the last
        one is stale or came from another client."""
        with self._lock:
            last = self._last
            if last is not None and last[0] is client and time.monotonic() < last[2]:
                return last[1]
            started = time.monotonic()
            value = self._read(client)
            took = time.monotonic() - started
            self._last = (client, value, started + took + max(self.fresh_for, self.share * took))
            return value
