"""Read replicas: how far a standby is behind, and whether it has replayed a given write.

A :class:`Probe` keeps one dedicated connection to a server for these small status
queries. Every failure is a :class:`~cyclone_dsl.errors.DatabaseUnavailable` within
seconds (a refused connection at once): a dashboard that reads from a replica asks the
probe first, so a replica that is down gives a clear error page instead of a pool that
waits 30 s for a connection.
"""

from __future__ import annotations

import re
import threading
from datetime import timedelta
from typing import Any, LiteralString

import attrs
import psycopg

from cyclone_dsl.db.diagnose import connect_checked, describe_server, is_connection_loss, parse_dsn
from cyclone_dsl.db.tx import ConnectionTx, Row
from cyclone_dsl.errors import DatabaseUnavailable
from cyclone_dsl.sql import Q

#: A WAL position as PostgreSQL prints it (``16/B374D848``).
_LSN = re.compile(r"^[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$")


def is_lsn(text: str) -> bool:
    return bool(_LSN.match(text))


@attrs.frozen
class StandbyStatus:
    """What a server says of its replay (see :meth:`Probe.standby_status`)."""

    #: ``pg_is_in_recovery()``: a standby (streaming or restoring from an archive).
    in_recovery: bool
    #: ``now() - pg_last_xact_replay_timestamp()``: the age of the last commit it replayed
    #: (``None`` before it replayed any since it started, and on a primary).
    replay_age: timedelta | None
    #: It replayed all the WAL it received: it is only "behind" by what is on the way.
    caught_up: bool
    #: A WAL receiver runs (it streams from a primary).
    receiving: bool

    @property
    def lag(self) -> timedelta | None:
        """How far behind the standby is: zero when it replayed all it received from a
        primary it streams from (an idle primary commits nothing, so the age of the last
        replayed commit would grow without any lag), else that age; ``None``: unknown."""
        if not self.in_recovery:
            return None
        if self.caught_up and self.receiving:
            return timedelta(0)
        return self.replay_age

    @property
    def behind(self) -> bool:
        """Worth a warning: not a standby, a lag of a second or more, or an unknown one."""
        lag = self.lag
        return not self.in_recovery or lag is None or lag >= timedelta(seconds=1)

    def describe(self) -> str:
        """``replica up to date``, ``replica 2 s behind``, ... (for people)."""
        if not self.in_recovery:
            return "the read URL is not a replica (pg_is_in_recovery() is false): no lag to show"
        if not self.receiving:
            if self.replay_age is None:
                return "replica not streaming from its primary (nothing replayed since it started)"
            return (
                "replica not streaming from its primary: its last replayed change is "
                f"{_seconds_text(self.replay_age)} old"
            )
        lag = self.lag
        if lag is None:
            return "replica: lag unknown (nothing replayed since it started)"
        if lag == timedelta(0):
            return "replica up to date"
        return f"replica {_seconds_text(lag)} behind"


def _seconds_text(value: timedelta) -> str:
    """``850 ms``, ``2.4 s``, ``42 s``, ``3 min``, ``5 h``."""
    seconds = max(value.total_seconds(), 0.0)
    if seconds < 1:
        return f"{round(seconds * 1000)} ms"
    if seconds < 10:
        return f"{seconds:.1f}".removesuffix(".0") + " s"
    if seconds < 60:
        return f"{round(seconds)} s"
    if seconds < 3600:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f}".removesuffix(".0") + " h"


class Probe:
    """One dedicated connection to ``dsn`` for status queries, opened at the first call
    and again after a loss; thread-safe (the calls take turns)."""

    def __init__(self, dsn: str, *, name: str, pooled: bool = False) -> None:
        self.dsn = dsn
        self.server = describe_server(parse_dsn(dsn))
        self._name = name
        self._pooled = pooled
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def standby_status(self) -> StandbyStatus:
        row = self._one(Q.standby_status)
        return StandbyStatus(
            in_recovery=bool(row["in_recovery"]),
            replay_age=row["replay_age"],
            caught_up=bool(row["caught_up"]),
            receiving=bool(row["receiving"]),
        )

    def wal_position(self) -> str | None:
        """The server's current WAL position (``None`` on a standby)."""
        lsn: str | None = self._one(Q.wal_position)["lsn"]
        return lsn

    def replayed(self, lsn: str) -> bool:
        """Whether the server has replayed up to ``lsn`` (a primary: always)."""
        return bool(self._one(Q.replayed_to, lsn=lsn)["replayed"])

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _one(self, query: LiteralString, **params: object) -> Row:
        with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = connect_checked(self.dsn, name=self._name, pooled=self._pooled)
            try:
                row = ConnectionTx(self._conn).one(query, **params)
            except psycopg.OperationalError as exc:
                self._conn.close()
                self._conn = None
                if not is_connection_loss(exc):
                    raise
                raise DatabaseUnavailable(
                    f"the connection to {self.server} was lost: {str(exc).strip().splitlines()[0]}",
                    "connection_lost",
                ) from exc
        assert row is not None  # each query returns one row
        return row


def check_standby(dsn: str, *, name: str = "cyclone-check") -> StandbyStatus:
    """One connection to ``dsn`` (a :class:`DatabaseUnavailable` within seconds if there is
    none) and its :class:`StandbyStatus`."""
    with Probe(dsn, name=name) as probe:
        return probe.standby_status()
