"""Races between 8 real OS processes (scenario 6 of the reliability plan).

The thread-based versions (tests/integration/test_standalone.py and
tests/migrations/test_migrator.py) share one interpreter; here every racer is
a process of its own, started with the "spawn" context, with its own client
and connection. The 8 processes are started once for the module and serve one
task per round (see race_targets.serve); in each round they wait at a
``multiprocessing.Barrier(8)`` and then call the database at the same moment.
Every invariant is checked both on what the callers got and on the database.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Iterator, Sequence
from typing import Any, LiteralString

import psycopg
import pytest

from cyclone_dsl import LATEST_SCHEMA_VERSION, SCHEMA_VERSION_TABLE, Client, Worker, migrate
from cyclone_dsl.migrate.runner import connect_for_migration, run_migrations
from cyclone_dsl.states import RunState, StepState
from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path
from tests.faults import race_targets
from tests.faults.race_targets import QUORUM, Outcome, Task, serve

RACERS = 8
ROUNDS = 8
MIGRATE_ROUNDS = 5
#: A round must end well within this (the racers wait at most BARRIER_TIMEOUT at the barrier).
ROUND_TIMEOUT = race_targets.BARRIER_TIMEOUT + 30
#: The most the racers of one round may be apart when they leave the barrier (seconds).
MAX_SPREAD = 2.0
ACTIVE = ("pending", "available", "running", "waiting_signal", "waiting_timer", "paused")


class Racers:
    """8 spawned processes; :meth:`race` gives each one task and returns the 8 outcomes."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.barrier = ctx.Barrier(RACERS)
        self.outbox: multiprocessing.Queue[Outcome] = ctx.Queue()
        self.inboxes: list[multiprocessing.Queue[Task | None]] = [
            ctx.Queue() for _ in range(RACERS)
        ]
        self.processes = [
            ctx.Process(
                target=serve,
                args=(i, self.barrier, self.inboxes[i], self.outbox),
                name=f"racer-{i}",
                daemon=True,
            )
            for i in range(RACERS)
        ]
        for process in self.processes:
            process.start()

    def race(self, tasks: Sequence[Task]) -> list[Outcome]:
        assert len(tasks) == RACERS
        for inbox, task in zip(self.inboxes, tasks, strict=True):
            inbox.put(task)
        outcomes: list[Outcome] = []
        try:
            for _ in range(RACERS):
                outcomes.append(self.outbox.get(timeout=ROUND_TIMEOUT))
        except queue.Empty:
            dead = [p.name for p in self.processes if not p.is_alive()]
            raise AssertionError(f"racers did not all answer: {outcomes}; dead: {dead}") from None
        finally:
            if self.barrier.broken:
                self.barrier.reset()
        outcomes.sort(key=lambda o: o.index)
        assert [o.index for o in outcomes] == list(range(RACERS))
        assert len({o.pid for o in outcomes}) == RACERS, "the racers must be 8 distinct processes"
        started = [o.started for o in outcomes if o.ok]
        # They left the barrier together (~20 ms apart here; the bound is loose for busy CI).
        assert not started or max(started) - min(started) < MAX_SPREAD, outcomes
        return outcomes

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for process in self.processes:
            process.join(15)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
        for inbox in self.inboxes:
            inbox.close()
            inbox.join_thread()
        self.outbox.close()
        self.outbox.join_thread()


@pytest.fixture(scope="module")
def racers() -> Iterator[Racers]:
    pool = Racers()
    yield pool
    pool.close()


def no_errors(outcomes: Sequence[Outcome]) -> None:
    failed = [o for o in outcomes if not o.ok]
    assert failed == [], "\n".join(f"racer {o.index}: {o.error}\n{o.detail}" for o in failed)


def rows(dsn: str, query: LiteralString, *params: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query, params).fetchall()


def worker(dsn: str) -> Worker:
    return Worker(dsn, [race_targets], poll_interval=0.2, scan_interval=0.2, grace=5.0)


# -- 1. enqueue with one unique key ----------------------------------------------------


