"""How a standby's state reads to people (no database: the status is given)."""

from __future__ import annotations

from datetime import timedelta

from cyclone_dsl.db.replica import StandbyStatus, is_lsn


def status(**given: object) -> StandbyStatus:
    values: dict[str, object] = {
        "in_recovery": True,
        "replay_age": timedelta(minutes=5),
        "caught_up": True,
        "receiving": True,
    }
    values.update(given)
    return StandbyStatus(**values)  # type: ignore[arg-type]


def test_a_caught_up_replica_of_an_idle_primary_is_up_to_date() -> None:
    # The last replayed commit is 5 minutes old because the primary wrote nothing since.
    idle = status()
    assert idle.lag == timedelta(0)
    assert idle.describe() == "replica up to date"
    assert not idle.behind


def test_a_replica_with_wal_to_replay_is_behind_by_its_last_commit_age() -> None:
    lagging = status(caught_up=False, replay_age=timedelta(seconds=2))
    assert lagging.describe() == "replica 2 s behind"
    assert lagging.behind
    assert status(caught_up=False, replay_age=timedelta(milliseconds=120)).describe() == (
        "replica 120 ms behind"
    )
    assert "3 min behind" in status(caught_up=False, replay_age=timedelta(minutes=3)).describe()


def test_a_replica_cut_off_from_its_primary_says_so() -> None:
    cut_off = status(receiving=False)
    assert cut_off.describe() == (
        "replica not streaming from its primary: its last replayed change is 5 min old"
    )
    assert cut_off.behind


def test_a_primary_is_not_called_a_replica() -> None:
    primary = status(in_recovery=False, replay_age=None, caught_up=False, receiving=False)
    assert primary.lag is None and primary.behind
    assert "not a replica" in primary.describe()


def test_only_wal_positions_are_taken_from_the_url() -> None:
    assert is_lsn("16/B374D848") and is_lsn("0/3000060")
    assert not is_lsn("0/3000060'; select 1") and not is_lsn("") and not is_lsn("16")
