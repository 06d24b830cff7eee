"""Audit: how a step's failure for good spreads through a workflow, and how a retry heals it.

A differential test: random DAGs of 3-8 steps (edges to earlier nodes only, some as data
inputs and some as ``after=`` ordering only, each node with a random ``on_dep_failure``, a
random subset failing for good with ``max_attempts=1``, sometimes a result node) run on a
worker, and a reference model written from the docs alone predicts the outcome:

- docs/concepts/runs-and-steps.md, "When a step fails for good": a failed node fails the
  run unless it has dependents and *every* direct dependent says ``cancel_branch``; then
  its downstream branch is cancelled and the rest goes on.
- "Retrying failed work": the retried node and every cancelled step run again, less the
  steps that depend on a step that stays discarded; a completed run holding a contained
  failure can be retried from that node.
- docs/workflows.md, "The result": ``RunHandle.result()`` raises ``NoOutput`` without a
  result node, or when a contained failure cut the result node off.

Then every handler is made to succeed and the run is retried from the node that failed it
(and from each contained failure in turn), checking every state, output, the result, and
how many times each handler ran.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cyclone_dsl import (
    Client,
    InvalidTransition,
    NodeRef,
    NoOutput,
    Permanent,
    Ref,
    Run,
    RunFailed,
    RunHandle,
    RunState,
    StepContext,
    StepState,
    Worker,
    define_result,
    step,
    workflow,
)
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]
MOD = 1_000_003
WAIT = 30.0

_lock = threading.Lock()
entries: Counter[tuple[int, str]] = Counter()  # handler executions per (run, node)
healed: set[int] = set()  # runs whose handlers all succeed from now on
names = itertools.count()


def _output(node_id: str, values: tuple[int, ...]) -> int:
    index = int(node_id[1:])
    return ((index + 1) * 7 + 3 * sum(values)) % MOD


@step(name="fpa_node", max_attempts=1)
def fpa_node(plan: dict[str, Any], *values: int, ctx: StepContext) -> int:
    """Fails as ``plan["fail"][node]`` says ("error" or "permanent") until its run is healed."""
    with _lock:
        entries[(ctx.run_id, ctx.node)] += 1
        mode = None if ctx.run_id in healed else plan["fail"].get(ctx.node)
    if mode == "permanent":
        raise Permanent(f"planned permanent failure of {ctx.node}")
    if mode == "error":
        raise RuntimeError(f"planned failure of {ctx.node}")
    return _output(ctx.node, values)


# --------------------------------------------------------------------------- the model


@attrs.frozen
class Node:
    data: tuple[int, ...]  # earlier nodes whose outputs it takes, in order
    after: tuple[int, ...]  # earlier nodes it waits for without their outputs
    on_dep_failure: str
    fail: str | None  # None, "error" or "permanent"

    @property
    def parents(self) -> tuple[int, ...]:
        return self.data + self.after


@attrs.frozen
class Graph:
    nodes: tuple[Node, ...]
    result_mode: str  # "none", "return" or "define"
    result: int

    def ids(self) -> list[str]:
        return [f"n{i}" for i in range(len(self.nodes))]

    def plan(self) -> dict[str, Any]:
        return {"fail": {f"n{i}": n.fail for i, n in enumerate(self.nodes) if n.fail}}

    def dependents(self, index: int) -> list[int]:
        return [j for j, n in enumerate(self.nodes) if index in n.parents]

    def fatal(self, index: int) -> bool:
        """A failure of this node fails the run (the docs' rule)."""
        dependents = self.dependents(index)
        return not dependents or any(self.nodes[j].on_dep_failure == "fail_run" for j in dependents)

    def descendants(self, index: int) -> set[int]:
        out: set[int] = set()
        for j, n in enumerate(self.nodes):
            if index in n.parents or out & set(n.parents):
                out.add(j)
        return out


def outputs(graph: Graph) -> list[int]:
    values: list[int] = []
    for i, n in enumerate(graph.nodes):
        values.append(_output(f"n{i}", tuple(values[d] for d in n.data)))
    return values


def simulate(graph: Graph, failing: set[int]) -> list[str]:
    """Each node's state when the ``failing`` nodes fail and nothing fails the run: a node
    runs once every dependency completed, else its branch is cancelled."""
    states: list[str] = []
    for i, n in enumerate(graph.nodes):
        if any(states[p] != "completed" for p in n.parents):
            states.append("cancelled")
        elif i in failing:
            states.append("discarded")
        else:
            states.append("completed")
    return states


def planned_failures(graph: Graph) -> set[int]:
    return {i for i, n in enumerate(graph.nodes) if n.fail}


def fatal_candidates(graph: Graph) -> set[int]:
    """The nodes that may fail the run: each fails for good once its dependencies have
    completed, and has a dependent that says fail_run (or none at all)."""
    states = simulate(graph, planned_failures(graph))
    return {i for i, s in enumerate(states) if s == "discarded" and graph.fatal(i)}


_STATE = {
    "completed": StepState.COMPLETED,
    "discarded": StepState.DISCARDED,
    "cancelled": StepState.CANCELLED,
}


# ------------------------------------------------------------------------------ helpers


def build(graph: Graph) -> Any:
    def builder(x):  # type: ignore[no-untyped-def]
        refs: list[Any] = []
        for i, n in enumerate(graph.nodes):
            options: dict[str, Any] = {"on_dep_failure": n.on_dep_failure}
            if n.after:
                options["after"] = [refs[a] for a in n.after]
            refs.append(fpa_node.named(f"n{i}")(x, *[refs[d] for d in n.data], **options))
        if graph.result_mode == "define":
            define_result(refs[graph.result])
        if graph.result_mode == "return":
            return refs[graph.result]
        return None

    builder.__name__ = f"fpa_flow_{next(names)}"
    return workflow(builder)


def snapshot(run_id: int, ids: list[str]) -> dict[str, int]:
    with _lock:
        return {node: entries[(run_id, node)] for node in ids}


def states_of(run: Run) -> dict[str, StepState]:
    return {s.node: s.state for s in run.steps}


def expect_result(handle: RunHandle, graph: Graph, states: list[str]) -> None:
    """What ``result()`` gives for a completed run, per docs/workflows.md "The result"."""
    if graph.result_mode == "none" or states[graph.result] != "completed":
        with pytest.raises(NoOutput):
            handle.result(timeout=WAIT)
    else:
        assert handle.result(timeout=WAIT) == outputs(graph)[graph.result]


def check_completed(
    client: Client, handle: RunHandle, graph: Graph, expected: list[str], why: str
) -> None:
    run = handle.wait(timeout=WAIT)
    assert run.state is RunState.COMPLETED, (why, graph, states_of(run))
    values = outputs(graph)
    got = {s.node: s for s in client.get_run(handle.id).steps}
    for i, state in enumerate(expected):
        row = got[f"n{i}"]
        assert row.state is _STATE[state], (why, i, graph, states_of(run))
        if state == "completed":
            assert row.output == values[i], (why, i, graph)
        if state == "discarded":
            assert row.error_kind == graph.nodes[i].fail, (why, i, row.error_kind)
    expect_result(handle, graph, expected)


def heal_contained(
    client: Client,
    handle: RunHandle,
    graph: Graph,
    states: list[str],
    ids: list[str],
    loose: frozenset[str] = frozenset(),
) -> None:
    """Retry each contained failure of a completed run, one at a time: each retry runs
    the node and the branch it cut off that no other discarded node still cuts off.

    ``loose``: nodes whose handler may still start once late, for an execution claimed
    before the run failed and cancelled before the handler began."""
    remaining = {i for i, s in enumerate(states) if s == "discarded"}
    for index in sorted(remaining):
        before = snapshot(handle.id, ids)
        remaining.discard(index)
        client.retry(handle.id, ids[index])
        expected = simulate(graph, remaining)
        check_completed(client, handle, graph, expected, f"after retrying {ids[index]}")
        after = snapshot(handle.id, ids)
        for i, node in enumerate(ids):
            reran = states[i] != "completed" and expected[i] == "completed"
            extra = after[node] - before[node] - int(reran)
            assert extra in ((0, 1) if node in loose else (0,)), (node, graph, before, after)
        states = expected
    assert states == ["completed"] * len(ids)


# ----------------------------------------------------------------------------- property


@st.composite
def graphs(draw: st.DrawFn) -> Graph:
    count = draw(st.integers(3, 8))
    nodes: list[Node] = []
    for i in range(count):
        parents = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        as_data = [draw(st.booleans()) for _ in parents]
        nodes.append(
            Node(
                data=tuple(p for p, d in zip(parents, as_data, strict=True) if d),
                after=tuple(p for p, d in zip(parents, as_data, strict=True) if not d),
                on_dep_failure=draw(st.sampled_from(["fail_run", "cancel_branch"])),
                fail=draw(st.sampled_from([None, None, None, "error", "permanent"])),
            )
        )
    mode = draw(st.sampled_from(["none", "return", "define"]))
    return Graph(tuple(nodes), mode, draw(st.integers(0, count - 1)))


@pytest.fixture(autouse=True)
def _fresh() -> None:
    """Run ids start again in each test's schema."""
    with _lock:
        entries.clear()
        healed.clear()


# The fixture object is kept alive, so that its id is not reused by a later test's.
_started: dict[int, tuple[StartWorker, Worker]] = {}


def _worker_for(start_worker: StartWorker) -> None:
    """One worker per test (hypothesis reuses the function-scoped fixtures)."""
    key = id(start_worker)
    if key not in _started:
        _started[key] = (start_worker, start_worker(fpa_node, concurrency=4))


@settings(max_examples=15, deadline=None)
@given(graph=graphs())
def test_random_failures_propagate_and_heal_as_the_docs_say(
    client: Client, start_worker: StartWorker, graph: Graph
) -> None:
    _worker_for(start_worker)
    ids = graph.ids()
    handle = client.submit(build(graph), graph.plan())
    candidates = fatal_candidates(graph)
    failing = planned_failures(graph)

    if not candidates:  # every failure is contained: the outcome is fully determined
        expected = simulate(graph, failing)
        check_completed(client, handle, graph, expected, "first run")
        counts = snapshot(handle.id, ids)
        for i, node in enumerate(ids):  # a cancelled branch never started
            assert counts[node] == int(expected[i] != "cancelled"), (node, graph, counts)
        with _lock:
            healed.add(handle.id)
        heal_contained(client, handle, graph, expected, ids)
        return

    # Some failure fails the run; which one first depends on timing.
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=WAIT)
    run = client.get_run(handle.id)
    assert run.state is RunState.FAILED
    named = failed.value.node
    assert named is not None
    rows = {s.node: s for s in run.steps}
    values = outputs(graph)
    seen: list[str] = []
    for i, node in enumerate(ids):
        row = rows[node]
        parents_done = all(
            rows[ids[p]].state is StepState.COMPLETED for p in graph.nodes[i].parents
        )
        assert row.state in _STATE.values(), (node, row.state, graph)
        if row.state is StepState.COMPLETED:
            assert parents_done and not graph.nodes[i].fail, (node, graph)
            assert row.output == values[i]
        elif row.state is StepState.DISCARDED:
            assert parents_done and graph.nodes[i].fail, (node, graph)
            assert row.error_kind == graph.nodes[i].fail
        seen.append(row.state.value)
    batch = {i for i, s in enumerate(seen) if s == "discarded" and graph.fatal(i)}
    assert batch <= candidates and batch, (seen, graph)
    assert int(named[1:]) in batch, (named, seen, graph)
    culprit = named
    assert failed.value.error_kind == graph.nodes[int(named[1:])].fail
    # Another fatal failure after the run failed would be cancelled, not discarded.
    contained = {i for i, s in enumerate(seen) if s == "discarded"} - batch

    with _lock:
        healed.add(handle.id)
        before = {node: entries[(handle.id, node)] for node in ids}
    maybe_stale = {  # claimed before the run failed: its handler may still start late
        node
        for node in ids
        if rows[node].state is StepState.CANCELLED and rows[node].started_at is not None
    }
    for node in ids:
        if node in maybe_stale:
            assert before[node] <= 1
        else:
            assert before[node] == int(rows[node].state is not StepState.CANCELLED), node

    client.retry(handle.id, culprit)
    expected = simulate(graph, contained)
    check_completed(client, handle, graph, expected, f"after retrying {culprit}")
    after = snapshot(handle.id, ids)
    for i, node in enumerate(ids):
        reran = seen[i] != "completed" and expected[i] == "completed"
        if node in maybe_stale:
            assert after[node] - before[node] - int(reran) in (0, 1), (node, before, after)
        else:
            assert after[node] - before[node] == int(reran), (node, graph, before, after)
    heal_contained(client, handle, graph, expected, ids, frozenset(maybe_stale))


