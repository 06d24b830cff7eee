"""Where the dashboard reads: the primary's client, or with ``read_dsn`` a read replica's.

Every page and read-only endpoint reads through :meth:`Reads.begin`; every action goes to
the primary's client. With a replica, each request first asks the replica how far behind
it is (one small query on a dedicated connection, so a replica that is down fails at
once with a clear error). After an action the redirect carries the primary's WAL position
(``seen=``); the page it leads to waits a moment for the replica to replay that far, and
says so when it has not, instead of showing the state from before the action as current.
"""

from __future__ import annotations

import threading
import time

import attrs

from cyclone_dsl.client.sync import Client
from cyclone_dsl.db.replica import Probe, StandbyStatus, is_lsn
from cyclone_dsl.errors import DatabaseUnavailable

#: How long a page waits for the replica to replay the action that led to it.
WAIT_FOR_REPLAY_S = 2.0
#: Between two looks at the replica's replay while waiting.
REPLAY_POLL_S = 0.05


class ReplicaUnavailable(Exception):
    """The read replica cannot be reached; pages cannot be read, actions still work."""


@attrs.frozen
class Reading:
    """What one request reads from: ``client``; with a replica, its ``status`` and whether
    it has replayed the action the request follows (``replayed``)."""

    client: Client
    status: StandbyStatus | None = None
    replayed: bool = True

    @property
    def note(self) -> str | None:
        """The replica's state for the page header (``None``: no replica)."""
        return None if self.status is None else self.status.describe()

    @property
    def behind(self) -> bool:
        """Whether the page shows the replica's note as a warning."""
        return self.status is not None and self.status.behind


class Reads:
    """The dashboard's reads: from ``primary``, or from a replica at ``read_dsn`` (its
    client opened at the first read, and again after the replica was unavailable)."""

    def __init__(self, primary: Client, read_dsn: str | None = None) -> None:
        self.primary = primary
        self.read_dsn = read_dsn
        self._replica: Client | None = None
        self._lock = threading.Lock()
        self._probe: Probe | None = None
        self._wal: Probe | None = None
        if read_dsn is not None:
            self._probe = Probe(read_dsn, name="cyclone-ui-replica")
            self._wal = Probe(primary.dsn, name="cyclone-ui-wal", pooled=primary.pooled)

    @property
    def replicated(self) -> bool:
        return self._probe is not None

    def begin(self, seen: str | None = None) -> Reading:
        """What this request reads from; ``seen``: the primary's WAL position after the
        action the request follows (waited for, up to :data:`WAIT_FOR_REPLAY_S`).
        :class:`ReplicaUnavailable` when the replica cannot be reached."""
        if self._probe is None:
            return Reading(self.primary)
        try:
            replayed = True
            if seen is not None and is_lsn(seen):
                replayed = self._wait_replayed(self._probe, seen)
            status = self._probe.standby_status()
            return Reading(self._replica_client(), status, replayed)
        except DatabaseUnavailable as exc:
            self.forget()
            raise ReplicaUnavailable(
                f"the read replica is unavailable: {exc}. Pages read from it; actions "
                "(cancel, retry, pause, resume, signal, fork, bulk) go to the primary and "
                "still work"
            ) from exc

    def position(self) -> str | None:
        """The primary's WAL position now (``None`` without a replica, or when the primary
        does not say): a page read after the replica replayed it shows every write so far."""
        if self._wal is None:
            return None
        try:
            return self._wal.wal_position()
        except DatabaseUnavailable:
            return None

    def forget(self) -> None:
        """Close the replica's client (it was unavailable): the next read opens a new one."""
        with self._lock:
            replica, self._replica = self._replica, None
        if replica is not None:
            replica.close()

    def close(self) -> None:
        self.forget()
        for probe in (self._probe, self._wal):
            if probe is not None:
                probe.close()

    def _replica_client(self) -> Client:
        with self._lock:
            if self._replica is None:
                assert self.read_dsn is not None
                self._replica = Client(
                    self.read_dsn, registry=self.primary.registry, pooled=self.primary.pooled
                )
            return self._replica

    @staticmethod
    def _wait_replayed(probe: Probe, lsn: str) -> bool:
        deadline = time.monotonic() + WAIT_FOR_REPLAY_S
        while not probe.replayed(lsn):
            if time.monotonic() >= deadline:
                return False
            time.sleep(REPLAY_POLL_S)
        return True
