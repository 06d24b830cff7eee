"""Property: an accepted operator retry never strands a run, and a healed run completes.

Random small workflows (chains, joins, ``cancel_branch``, fan-outs, a child run,
signal waits with and without a timeout) run on the engine core directly, one
transaction per operation, the way tests/faults/test_engine_state_machine.py
drives it: claims, batches of completions and failures (each step fails or not
at random), signals, time passing (signal timeouts), and retries of random
nodes (accepted or refused). Checked:

- a refused retry changes nothing (every run, step and signal row reads back
  the same);
- after every operation, every run is *live*: an open run has a step that is
  available, running, waiting for a signal or a timer, or waiting for an open
  child run; no pending step has a discarded or cancelled dependency, nor only
  completed ones (it would have been activated); no pending fan-out has all its
  items terminal, nor pending items with none available or running; no child
  node waits for a child run that has ended; a terminal run has only terminal
  steps;
- a completed run holds no discarded step that is not contained (a step is
  contained when it has dependents and all of them are ``cancel_branch``);
- once every handler succeeds and every wait gets its signal, retrying the node
  that failed the run (while there is one) makes the run complete.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import defaultdict
from datetime import timedelta
from typing import Any, LiteralString

import psycopg
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from psycopg.rows import dict_row

from cyclone_dsl.db.tx import ConnectionTx
from cyclone_dsl.engine import Engine, Failure, Success
from cyclone_dsl.errors import (
    AlreadyTerminal,
    InvalidTransition,
    MailboxFull,
    SignalNotDeliverable,
)
from cyclone_dsl.graph.compile import compile_run
from cyclone_dsl.graph.model import (
    Arg,
    ArgKind,
    Binding,
    ChildSpec,
    FanOutSpec,
    Graph,
    Node,
    NodeOptions,
    WaitSpec,
)
from cyclone_dsl.graph.rows import KIND_CHILD, KIND_SIGNAL, CompiledRun
from cyclone_dsl.payload import JSONValue

KIND = "rp_k"
LEASE = timedelta(seconds=30)
OPEN_RUN = {"running", "paused"}
TERMINAL = {"completed", "discarded", "cancelled"}
FAILED = {"discarded", "cancelled"}
LIVE = {"available", "running", "waiting_signal", "waiting_timer"}

CHILD_GRAPH = Graph(
    "rp_child",
    (
        Node("c0", KIND, Binding.NONE, (), options=NodeOptions(max_attempts=1)),
        Node(
            "c1",
            KIND,
            Binding.SINGLE,
            (Arg(ArgKind.REF, ref="c0"),),
            options=NodeOptions(max_attempts=1, on_dep_failure="cancel_branch"),
        ),
        Node("c2", KIND_SIGNAL, Binding.NONE, (), wait=WaitSpec(signal_name="cs")),
    ),
    result="c2",
)


@st.composite
def workflows(draw: st.DrawFn) -> Graph:
    """A small random graph: steps, joins, fan-outs, signal waits and at most one child."""
    count = draw(st.integers(1, 6))
    nodes: list[Node] = []
    has_child = False
    no_list = set()  # nodes whose output is not a list: a fan-out cannot run over them
    for index in range(count):
        earlier = [n.id for n in nodes]
        node_id = f"n{index}"
        shapes = ["step", "step", "join", "fan_out", "signal"] + ([] if has_child else ["child"])
        shape = draw(st.sampled_from(shapes))
        refs = sorted(set(draw(st.lists(st.sampled_from(earlier), max_size=3)))) if earlier else []
        policy = draw(st.sampled_from(["fail_run", "cancel_branch"])) if refs else "fail_run"
        options = NodeOptions(max_attempts=draw(st.integers(1, 2)), on_dep_failure=policy)
        if shape == "join" and len(refs) >= 2:
            args = tuple(Arg(ArgKind.REF, ref=r) for r in refs)
            nodes.append(Node(node_id, KIND, Binding.ARRAY, args, (), options))
        elif shape == "fan_out":
            refs = [r for r in refs if r not in no_list]
            source = (
                (Binding.SINGLE, (Arg(ArgKind.REF, ref=refs[0]),))
                if refs
                else (Binding.STATIC, (Arg(ArgKind.STATIC, value=[1, 2, 3]),))
            )
            spec = FanOutSpec(max_parallel=draw(st.integers(0, 2)), max_bytes=0)
            nodes.append(Node(node_id, KIND, *source, tuple(refs[1:]), options, fan_out=spec))
        elif shape == "signal":
            timeout = draw(st.sampled_from([None, timedelta(seconds=5)]))
            wait = WaitSpec(signal_name=f"s{index}", duration=timeout)
            nodes.append(
                Node(node_id, KIND_SIGNAL, Binding.NONE, (), tuple(refs), options, wait=wait)
            )
        elif shape == "child":
            has_child = True
            args = (Arg(ArgKind.REF, ref=refs[0]),) if refs else ()
            binding = Binding.SINGLE if refs else Binding.NONE
            spec_child = ChildSpec(workflow="rp_child", needs_result=draw(st.booleans()))
            if not spec_child.needs_result:
                no_list.add(node_id)
            nodes.append(
                Node(node_id, KIND_CHILD, binding, args, tuple(refs[1:]), options, child=spec_child)
            )
        elif refs:
            args = (Arg(ArgKind.REF, ref=refs[0]),)
            nodes.append(Node(node_id, KIND, Binding.SINGLE, args, tuple(refs[1:]), options))
        else:
            nodes.append(Node(node_id, KIND, Binding.NONE, (), (), options))
    return Graph("rp_root", tuple(nodes), nodes[-1].id)


def compile_child(workflow: str, run_input: JSONValue, parent: tuple[str, str]) -> CompiledRun:
    assert workflow == "rp_child"
    return compile_run(CHILD_GRAPH, run_input)


ENGINE = Engine(compile_child=compile_child)


class Driver:
    """One example: a run of ``graph`` driven operation by operation."""

    def __init__(self, conn: psycopg.Connection[Any], graph: Graph, data: st.DataObject) -> None:
        self.conn = conn
        self.data = data
        self.shift = timedelta(0)
        self.compiled = compile_run(graph, "in")
        self.versions = [
            (self.compiled.workflow, self.compiled.def_version),
            ("rp_child", compile_run(CHILD_GRAPH, None).def_version),
        ]
        self.signal_names = sorted(
            n.wait.signal_name for n in graph.nodes if n.wait is not None and n.wait.signal_name
        )
        self.root = self.tx(lambda tx: ENGINE.submit(tx, self.compiled))
        self.accepted = 0
        self.refused = 0

    def tx(self, work: Any) -> Any:
        with self.conn.transaction():
            return work(ConnectionTx(self.conn, self.shift))

    def read(self, query: LiteralString, *params: object) -> list[dict[str, Any]]:
        with self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(query, params)
            return cur.fetchall()

    # -- operations ----------------------------------------------------------------------

    def work(self, *, failures: bool) -> int:
        """Claim what is available; complete some in one batch, fail the others (at random)."""
        options: dict[str, Any] = {
            "owner": "prop",
            "queues": ["default"],
            "kinds": [KIND],
            "limit": 100,
            "lease": LEASE,
        }
        options["versions"] = self.versions
        got = self.tx(lambda tx: ENGINE.claim(tx, **options))
        done: list[Success] = []
        failed: list[Failure] = []
        for item in sorted(got, key=lambda claimed: claimed.id):  # draws in a fixed order
            if failures and self.data.draw(st.integers(0, 2), label=f"fail {item.node}") == 0:
                retry = self.data.draw(st.integers(0, 3), label="retryable") == 0
                failed.append(Failure(item.id, item.generation, "boom", "error", retry=retry))
            else:
                done.append(Success(item.id, item.generation, json.dumps([1, 2])))
        self.tx(lambda tx: ENGINE.complete(tx, done))
        self.tx(lambda tx: ENGINE.fail(tx, failed))  # one batch, as a worker sends
        return len(got)

    def signal(self, run_id: int, name: str) -> None:
        with contextlib.suppress(AlreadyTerminal, MailboxFull, SignalNotDeliverable):
            self.tx(lambda tx: ENGINE.signal(tx, run_id, name, json.dumps([1, 2])))

    def time_passes(self) -> None:
        self.shift += timedelta(seconds=6)
        self.tx(lambda tx: ENGINE.time_out_signal_waits(tx, after_id=0, limit=100))

    def retry(self, run_id: int, node: str) -> bool:
        before = self.snapshot()
        try:
            self.tx(lambda tx: ENGINE.retry(tx, run_id, node))
        except InvalidTransition as exc:
            assert self.snapshot() == before, f"a refused retry of {node!r} wrote something"
            event("refused: " + re.sub(r"'[^']*'|\d+", "X", str(exc))[:70])
            self.refused += 1
            return False
        self.accepted += 1
        # Which kinds of retry the examples reach (``pytest --hypothesis-show-statistics``).
        kind, item_of, fan_out = next(
            (s["kind"], s["item_of"], s["fan_out_parallel"])
            for s in self.steps(run_id)
            if s["node"] == node
        )
        what = "an item" if item_of else "a fan-out" if fan_out is not None else kind
        event(f"accepted: {what}{' in a child run' if run_id != self.root else ''}")
        return True

    # -- reading -------------------------------------------------------------------------

    def snapshot(self) -> tuple[object, ...]:
        return (
            self.read("SELECT * FROM cyclone_runs ORDER BY id"),
            self.read("SELECT * FROM cyclone_steps ORDER BY id"),
            self.read("SELECT * FROM cyclone_signals ORDER BY id"),
        )

    def runs(self) -> list[dict[str, Any]]:
        return self.read("SELECT id, state, parent_run_id, parent_node_id FROM cyclone_runs")

    def steps(self, run_id: int) -> list[dict[str, Any]]:
        return self.read(
            "SELECT node, kind, state, on_dep_failure, item_of, fan_out_parallel, signal_name "
            "FROM cyclone_steps WHERE run_id = %s ORDER BY id",
            run_id,
        )

    def deps(self, run_id: int) -> list[tuple[str, str]]:
        rows = self.read("SELECT node, dep_node FROM cyclone_deps WHERE run_id = %s", run_id)
        return [(r["node"], r["dep_node"]) for r in rows]

    def uncontained(self, run_id: int) -> list[str]:
        """The discarded graph nodes of a run that did not only cancel their branch."""
        steps = {s["node"]: s for s in self.steps(run_id) if s["item_of"] is None}
        dependents: dict[str, list[str]] = defaultdict(list)
        for node, dep in self.deps(run_id):
            dependents[dep].append(node)
        return [
            n
            for n, s in steps.items()
            if s["state"] == "discarded"
            and not (
                dependents[n]
                and all(steps[d]["on_dep_failure"] == "cancel_branch" for d in dependents[n])
            )
        ]

    # -- the invariants ------------------------------------------------------------------

    def check(self, after: str) -> None:
        runs = {r["id"]: r for r in self.runs()}
        child_of = {(r["parent_run_id"], r["parent_node_id"]): r for r in runs.values()}
        for run_id, run in runs.items():
            steps = self.steps(run_id)
            states = [(s["node"], s["state"]) for s in steps]
            where = f"after {after}: run {run_id} ({run['state']}) {states}"
            by_node = {s["node"]: s for s in steps}
            deps: dict[str, list[str]] = defaultdict(list)
            for node, dep in self.deps(run_id):
                deps[node].append(dep)
            if run["state"] not in OPEN_RUN:
                assert all(s["state"] in TERMINAL for s in steps), where
                if run["state"] == "completed":
                    assert self.uncontained(run_id) == [], where
                continue
            live = any(s["state"] in LIVE for s in steps) or any(
                s["state"] == "waiting_child"
                and runs[child_of[(run_id, s["node"])]["id"]]["state"] in OPEN_RUN
                for s in steps
                if (run_id, s["node"]) in child_of
            )
            assert live, f"nothing can move: {where}"
            for s in steps:
                if s["item_of"] is not None:
                    continue
                items = [i for i in steps if i["item_of"] == s["node"]]
                upstream = [by_node[d]["state"] for d in deps[s["node"]]]
                if s["state"] == "pending" and not items:
                    assert not FAILED & set(upstream), f"{s['node']} waits on a failure: {where}"
                    assert set(upstream) - {"completed"}, f"{s['node']} never activated: {where}"
                if s["state"] == "pending" and items:
                    states = {i["state"] for i in items}
                    assert not states <= TERMINAL, f"fan-out {s['node']} never ends: {where}"
                    if "pending" in states:
                        assert states & {"available", "running"}, f"{s['node']} stuck: {where}"
                if s["state"] == "waiting_child":
                    below = child_of.get((run_id, s["node"]))
                    assert below is not None and below["state"] in OPEN_RUN, where

    # -- the example ---------------------------------------------------------------------

    def random_retry(self) -> None:
        """Retry a random node: mostly a failed one (of any run), sometimes any node."""
        every = [(r["id"], s["node"], s["state"]) for r in self.runs() for s in self.steps(r["id"])]
        failed = [(run_id, node) for run_id, node, state in every if state in FAILED]
        if failed and self.data.draw(st.integers(0, 3), label="any node") > 0:
            run_id, node = self.data.draw(st.sampled_from(failed), label="retry")
        else:
            pairs = [(run_id, node) for run_id, node, _ in every]
            run_id, node = self.data.draw(st.sampled_from(pairs), label="retry")
        if self.retry(run_id, node):
            self.check(f"retry of {node!r} in run {run_id}")

    def heal(self) -> None:
        """Every handler succeeds and every wait is signalled; retry what failed the run."""
        for _ in range(60):
            while self.work(failures=False):
                pass
            for run in self.runs():
                for s in self.steps(run["id"]):
                    if s["state"] == "waiting_signal" and s["signal_name"]:
                        self.signal(run["id"], s["signal_name"])
            root = next(r for r in self.runs() if r["id"] == self.root)
            if root["state"] == "completed":
                return
            if root["state"] in OPEN_RUN:
                continue
            steps = self.steps(self.root)
            failed = self.uncontained(self.root) or [
                s["node"] for s in steps if s["state"] == "cancelled" and s["item_of"] is None
            ]
            assert failed, f"run {self.root} {root['state']} with nothing to retry: {steps}"
            assert self.retry(self.root, failed[0]), f"retry of {failed[0]!r} refused"
            self.check(f"healing retry of {failed[0]!r}")
        raise AssertionError(f"run {self.root} did not complete: {self.steps(self.root)}")


ROUNDS = st.lists(st.sampled_from(["work", "signal", "time", "idle"]), min_size=1, max_size=6)


@given(graph=workflows(), rounds=ROUNDS, data=st.data())
@settings(
    max_examples=25,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_retries_never_strand_a_run(
    cyclone_dsn: str, graph: Graph, rounds: list[str], data: st.DataObject
) -> None:
    """Rounds of: work (random failures), then a signal, time passing or nothing, then a
    retry (mostly of a failed node). Then heal: everything succeeds, the run completes."""
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE cyclone_runs CASCADE")
        driver = Driver(conn, graph, data)
        driver.check("submit")
        for extra in rounds:
            driver.work(failures=True)
            driver.check("work")
            if extra == "work":
                driver.work(failures=True)
            elif extra == "signal":
                targets = [(driver.root, name) for name in driver.signal_names] + [
                    (r["id"], "cs") for r in driver.runs() if r["id"] != driver.root
                ]
                if targets:
                    run_id, name = data.draw(st.sampled_from(targets), label="signal")
                    driver.signal(run_id, name)
            elif extra == "time":
                driver.time_passes()
            driver.check(extra)
            driver.random_retry()
            driver.check("retry")
        event(f"retries in the random phase: {driver.accepted} accepted, {driver.refused} refused")
        driver.heal()
        driver.check("heal")
        event(f"retries to heal: {driver.accepted}")


def _engine_run(conn: psycopg.Connection[Any], graph: Graph) -> tuple[int, dict[str, Any]]:
    """Submit ``graph`` and claim its available steps; return the run and the claims by node."""
    compiled = compile_run(graph, "in")
    with conn.transaction():
        run_id = ENGINE.submit(ConnectionTx(conn), compiled)
    options: dict[str, Any] = {
        "owner": "prop",
        "queues": ["default"],
        "kinds": [KIND],
        "limit": 100,
        "lease": LEASE,
    }
    options["versions"] = [(compiled.workflow, compiled.def_version)]
    with conn.transaction():
        got = ENGINE.claim(ConnectionTx(conn), **options)
    return run_id, {c.node: c for c in got}


def _state(conn: psycopg.Connection[Any], run_id: int) -> tuple[str, dict[str, str]]:
    run = conn.execute("SELECT state FROM cyclone_runs WHERE id = %s", (run_id,)).fetchone()
    steps = conn.execute("SELECT node, state FROM cyclone_steps WHERE run_id = %s", (run_id,))
    assert run is not None
    return run[0], dict(steps.fetchall())


LEAF = NodeOptions(max_attempts=1)


def test_a_retry_of_one_of_two_nodes_that_failed_the_run_together_retries_both(
    cyclone_dsn: str,
) -> None:
    """Two failures in one batch fail the run together; each would refuse a retry of the
    other, so retrying either one runs both again."""
    graph = Graph(
        "rp_pair",
        (
            Node("a", KIND, Binding.NONE, (), options=LEAF),
            Node("b", KIND, Binding.NONE, (), options=LEAF),
        ),
        "b",
    )
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        run_id, claims = _engine_run(conn, graph)
        failures = [
            Failure(claims[n].id, claims[n].generation, "boom", "error", retry=False)
            for n in ("a", "b")
        ]
        with conn.transaction():
            ENGINE.fail(ConnectionTx(conn), failures)
        assert _state(conn, run_id) == ("failed", {"a": "discarded", "b": "discarded"})
        with conn.transaction():
            ENGINE.retry(ConnectionTx(conn), run_id, "a")
        assert _state(conn, run_id) == ("running", {"a": "available", "b": "available"})


def test_a_batch_with_a_contained_and_an_uncontained_failure_fails_the_run(
    cyclone_dsn: str,
) -> None:
    """Before: containment was judged over the whole batch: a contained failure and a
    failing leaf of one run, discarded together, only cancelled a branch, and the run
    completed without its result node."""
    branch = NodeOptions(on_dep_failure="cancel_branch")
    graph = Graph(
        "rp_mixed",
        (
            Node("a", KIND, Binding.NONE, (), options=LEAF),
            Node("a_next", KIND, Binding.SINGLE, (Arg(ArgKind.REF, ref="a"),), options=branch),
            Node("leaf", KIND, Binding.NONE, (), options=LEAF),
        ),
        "leaf",
    )
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        run_id, claims = _engine_run(conn, graph)
        failures = [
            Failure(claims[n].id, claims[n].generation, "boom", "error", retry=False)
            for n in ("a", "leaf")
        ]
        with conn.transaction():
            ENGINE.fail(ConnectionTx(conn), failures)
        assert _state(conn, run_id)[0] == "failed"


def test_a_failed_leaf_and_failed_items_in_one_batch_fail_the_run(cyclone_dsn: str) -> None:
    """Found by the property above. Before: the items' failure was judged first, their
    fan-out's failure was contained (cancel_branch) and completed the run, and the failing
    leaf of the same batch no longer could fail it: completed without its result."""
    branch = NodeOptions(on_dep_failure="cancel_branch")
    graph = Graph(
        "rp_items_and_leaf",
        (
            Node(
                "f",
                KIND,
                Binding.STATIC,
                (Arg(ArgKind.STATIC, value=[1, 2]),),
                options=LEAF,
                fan_out=FanOutSpec(),
            ),
            Node("f_next", KIND, Binding.SINGLE, (Arg(ArgKind.REF, ref="f"),), options=branch),
            Node("leaf", KIND, Binding.NONE, (), options=LEAF),
        ),
        "leaf",
    )
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        run_id, claims = _engine_run(conn, graph)
        failures = [
            Failure(claims[n].id, claims[n].generation, "boom", "error", retry=False)
            for n in ("f[0]", "f[1]", "leaf")
        ]
        with conn.transaction():
            ENGINE.fail(ConnectionTx(conn), failures)
        state, steps = _state(conn, run_id)
    assert state == "failed"
    assert steps["leaf"] == "discarded"