# ------------------------------------------------------------------------ corner shapes


def _submit(client: Client, start_worker: StartWorker, graph: Graph) -> RunHandle:
    _worker_for(start_worker)
    return client.submit(build(graph), graph.plan())


def _n(
    data: tuple[int, ...] = (),
    after: tuple[int, ...] = (),
    odf: str = "fail_run",
    fail: str | None = None,
) -> Node:
    return Node(data, after, odf, fail)


def test_failed_leaf_fails_the_run_even_if_it_says_cancel_branch(
    client: Client, start_worker: StartWorker
) -> None:
    # n0 -> n1 (cancel_branch, fails, no dependents); n0 -> n2
    graph = Graph((_n(), _n((0,), odf="cancel_branch", fail="error"), _n((0,))), "return", 2)
    handle = _submit(client, start_worker, graph)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=WAIT)
    assert (failed.value.node, failed.value.error_kind) == ("n1", "error")
    run = client.get_run(handle.id)
    assert run.step("n1").state is StepState.DISCARDED
    sibling_done = run.step("n2").state is StepState.COMPLETED  # else cancelled by n1
    with _lock:
        healed.add(handle.id)
    client.retry(handle.id, "n1")
    check_completed(client, handle, graph, ["completed"] * 3, "healed")
    counts = snapshot(handle.id, graph.ids())
    assert (counts["n0"], counts["n1"]) == (1, 2)
    assert counts["n2"] == 1 if sibling_done else counts["n2"] in (1, 2)


