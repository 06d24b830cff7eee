"""A hypothesis state machine over the gated claim: submits of keyed and rate-limited work,
claims by several workers, completions, failures, crashes (leases expire and are
reclaimed) and limit changes. No claim ever takes a step over a limit: after a claim,
every key it took a step of has at most its limit running, and a rate window never holds
more starts than its limit.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import attrs
import psycopg
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cyclone_dsl import Concurrency, RateLimit, Registry, step
from cyclone_dsl.db.tx import ConnectionTx
from cyclone_dsl.dsl.runs import compile_standalone
from cyclone_dsl.engine import Engine, Failure, Success
from tests.faults.conftest import FULL

KEYS = ["k0", "k1", "k2"]
LEASE = timedelta(seconds=30)
RATE_WINDOW = timedelta(seconds=10)


@step(name="fsm_keyed", concurrency=Concurrency(key="key", limit=2))
def keyed(job: dict[str, str]) -> str:
    return job["key"]


def keyed_with(limit: int) -> Any:
    """The same kind as another deploy would define it, with another limit."""
    return attrs.evolve(keyed, concurrency=Concurrency(key="key", limit=limit))


@step(name="fsm_rated", rate_limit=RateLimit(limit=3, per=RATE_WINDOW, key="key"))
def rated(job: dict[str, str]) -> str:
    return job["key"]


class FlowMachine(RuleBasedStateMachine):
    dsn: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.conn = psycopg.connect(self.dsn, autocommit=True)
        self.shift = timedelta(0)
        self.limit = 2
        self.keyed = keyed_with(self.limit)
        self.engine = Engine()
        self.leases: dict[int, int] = {}  # step id -> the generation held

    def tx(self, work: Any) -> Any:
        with self.conn.transaction():
            return work(ConnectionTx(self.conn, self.shift))

    def teardown(self) -> None:
        self.conn.execute("TRUNCATE cyclone_runs, cyclone_ext_limits, cyclone_ext_slots CASCADE")
        self.conn.close()

    def running_per_key(self, kind: str) -> Counter[str]:
        rows = self.conn.execute(
            "SELECT s.input->>'key' FROM cyclone_steps AS s"
            " WHERE s.kind = %s AND s.state = 'running'",
            (kind,),
        ).fetchall()
        return Counter(key for (key,) in rows)

    @rule(
        key=st.sampled_from(KEYS), kind=st.sampled_from(["keyed", "rated"]), count=st.integers(1, 3)
    )
    def submit(self, key: str, kind: str, count: int) -> None:
        definition = self.keyed if kind == "keyed" else rated
        registry = Registry.from_objects([definition])
        for _ in range(count):
            compiled = compile_standalone(
                registry,
                definition,
                {"key": key},
                queue=None,
                priority=None,
                max_attempts=None,
                timeout=None,
                retention=None,
            )
            self.tx(lambda tx, compiled=compiled: self.engine.submit(tx, compiled))

    @rule(owner=st.sampled_from(["w1", "w2", "w3"]), limit=st.integers(1, 5))
    def claim(self, owner: str, limit: int) -> None:
        before = self.running_per_key("fsm_keyed")
        got = self.tx(
            lambda tx: self.engine.claim(
                tx,
                owner=owner,
                queues=["default"],
                kinds=["fsm_keyed", "fsm_rated"],
                versions=[("fsm_keyed", "standalone"), ("fsm_rated", "standalone")],
                limit=limit,
                lease=LEASE,
                gated=True,
            )
        )
        for claimed in got:
            assert claimed.gated, "a limited step was claimed past its gate"
            self.leases[claimed.id] = claimed.generation
        after = self.running_per_key("fsm_keyed")
        for key, count in after.items():
            if count > before[key]:
                assert count <= self.limit, f"{key}: {count} running, the limit is {self.limit}"

    @rule(data=st.data(), fail=st.booleans())
    def finish(self, data: st.DataObject, fail: bool) -> None:
        if not self.leases:
            return
        step_id = data.draw(st.sampled_from(sorted(self.leases)))
        generation = self.leases.pop(step_id)
        if fail:
            outcome = Failure(step_id, generation, "boom", "error")
            self.tx(lambda tx: self.engine.fail(tx, [outcome]))
        else:
            self.tx(lambda tx: self.engine.complete(tx, [Success(step_id, generation, '"x"')]))

    @rule()
    def crash(self) -> None:
        """The workers die: the database clock passes their leases, the scanner reclaims."""
        self.leases.clear()
        self.shift += LEASE + timedelta(seconds=1)
        self.tx(
            lambda tx: self.engine.reclaim_expired_leases(
                tx, after_id=0, limit=500, max_reclaims={}, default_max_reclaims=100
            )
        )

    @rule(limit=st.integers(1, 4))
    def change_the_limit(self, limit: int) -> None:
        """A deploy with another limit: its next submit records it."""
        self.limit = limit
        self.keyed = keyed_with(limit)
        self.submit("k0", "keyed", 1)

    @invariant()
    def rate_windows_hold(self) -> None:
        rows = self.conn.execute(
            "SELECT input->>'key', started_at FROM cyclone_steps"
            " WHERE kind = 'fsm_rated' AND started_at IS NOT NULL ORDER BY 2"
        ).fetchall()
        starts: dict[str, list[Any]] = {}
        for key, started in rows:
            starts.setdefault(key, []).append(started)
        for key, times in starts.items():
            for index, first in enumerate(times):
                within = [t for t in times[index:] if t < first + RATE_WINDOW]
                assert len(within) <= 3, f"{key}: {len(within)} starts in one window"


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
@pytest.mark.timeout(900 if FULL else 180)
def test_no_claim_passes_a_limit(cyclone_dsn: str) -> None:
    FlowMachine.dsn = cyclone_dsn
    machine = FlowMachine.TestCase
    machine.settings = settings(
        max_examples=200 if FULL else 30, stateful_step_count=30, deadline=None
    )
    machine().runTest()


def test_a_lowered_limit_counts_the_steps_still_running(cyclone_dsn: str) -> None:
    """Found by the machine: with the limit lowered from 2 to 1 while 2 ran, the end of one
    freed slot 1 and a third step started beside the one still holding slot 2."""
    FlowMachine.dsn = cyclone_dsn
    machine = FlowMachine()
    try:
        machine.change_the_limit(1)
        machine.claim("w1", 1)
        machine.change_the_limit(2)
        machine.claim("w1", 1)
        assert len(machine.leases) == 2
        machine.change_the_limit(1)
        first = min(machine.leases)
        machine.tx(
            lambda tx: machine.engine.complete(
                tx, [Success(first, machine.leases.pop(first), '"x"')]
            )
        )
        machine.claim("w1", 1)  # asserts no claim passes the limit
        assert len(machine.leases) == 1
    finally:
        machine.teardown()
