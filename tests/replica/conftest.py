"""A primary and a streaming replica of it: two private embedded servers, for this folder.

The primary is made fresh (not the test database's server, which other tests share): the
replica is a ``pg_basebackup -R`` copy of it on its own socket, and the tests steer its
replay (pause, resume) and stop it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import psycopg
import pytest

from cyclone_dsl import migrate
from cyclone_dsl.db.embedded import EmbeddedServer
from cyclone_dsl.db.replica import Probe
from tests.waiting import wait_until


@attrs.frozen
class Pair:
    primary: EmbeddedServer
    replica: EmbeddedServer

    @property
    def primary_url(self) -> str:
        return self.primary.url

    @property
    def replica_url(self) -> str:
        return self.replica.url

    def caught_up(self) -> None:
        """Wait until the replica has replayed every write the primary has made so far."""
        with (
            Probe(self.primary_url, name="test-primary") as primary,
            Probe(self.replica_url, name="test-replica") as replica,
        ):
            lsn = primary.wal_position()
            assert lsn is not None
            wait_until(lambda: replica.replayed(lsn), what="the replica to replay")

    def replay(self, *, paused: bool) -> None:
        """Pause or resume the replica's replay (WAL still arrives; it is not applied)."""
        with psycopg.connect(self.replica_url, autocommit=True) as conn:
            if paused:
                conn.execute("SELECT pg_wal_replay_pause()")
            else:
                conn.execute("SELECT pg_wal_replay_resume()")


@pytest.fixture(scope="package")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root: Path = tmp_path_factory.mktemp("replication")
    primary = EmbeddedServer(root / "primary" / "pgdata")
    primary.start()
    replica: EmbeddedServer | None = None
    try:
        migrate(primary.url)
        replica = primary.make_replica(root / "replica" / "pgdata")
        replica.start()
        made = Pair(primary, replica)
        made.caught_up()
        yield made
    finally:
        if replica is not None:
            replica.stop("immediate")
        primary.stop("immediate")


@pytest.fixture
def live_pair(pair: Pair) -> Iterator[Pair]:
    """The pair with the replica up and replaying, and left so after the test."""
    if not pair.replica.is_running():
        pair.replica.start()
    pair.replay(paused=False)
    yield pair
    if not pair.replica.is_running():
        pair.replica.start()
    pair.replay(paused=False)