def test_dependents_that_disagree_fail_the_run(client: Client, start_worker: StartWorker) -> None:
    # n0 fails; n1 (cancel_branch) and n2 (fail_run) depend on it: not every dependent
    # says cancel_branch, so the run fails and both are cancelled.
    graph = Graph(
        (_n(fail="permanent"), _n((0,), odf="cancel_branch"), _n(after=(0,), odf="fail_run")),
        "define",
        1,
    )
    handle = _submit(client, start_worker, graph)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=WAIT)
    assert (failed.value.node, failed.value.error_kind) == ("n0", "permanent")
    run = client.get_run(handle.id)
    assert run.state is RunState.FAILED
    assert [run.step(n).state for n in ("n0", "n1", "n2")] == [
        StepState.DISCARDED,
        StepState.CANCELLED,
        StepState.CANCELLED,
    ]
    with _lock:
        healed.add(handle.id)
    with pytest.raises(InvalidTransition):  # it depends on n0, which would stay discarded
        client.retry(handle.id, "n1")
    client.retry(handle.id, "n0")
    check_completed(client, handle, graph, ["completed"] * 3, "healed")


def test_diamond_with_one_side_cancelled(client: Client, start_worker: StartWorker) -> None:
    # n0 -> n1 (fails) -> n3 (cancel_branch, join) <- n2 <- n0; n2 -> n4 (fail_run)
    graph = Graph(
        (
            _n(),
            _n((0,), fail="error"),
            _n((0,)),
            _n((1, 2), odf="cancel_branch"),
            _n((2,)),
        ),
        "return",
        3,
    )
    handle = _submit(client, start_worker, graph)
    expected = ["completed", "discarded", "completed", "cancelled", "completed"]
    check_completed(client, handle, graph, expected, "contained")  # result(): NoOutput
    assert client.get_run(handle.id).step("n3").started_at is None
    with _lock:
        healed.add(handle.id)
    heal_contained(client, handle, graph, expected, graph.ids())
    assert handle.result(timeout=WAIT) == outputs(graph)[3]