def test_unique_key_enqueue_from_eight_processes(racers: Racers, cyclone_dsn: str) -> None:
    """One active step per (kind, key); every duplicate gets the holder with created=False."""

    def race_once(key: str) -> Outcome:
        outcomes = racers.race(
            [Task("enqueue", cyclone_dsn, key=key, value=i) for i in range(RACERS)]
        )
        no_errors(outcomes)
        assert len({o.run_id for o in outcomes}) == 1
        winners = [o for o in outcomes if o.created]
        assert len(winners) == 1
        winner = winners[0]
        active = rows(
            cyclone_dsn,
            "SELECT run_id, input FROM cyclone_steps"
            " WHERE kind = 'pr_square' AND unique_key = %s AND state = ANY(%s)",
            key,
            list(ACTIVE),
        )
        assert active == [(winner.run_id, winner.index)]
        return winner

    first = {f"k-{r}": race_once(f"k-{r}") for r in range(ROUNDS)}
    # No loser left a run behind (a lost race rolls back its savepoint).
    assert rows(cyclone_dsn, "SELECT count(*) FROM cyclone_runs") == [(ROUNDS,)]

    # Once the holder completed the key is free again: the next race makes exactly one more.
    with Client(cyclone_dsn) as client, worker(cyclone_dsn):
        for winner in first.values():
            assert winner.run_id is not None
            assert client.handle(winner.run_id).result(timeout=15) == winner.index**2
    again = race_once("k-0")
    assert again.run_id != first["k-0"].run_id
    states = rows(
        cyclone_dsn,
        "SELECT run_id, state FROM cyclone_steps WHERE unique_key = 'k-0' ORDER BY id",
    )
    assert states == [(first["k-0"].run_id, "completed"), (again.run_id, "available")]


# -- 2. submit_once with one key -----------------------------------------------------


def test_submit_once_from_eight_processes(racers: Racers, cyclone_dsn: str) -> None:
    """One run per (workflow, key); every caller gets its id, one of them with created=True."""
    for r in range(ROUNDS):
        key = f"order-{r}"
        outcomes = racers.race(
            [Task("submit_once", cyclone_dsn, key=key, value=i) for i in range(RACERS)]
        )
        no_errors(outcomes)
        assert len({o.run_id for o in outcomes}) == 1
        winners = [o for o in outcomes if o.created]
        assert len(winners) == 1
        runs = rows(
            cyclone_dsn,
            "SELECT id, input FROM cyclone_runs WHERE workflow = 'pr_once' AND submit_key = %s",
            key,
        )
        assert runs == [(winners[0].run_id, winners[0].index)]
    assert rows(cyclone_dsn, "SELECT count(*) FROM cyclone_runs") == [(ROUNDS,)]


# -- 3. signals racing into a wait_n quorum -------------------------------------------


def signal_tasks(dsn: str, run_id: int) -> list[Task]:
    return [Task("signal", dsn, key="approve", value=i, run_id=run_id) for i in range(RACERS)]


def test_signals_into_a_waiting_quorum_from_eight_processes(
    racers: Racers, cyclone_dsn: str
) -> None:
    """The waiting node takes exactly QUORUM signals; the rest are not stored (or the run ended).

    A worker runs meanwhile, so the run may move on, and even end, while the
    last senders still queue on the run's row lock.
    """
    race_targets.echo_calls.clear()  # run ids restart in every test's schema
    with Client(cyclone_dsn) as client, worker(cyclone_dsn):
        for r in range(ROUNDS):
            handle = client.submit(race_targets.votes, r)
            assert handle.get().step("approve").state is StepState.WAITING_SIGNAL
            outcomes = racers.race(signal_tasks(cyclone_dsn, handle.id))
            consumed = [o.index for o in outcomes if o.delivery == "consumed"]
            late = [o for o in outcomes if o.delivery != "consumed"]
            assert len(consumed) == QUORUM, outcomes
            for o in late:
                assert o.delivery == "not_stored" or o.error == "AlreadyTerminal", o
            result = handle.result(timeout=15)
            mailbox = client.signals_of(handle.id)
            # Only the consumed signals were stored, and the output is them in arrival order.
            assert [m["payload"] for m in mailbox] == result
            assert sorted(consumed) == sorted(m["payload"] for m in mailbox)
            assert {m["consumed_by"] for m in mailbox} == {"approve"}
            run = handle.get()
            assert run.state is RunState.COMPLETED
            echo = run.step("pr_echo")
            assert (echo.attempt, echo.reclaims) == (0, 0)  # no failure, no reclaim
            assert race_targets.echo_calls.count(handle.id) == 1


