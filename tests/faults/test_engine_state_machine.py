"""A hypothesis state machine over the engine core alone (no worker processes).

Random sequences of submit, claim, complete, fail, lease expiry with a scan,
signal, pause, resume and cancel, on a real schema; after every step:

- every run is terminal only if all its steps are terminal, and a running
  (or paused) run has at least one step that can still move;
- no step is ``running`` without a lease, and lease generations never go down;
- the counts of ``cyclone_v_runs`` agree with the step rows;
- a completion fenced by a stale generation changes nothing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cyclone_dsl import Registry, step, wait_signal, workflow
from cyclone_dsl.db.tx import ConnectionTx
from cyclone_dsl.dsl.runs import child_compiler, compile_workflow
from cyclone_dsl.engine import Engine, Failure, Success
from cyclone_dsl.errors import (
    AlreadyTerminal,
    InvalidTransition,
    MailboxFull,
    SignalNotDeliverable,
)
from cyclone_dsl.worker.serving import serving_of
from tests.faults.conftest import FULL


@step(name="sm_a", max_attempts=2)
def a(x: object) -> object:
    return x


@workflow(name="sm_chain")
def chain(x):  # type: ignore[no-untyped-def]
    return a(a(x))


@workflow(name="sm_join")
def join(x):  # type: ignore[no-untyped-def]
    first = a(x)
    gate = wait_signal("go")
    return a([first, gate])


REGISTRY = Registry.from_objects([chain, join])
ENGINE = Engine(compile_child=child_compiler(REGISTRY))
VERSIONS = serving_of(REGISTRY).versions
LEASE = timedelta(seconds=30)
TERMINAL = {"completed", "discarded", "cancelled"}
MOVABLE = {"available", "running", "waiting_signal", "waiting_timer", "waiting_child", "paused"}


class EngineMachine(RuleBasedStateMachine):
    dsn: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.conn = psycopg.connect(self.dsn, autocommit=True)
        self.shift = timedelta(0)
        self.runs: list[int] = []
        self.leases: dict[int, int] = {}  # step id -> generation we hold
        self.stale: list[tuple[int, int]] = []
        self.generations: dict[int, int] = {}

    def tx(self, work: Any) -> Any:
        with self.conn.transaction():
            return work(ConnectionTx(self.conn, self.shift))

    def teardown(self) -> None:
        self.conn.execute("TRUNCATE cyclone_runs CASCADE")
        self.conn.close()

    @rule(which=st.sampled_from([chain, join]), value=st.integers(0, 9))
    def submit_run(self, which: Any, value: int) -> None:
        compiled = compile_workflow(REGISTRY, which, value)
        self.runs.append(self.tx(lambda tx: ENGINE.submit(tx, compiled)))

    @rule(limit=st.integers(1, 3))
    def claim_some(self, limit: int) -> None:
        got = self.tx(
            lambda tx: ENGINE.claim(
                tx,
                owner="m",
                queues=["default"],
                kinds=["sm_a"],
                versions=VERSIONS,
                limit=limit,
                lease=LEASE,
            )
        )
        for step_row in got:
            if step_row.id in self.leases:
                self.stale.append((step_row.id, self.leases[step_row.id]))
            self.leases[step_row.id] = step_row.generation

    @rule(data=st.data())
    def complete_one(self, data: st.DataObject) -> None:
        if not self.leases:
            return
        step_id = data.draw(st.sampled_from(sorted(self.leases)))
        generation = self.leases.pop(step_id)
        self.tx(lambda tx: ENGINE.complete(tx, [Success(step_id, generation, "1")]))

    @rule(data=st.data())
    def fail_one(self, data: st.DataObject) -> None:
        if not self.leases:
            return
        step_id = data.draw(st.sampled_from(sorted(self.leases)))
        generation = self.leases.pop(step_id)
        self.tx(lambda tx: ENGINE.fail(tx, [Failure(step_id, generation, "boom", "error")]))

    @rule()
    def expire_leases_and_scan(self) -> None:
        self.shift += LEASE + timedelta(seconds=1)
        self.tx(
            lambda tx: ENGINE.reclaim_expired_leases(
                tx, after_id=0, limit=100, max_reclaims={}, default_max_reclaims=2
            )
        )
        self.stale.extend(self.leases.items())
        self.leases.clear()

    @rule()
    def replay_a_stale_completion(self) -> None:
        if not self.stale:
            return
        step_id, generation = self.stale.pop()
        before = self.conn.execute(
            "SELECT state, output, lease_generation FROM cyclone_steps WHERE id = %s", (step_id,)
        ).fetchone()
        applied = self.tx(lambda tx: ENGINE.complete(tx, [Success(step_id, generation, "99")]))
        after = self.conn.execute(
            "SELECT state, output, lease_generation FROM cyclone_steps WHERE id = %s", (step_id,)
        ).fetchone()
        if before is not None and before[2] != generation:
            assert applied == set()
            assert after == before

    @rule(data=st.data(), action=st.sampled_from(["signal", "pause", "resume", "cancel"]))
    def steer(self, data: st.DataObject, action: str) -> None:
        if not self.runs:
            return
        run_id = data.draw(st.sampled_from(self.runs))
        try:
            if action == "signal":
                self.tx(lambda tx: ENGINE.signal(tx, run_id, "go", '"yes"'))
            elif action == "pause":
                self.tx(lambda tx: ENGINE.pause(tx, run_id))
            elif action == "resume":
                self.tx(lambda tx: ENGINE.resume(tx, run_id))
            else:
                self.tx(lambda tx: ENGINE.cancel(tx, run_id))
        except (AlreadyTerminal, InvalidTransition, MailboxFull, SignalNotDeliverable):
            pass

    @invariant()
    def runs_and_steps_agree(self) -> None:
        rows = self.conn.execute(
            "SELECT r.id, r.state, array_agg(s.state) FROM cyclone_runs r "
            "JOIN cyclone_steps s ON s.run_id = r.id GROUP BY r.id, r.state"
        ).fetchall()
        for run_id, state, step_states in rows:
            if state in ("completed", "failed", "cancelled"):
                assert set(step_states) <= TERMINAL, (run_id, state, step_states)
            else:
                pending_only = set(step_states) <= TERMINAL | {"pending"}
                assert (
                    not pending_only
                    or "pending" not in step_states
                    or any(s in MOVABLE for s in step_states)
                ), (run_id, state, step_states)
                assert not set(step_states) <= TERMINAL, (run_id, state, step_states)

    @invariant()
    def leases_and_generations(self) -> None:
        rows = self.conn.execute(
            "SELECT id, state, lease_expiry, lease_generation FROM cyclone_steps"
        ).fetchall()
        for step_id, state, expiry, generation in rows:
            if state == "running":
                assert expiry is not None
            assert generation >= self.generations.get(step_id, 0)
            self.generations[step_id] = generation

    @invariant()
    def view_counts_match_rows(self) -> None:
        mismatches = self.conn.execute(
            "SELECT v.id FROM cyclone_v_runs v WHERE v.steps_total <> "
            "(SELECT count(*) FROM cyclone_steps s WHERE s.run_id = v.id) "
            "OR v.steps_completed <> (SELECT count(*) FROM cyclone_steps s "
            "WHERE s.run_id = v.id AND s.state = 'completed')"
        ).fetchall()
        assert mismatches == []


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
@pytest.mark.timeout(900 if FULL else 120)  # six times the examples at full size
def test_engine_state_machine(cyclone_dsn: str) -> None:
    EngineMachine.dsn = cyclone_dsn
    machine = EngineMachine.TestCase
    examples = 300 if FULL else 50
    machine.settings = settings(max_examples=examples, stateful_step_count=30, deadline=None)
    machine().runTest()