def test_after_only_edges_carry_failure_like_data_edges(
    client: Client, start_worker: StartWorker
) -> None:
    # n0 fails; n1 waits for it with after= only (cancel_branch) and n2 for n1 (fail_run):
    # the branch below n0 is cancelled down to n2, n3 (independent) completes.
    graph = Graph(
        (
            _n(fail="error"),
            _n(after=(0,), odf="cancel_branch"),
            _n(after=(1,)),
            _n(),
        ),
        "return",
        3,
    )
    handle = _submit(client, start_worker, graph)
    expected = ["discarded", "cancelled", "cancelled", "completed"]
    check_completed(client, handle, graph, expected, "contained")
    with _lock:
        healed.add(handle.id)
    heal_contained(client, handle, graph, expected, graph.ids())


def test_after_only_fail_run_dependent_fails_the_run(
    client: Client, start_worker: StartWorker
) -> None:
    graph = Graph((_n(fail="error"), _n(after=(0,)), _n()), "none", 0)
    handle = _submit(client, start_worker, graph)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=WAIT)
    assert failed.value.node == "n0"
    assert client.get_run(handle.id).step("n1").state is StepState.CANCELLED


def test_node_cut_off_by_a_discarded_node_that_stays_is_not_retried(
    client: Client, start_worker: StartWorker
) -> None:
    # n2 waits for n0 and n1, both contained failures. Retrying n0 leaves n1 discarded,
    # so n2 stays cancelled; a retry of n2 itself is refused (it depends on n1).
    graph = Graph(
        (_n(fail="error"), _n(fail="error"), _n((0, 1), odf="cancel_branch")),
        "return",
        2,
    )
    handle = _submit(client, start_worker, graph)
    expected = ["discarded", "discarded", "cancelled"]
    check_completed(client, handle, graph, expected, "contained")
    with _lock:
        healed.add(handle.id)
    with pytest.raises(InvalidTransition):
        client.retry(handle.id, "n2")
    assert client.get_run(handle.id).state is RunState.COMPLETED
    heal_contained(client, handle, graph, expected, graph.ids())