def test_signals_into_a_pending_quorum_from_eight_processes(
    racers: Racers, cyclone_dsn: str
) -> None:
    """Before the wait is active, QUORUM signals are buffered and the rest raise MailboxFull."""
    race_targets.echo_calls.clear()
    with Client(cyclone_dsn) as client:
        handles = []
        for r in range(ROUNDS):
            handle = client.submit(race_targets.votes_later, r)
            assert handle.get().step("approve").state is StepState.PENDING
            outcomes = racers.race(signal_tasks(cyclone_dsn, handle.id))
            buffered = [o.index for o in outcomes if o.delivery == "buffered"]
            full = [o for o in outcomes if o.delivery != "buffered"]
            assert len(buffered) == QUORUM, outcomes
            assert {o.error for o in full} == {"MailboxFull"}, full
            mailbox = client.signals_of(handle.id)
            assert sorted(m["payload"] for m in mailbox) == sorted(buffered)
            assert {m["consumed_by"] for m in mailbox} == {None}
            handles.append((handle, [m["payload"] for m in mailbox]))
        with worker(cyclone_dsn):
            for handle, arrived in handles:
                # The wait activates once, takes the buffered quorum in order, and the run ends.
                assert handle.result(timeout=15) == arrived
                assert {m["consumed_by"] for m in client.signals_of(handle.id)} == {"approve"}
                run = handle.get()
                assert run.state is RunState.COMPLETED
                echo = run.step("pr_echo")
                assert (echo.attempt, echo.reclaims) == (0, 0)
                assert race_targets.echo_calls.count(handle.id) == 1


# -- 4. migrate on an empty schema --------------------------------------------------------


def catalog(dsn: str) -> list[tuple[Any, ...]]:
    """The relations and constraints of the DSN's schema, without the schema's name."""
    relations = rows(
        dsn,
        "SELECT c.relname, c.relkind::text FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = current_schema() ORDER BY 1",
    )
    constraints = rows(
        dsn,
        "SELECT t.relname, k.conname, k.contype::text FROM pg_constraint k"
        " JOIN pg_class t ON t.oid = k.conrelid"
        " JOIN pg_namespace n ON n.oid = k.connamespace"
        " WHERE n.nspname = current_schema() ORDER BY 1, 2",
    )
    return relations + constraints


def test_eight_processes_migrate_one_empty_schema(
    racers: Racers, cyclone_admin_dsn: str, cyclone_dsn: str
) -> None:
    """One racer applies every migration, the others find it done; a later migrate is a no-op."""
    reference = catalog(cyclone_dsn)  # a schema migrated by one caller
    for _ in range(MIGRATE_ROUNDS):
        name = create_schema(cyclone_admin_dsn, migrated=False)
        dsn = with_search_path(cyclone_admin_dsn, name)
        try:
            outcomes = racers.race([Task("migrate", dsn) for _ in range(RACERS)])
            no_errors(outcomes)
            assert [o.version for o in outcomes] == [LATEST_SCHEMA_VERSION] * RACERS
            assert sorted(o.applied or 0 for o in outcomes) == [0] * (RACERS - 1) + [
                LATEST_SCHEMA_VERSION
            ]
            assert rows(dsn, f"SELECT version FROM {SCHEMA_VERSION_TABLE}") == [
                (LATEST_SCHEMA_VERSION,)
            ]
            assert catalog(dsn) == reference
            with connect_for_migration(dsn) as conn:
                before_after = run_migrations(conn, target=None, lock_timeout_s=10)
            assert before_after == (LATEST_SCHEMA_VERSION, LATEST_SCHEMA_VERSION)
            assert migrate(dsn) == LATEST_SCHEMA_VERSION
            assert catalog(dsn) == reference
        finally:
            drop_schema(cyclone_admin_dsn, name)