def test_contained_failure_of_the_result_node_gives_no_output(
    client: Client, start_worker: StartWorker
) -> None:
    # The result node n0 fails; its one dependent says cancel_branch, so the run completes
    # with the result node discarded: its value is not None, it has none.
    graph = Graph((_n(fail="error"), _n((0,), odf="cancel_branch")), "define", 0)
    handle = _submit(client, start_worker, graph)
    check_completed(client, handle, graph, ["discarded", "cancelled"], "contained")


# ------------------------------------------------------------- failures in one batch

gate = threading.Barrier(2)


@step(name="fpa_gated", max_attempts=1)
def fpa_gated(tag: str, *, ctx: StepContext) -> str:
    """Fails, together with the other gated step of its run, until its run is healed."""
    with _lock:
        entries[(ctx.run_id, ctx.node)] += 1
        ok = ctx.run_id in healed
    if ok:
        return f"{ctx.node} {tag}"
    with contextlib.suppress(threading.BrokenBarrierError):
        gate.wait(timeout=5)
    raise RuntimeError(f"planned failure of {ctx.node}")


@step(name="fpa_tail", max_attempts=1)
def fpa_tail(*, ctx: StepContext) -> str:
    with _lock:
        entries[(ctx.run_id, ctx.node)] += 1
    return ctx.node


@workflow
def fpa_contained_and_fatal(tag: Ref[str]) -> None:
    a = fpa_gated.named("a")(tag)
    fpa_tail.named("b")(after=[a], on_dep_failure="cancel_branch")  # contains a's failure
    fpa_gated.named("c")(tag)  # no dependents: its failure fails the run


@workflow
def fpa_two_fatal(tag: Ref[str]) -> NodeRef[str]:
    a = fpa_gated.named("a")(tag)
    fpa_tail.named("b")(after=[a])  # fail_run
    return fpa_gated.named("c")(tag)


def test_run_failed_names_the_node_that_failed_the_run(
    client: Client, start_worker: StartWorker
) -> None:
    # a and c fail at the same moment; a's failure is contained by b (cancel_branch), c's
    # fails the run. RunFailed.node is "the step whose failure failed the run ... A failure
    # the run contained earlier is not its cause": c, whichever batch a landed in.
    start_worker(fpa_gated, fpa_tail, concurrency=2)
    for _ in range(20):
        gate.reset()
        handle = client.submit(fpa_contained_and_fatal, "x")
        with pytest.raises(RunFailed) as failed:
            handle.result(timeout=WAIT)
        assert (failed.value.node, failed.value.error_kind) == ("c", "error"), client.get_run(
            handle.id
        ).steps
        with _lock:
            healed.add(handle.id)
        client.retry(handle.id, failed.value.node)  # the docs' recipe
        assert handle.wait(timeout=WAIT).state is RunState.COMPLETED


def test_retrying_one_node_of_a_failing_batch_retries_both(
    client: Client, start_worker: StartWorker
) -> None:
    # a and c both fail the run, at the same moment (one batch, or c cancelled while it
    # ran): one retry of the node RunFailed names runs both again and the run completes.
    start_worker(fpa_gated, fpa_tail, concurrency=2)
    for _ in range(3):
        gate.reset()
        handle = client.submit(fpa_two_fatal, "x")
        with pytest.raises(RunFailed) as failed:
            handle.result(timeout=WAIT)
        assert failed.value.node in ("a", "c")
        run = client.get_run(handle.id)
        assert run.step("b").state is StepState.CANCELLED
        with _lock:
            healed.add(handle.id)
        client.retry(handle.id, failed.value.node)
        assert handle.result(timeout=WAIT) == "c x"
        run = client.get_run(handle.id)
        assert {s.node: s.state for s in run.steps} == dict.fromkeys("abc", StepState.COMPLETED)
        assert snapshot(handle.id, ["a", "b", "c"]) == {"a": 2, "b": 1, "c": 2}


release = threading.Event()


@step(name="fpa_held", max_attempts=1)
def fpa_held(tag: str, *, ctx: StepContext) -> str:
    """Holds its run open until the test releases it."""
    with _lock:
        entries[(ctx.run_id, ctx.node)] += 1
    release.wait(timeout=WAIT)
    return f"{ctx.node} {tag}"


@workflow
def fpa_contained_while_running(tag: Ref[str]) -> NodeRef[str]:
    a = fpa_gated.named("a")(tag)
    b = fpa_tail.named("b")(after=[a], on_dep_failure="cancel_branch")
    held = fpa_held.named("h")(tag)
    return fpa_tail.named("d")(after=[b, held], on_dep_failure="cancel_branch")


def test_retry_of_a_contained_failure_while_the_run_still_runs(
    client: Client, start_worker: StartWorker
) -> None:
    # a fails (contained: b and, through b, d are cancelled) while h still holds the run
    # open. Retrying a in the running run runs a, b and d again; the run then completes
    # with d's output as its result, not NoOutput.
    start_worker(fpa_gated, fpa_tail, fpa_held, concurrency=4)
    gate.reset()
    release.clear()
    handle = client.submit(fpa_contained_while_running, "x")
    try:
        gate.wait(timeout=WAIT)  # a is running (the test is the barrier's other party)
        wait_until(
            lambda: client.get_run(handle.id).step("d").state is StepState.CANCELLED,
            timeout=WAIT,
            what="a's branch cancelled",
        )
        run = client.get_run(handle.id)
        assert run.state is RunState.RUNNING
        assert run.step("a").state is StepState.DISCARDED
        assert run.step("h").state is StepState.RUNNING
        with _lock:
            healed.add(handle.id)
        client.retry(handle.id, "a")
    finally:
        release.set()
    assert handle.result(timeout=WAIT) == "d"
    run = client.get_run(handle.id)
    assert {s.node: s.state for s in run.steps} == dict.fromkeys("abdh", StepState.COMPLETED)
    assert snapshot(handle.id, ["a", "b", "d", "h"]) == {"a": 2, "b": 1, "d": 1, "h": 1}


@workflow
def fpa_contained_then_fatal(tag: Ref[str]) -> None:
    a = fpa_gated.named("a")(tag)
    fpa_tail.named("b")(after=[a], on_dep_failure="cancel_branch")  # contains a's failure
    held = fpa_held.named("h")(tag)
    fpa_gated.named("c")(tag, after=[held])  # no dependents: fails the run


def test_retry_of_a_contained_failure_in_a_failed_run_is_refused(
    client: Client, start_worker: StartWorker
) -> None:
    # a fails first (contained by b); later c fails the run. Retrying a alone would leave
    # c discarded: refused ("a node that failed the run would stay discarded"), and so is
    # a retry of the completed h. Retrying c completes the run with a still discarded;
    # then retrying a completes everything.
    start_worker(fpa_gated, fpa_tail, fpa_held, concurrency=4)
    gate.reset()
    release.clear()
    handle = client.submit(fpa_contained_then_fatal, "x")
    try:
        gate.wait(timeout=WAIT)  # a is running (the test is the barrier's other party)
        wait_until(
            lambda: client.get_run(handle.id).step("b").state is StepState.CANCELLED,
            timeout=WAIT,
            what="a's branch cancelled",
        )
    finally:
        release.set()
    gate.wait(timeout=WAIT)  # c is running
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=WAIT)
    assert (failed.value.node, failed.value.error_kind) == ("c", "error")
    with _lock:
        healed.add(handle.id)
    for node in ("a", "b", "h"):
        with pytest.raises(InvalidTransition):
            client.retry(handle.id, node)
    run = client.get_run(handle.id)
    assert run.state is RunState.FAILED
    assert [run.step(n).state for n in "abch"] == [
        StepState.DISCARDED,
        StepState.CANCELLED,
        StepState.DISCARDED,
        StepState.COMPLETED,
    ]
    client.retry(handle.id, "c")
    run = handle.wait(timeout=WAIT)
    assert run.state is RunState.COMPLETED
    assert [run.step(n).state for n in "abch"] == [
        StepState.DISCARDED,
        StepState.CANCELLED,
        StepState.COMPLETED,
        StepState.COMPLETED,
    ]
    client.retry(handle.id, "a")
    run = handle.wait(timeout=WAIT)
    assert {s.node: s.state for s in run.steps} == dict.fromkeys("abch", StepState.COMPLETED)
    assert snapshot(handle.id, list("abch")) == {"a": 2, "b": 1, "c": 2, "h": 1}
