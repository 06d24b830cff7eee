"""Audit: big runs as a production user builds them, through the public API. A chain of
1,000 steps built in a loop, a diamond of one step feeding 1,000 joined by one step with
1,000 dependencies, for_each over 10,000-15,000 items (failing items, max_parallel, a
collected output of several MB), for_each over 1,000 child runs, child runs nested 50
levels deep, a run with 300 signal waits. Each is checked for its result, for the
operations on it while it is big (cancel, pause, resume, retry, retry_many, replay,
fork), for how it is shown (``client.get_run``, ``cyclone run`` in text and JSON, the
dashboard's pages and JSON API) and for being purged completely (``client.purge``,
``cyclone purge``, the retention scanner).

No test asserts a duration; the sizes keep the file under 30 s. Costs measured while
writing it (2 shared cores; reported, not asserted):

- the dashboard's run page grows with the square of the nodes shown: a chain of 500 /
  1,000 / 2,000 nodes took 0.57 / 1.5 / 5.8 s (0.7 / 1.4 / 2.8 MB), 250 / 500 / 1,000 /
  2,000 signal waits 0.27 / 0.48 / 1.7 / 6.2 s, and the drill-down into a fan-out's items
  (``?items=``) 0.5 / 1.9 / 6.7 / 25.7 s for 500 / 1,000 / 2,000 / 4,000 items (run.html
  selects each row's items from every step of the run);
- ``cyclone run`` draws a chain as a tree indented 3 columns per level: 390 KB of text for
  500 nodes, and a RecursionError from 1,000 (a test below);
- starting child runs costs about 2 ms each (a for_each over 2,000 waiting child runs:
  submit 4.0 s, resume 2.7 s, an operator retry of the node 7.4 s), linear."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from starlette.testclient import TestClient

from cyclone_dsl import (
    Client,
    InvalidGraph,
    InvalidTransition,
    NodeRef,
    Ref,
    RunFilter,
    RunState,
    StepState,
    Worker,
    WorkflowDef,
    child,
    for_each,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.cli.render import MAX_DEPTH
from cyclone_dsl.dsl.registry import default_registry
from cyclone_dsl.dsl.workflow import MAX_CHILD_DEPTH
from cyclone_dsl.ui.app import create_app
from tests.cli.runner import in_process
from tests.waiting import scanner_passes, wait_until

# Sizes kept for the suite's time budget; the explorer's first runs passed with a run of
# 1,000 steps, 1,000 parallel steps, 10,000 and 15,000 items, 1,000 child runs, 300
# waits and 300 open child runs.
CHAIN = 1_000  # drawn, paused and cancelled: no worker runs it
RUN_CHAIN = 300
WIDE = 500
ITEMS = 3_000
ROOT_ITEMS = 5_000
KIDS = 300
DEPTH = 50
WAITS = 80
OPEN_KIDS = 150

CALLS: Counter[tuple[str, int]] = Counter()
FAILING: set[int] = set()
_lock = threading.Lock()

Clock = Callable[[timedelta], None]


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    CALLS.clear()
    FAILING.clear()
    yield
    FAILING.clear()


def count(tag: str, i: int) -> None:
    with _lock:
        CALLS[(tag, i)] += 1


def calls(tag: str) -> Counter[int]:
    with _lock:
        return Counter({i: n for (t, i), n in CALLS.items() if t == tag})


# -- handlers ------------------------------------------------------------------------------


@step(name="brn_inc", max_attempts=1)
def brn_inc(x: int) -> int:
    return x + 1


@step(name="brn_sum", max_attempts=1)
def brn_sum(values: list[int]) -> int:
    return sum(values)


@step(name="brn_len", max_attempts=1)
def brn_len(values: list[Any]) -> int:
    return len(values)


def padded(i: int) -> str:
    return f"{i:06d}" + "p" * 294  # 302 bytes as JSON: 3,000 of them are 0.9 MB


@step(name="brn_pad", max_attempts=1)
def brn_pad(i: int) -> str:
    count("pad", i)
    if i in FAILING:
        raise RuntimeError(f"item {i} fails")
    return padded(i)


@step(name="brn_twice", max_attempts=1)
def brn_twice(i: int) -> int:
    count("twice", i)
    if i in FAILING:
        raise RuntimeError(f"item {i} fails")
    return 2 * i


# -- workflows -----------------------------------------------------------------------------


@workflow(name="brn_chain")
def brn_chain(x: Ref[int]) -> NodeRef[int]:
    ref = brn_inc(x)
    for _ in range(CHAIN - 1):
        ref = brn_inc(ref)
    return ref


@workflow(name="brn_run_chain")
def brn_run_chain(x: Ref[int]) -> NodeRef[int]:
    ref = brn_inc(x)
    for _ in range(RUN_CHAIN - 1):
        ref = brn_inc(ref)
    return ref


@workflow(name="brn_diamond")
def brn_diamond(x: Ref[int]) -> NodeRef[int]:
    top = brn_inc(x, node_id="brn_top")
    return brn_sum([brn_inc(top, node_id=f"brn_mid{i}") for i in range(WIDE)], node_id="brn_join")


@workflow(name="brn_fan_pad")
def brn_fan_pad(items: Ref[list[int]]) -> NodeRef[list[str]]:
    collected = for_each(brn_pad, over=items)
    brn_len(collected)
    return collected


@workflow(name="brn_fan_window")
def brn_fan_window(items: Ref[list[int]]) -> NodeRef[int]:
    return brn_sum(for_each(brn_twice, over=items, max_parallel=50))


@workflow(name="brn_fan_root")
def brn_fan_root(items: Ref[list[int]]) -> NodeRef[list[int]]:
    return for_each(brn_inc, over=items)


@workflow(name="brn_kid")
def brn_kid(x: Ref[int]) -> NodeRef[int]:
    return brn_twice(x)


@workflow(name="brn_kids")
def brn_kids(items: Ref[list[int]]) -> NodeRef[int]:
    return brn_sum(for_each(brn_kid, over=items, max_parallel=50))


@workflow(name="brn_kids_open")
def brn_kids_open(items: Ref[list[int]]) -> NodeRef[int]:
    return brn_sum(for_each(brn_kid, over=items))


@workflow(name="brn_waits")
def brn_waits() -> NodeRef[int]:
    return brn_sum([wait_signal(f"brn_s{i}") for i in range(WAITS)])


def _nest(depth: int, tag: str) -> list[WorkflowDef]:
    """Workflows brn_<tag>_0 .. brn_<tag>_<depth-1>: level 0 waits for signal brn_leaf
    and adds one to its payload; level i runs level i-1 as a child run and adds one."""
    levels: list[WorkflowDef] = []
    for i in range(depth):
        inner = levels[-1] if levels else None

        def body(x: Ref[int], inner: WorkflowDef | None = inner) -> NodeRef[int]:
            if inner is None:
                return brn_inc(wait_signal("brn_leaf"))
            return brn_inc(child(inner, x))

        levels.append(workflow(name=f"brn_{tag}_{i}")(body))
    return levels


NEST = _nest(DEPTH, "nest")


# -- helpers -------------------------------------------------------------------------------


def leftovers(dsn: str) -> dict[str, int]:
    """Rows left in every table of the schema that has a run_id or step_id column."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT DISTINCT table_name FROM information_schema.columns"
                " WHERE table_schema = current_schema() AND column_name IN ('run_id', 'step_id')"
                " AND table_name IN (SELECT table_name FROM information_schema.tables"
                "  WHERE table_schema = current_schema() AND table_type = 'BASE TABLE')"
            )
        ]
        found: dict[str, int] = {}
        for table in [*tables, "cyclone_runs"]:
            row = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()
            assert row is not None
            if row[0]:
                found[table] = int(row[0])
        return found


def states(steps: Any) -> dict[str, int]:
    return dict(Counter(s.state.value for s in steps))


def kid_states(client: Client, run_id: int) -> dict[str, int]:
    return dict(
        Counter(r.state.value for r in client.list_runs(parent_run_id=run_id, limit=10_000))
    )


# -- a chain of 1,000 steps ------------------------------------------------------------------


def shown_steps(shown: dict[str, Any]) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = shown["steps"]
    return steps


def test_brn_cyclone_run_shows_a_chain_of_1000_nodes_in_text_and_json(
    client: Client, cyclone_dsn: str
) -> None:
    """A chain built in a loop (a pipeline of 1,000 transformations) is accepted: the
    CLI must show it, as it shows any run (docs/reference/cli.md: every node, as a tree;
    --json each step), not stop with an unexpected error."""
    assert len(brn_chain.graph.nodes) == CHAIN
    handle = client.submit(brn_chain, 0)
    cli = in_process(cyclone_dsn)
    as_json = cli("run", str(handle.id), "--json")
    assert as_json.returncode == 0, as_json.stderr
    shown = json.loads(as_json.stdout)
    assert len(shown["steps"]) == CHAIN
    text = cli("run", str(handle.id))
    assert text.returncode == 0, text.stderr
    assert text.stdout.count("brn_inc") == CHAIN
    # In chain order, and no staircase as wide as the chain is long (a 500-node chain
    # printed 388 KB): the tree stops indenting at MAX_DEPTH levels.
    nodes = [line.split("─ ", 1)[1].split()[1] for line in text.stdout.splitlines()[1:]]
    assert nodes == [s["node"] for s in sorted(shown_steps(shown), key=lambda s: s["id"])]
    assert max(len(line) for line in text.stdout.splitlines()) < 3 * MAX_DEPTH + 200


def test_brn_a_chain_of_300_steps_runs_in_order_is_shown_and_purged_whole(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(brn_inc, concurrency=4)
    handle = client.submit(brn_run_chain, 7)
    assert handle.result(timeout=120) == 7 + RUN_CHAIN
    run = client.get_run(handle.id)
    outputs = [s.output for s in sorted(run.steps, key=lambda s: s.id)]
    assert outputs == list(range(8, 8 + RUN_CHAIN))
    assert states(run.steps) == {"completed": RUN_CHAIN}
    with TestClient(create_app(client)) as web:
        api = web.get(f"/api/runs/{handle.id}")
        assert api.status_code == 200
        assert len(api.json()["steps"]) == RUN_CHAIN
    assert client.purge() == 1
    assert leftovers(cyclone_dsn) == {}


def test_brn_a_chain_of_1000_pending_steps_pauses_resumes_cancels_and_purges(
    client: Client, cyclone_dsn: str
) -> None:
    handle = client.submit(brn_chain, 0)  # no worker: the first step stays available
    client.pause(handle.id)
    run = client.get_run(handle.id)
    assert run.state is RunState.PAUSED
    assert states(run.steps) == {"paused": CHAIN}
    client.resume(handle.id)
    run = client.get_run(handle.id)
    assert run.state is RunState.RUNNING
    assert states(run.steps) == {"available": 1, "pending": CHAIN - 1}
    client.cancel(handle.id)
    run = client.get_run(handle.id)
    assert run.state is RunState.CANCELLED
    assert states(run.steps) == {"cancelled": CHAIN}
    assert client.purge() == 1
    assert leftovers(cyclone_dsn) == {}


# -- a diamond: one step, 1,000 parallel steps, one join -----------------------------------


def test_brn_a_diamond_of_500_runs_replays_forks_is_shown_and_purged(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(brn_inc, brn_sum, concurrency=16, batch_size=200)
    handle = client.submit(brn_diamond, 0)
    assert handle.result(timeout=60) == 2 * WIDE
    deps = client.dependencies(handle.id)
    assert sorted(deps["brn_join"]) == sorted(f"brn_mid{i}" for i in range(WIDE))

    # replay from the top: every node runs again, each keeps its replayed completion
    client.retry(handle.id, "brn_top", force=True)
    assert handle.result(timeout=60) == 2 * WIDE
    run = client.get_run(handle.id)
    assert run.state is RunState.COMPLETED
    assert states(run.steps) == {"completed": WIDE + 2}
    assert {s.node for s in run.steps if [a.outcome for a in s.attempts] == ["replayed"]} == {
        s.node for s in run.steps
    }

    # a fork from one middle node with another input copies the 1,000 others
    fork = client.fork(handle.id, "brn_mid7", input=5)
    assert fork.result(timeout=60) == 2 * WIDE  # the copied top keeps its output, 1
    forked = client.get_run(fork.id)
    assert forked.forked_from == handle.id
    assert sum(1 for s in forked.steps if s.copied) == WIDE
    assert {s.node for s in forked.steps if not s.copied} == {"brn_mid7", "brn_join"}

    cli = in_process(cyclone_dsn)
    text = cli("run", str(handle.id))
    assert text.returncode == 0, text.stderr
    assert text.stdout.count("✔") == WIDE + 2
    with TestClient(create_app(client)) as web:
        page = web.get(f"/runs/{handle.id}")
        assert page.status_code == 200
        assert page.text.count('class="node" data-node="brn_mid') == WIDE
    assert client.purge() == 2
    assert leftovers(cyclone_dsn) == {}


# -- for_each over 10,000 items --------------------------------------------------------------


def test_brn_for_each_of_3000_with_failing_items_retries_into_a_1mb_output_in_order(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    FAILING.update(range(999, ITEMS, 1_000))
    start_worker(brn_pad, brn_len, concurrency=16, batch_size=200)
    handle = client.submit(brn_fan_pad, list(range(ITEMS)))
    failed = handle.wait(timeout=120)
    assert failed.state is RunState.FAILED
    fan = failed.step("brn_pad")
    assert fan.state is StepState.DISCARDED
    items = [s for s in failed.steps if s.item_of == "brn_pad"]
    assert len(items) == ITEMS
    assert {s.item_index for s in items if s.state is StepState.DISCARDED} <= FAILING
    assert failed.step("brn_len").state is StepState.CANCELLED
    unfinished = {s.item_index for s in items if s.state is not StepState.COMPLETED}

    FAILING.clear()
    client.retry(handle.id, "brn_pad[999]")  # an item stands for its fan-out node
    expected = [padded(i) for i in range(ITEMS)]
    assert handle.result(timeout=120) == expected
    run = client.get_run(handle.id)
    assert run.step("brn_len").output == ITEMS
    assert states(s for s in run.steps if s.item_of == "brn_pad") == {"completed": ITEMS}
    ran = calls("pad")
    assert set(ran) == set(range(ITEMS))
    # an item that completed the first time is never run again by the retry
    assert {i for i, n in ran.items() if n > 1} <= unfinished

    cli = in_process(cyclone_dsn)
    text = cli("run", str(handle.id))
    assert text.returncode == 0, text.stderr
    # docs/reference/cli.md: a fan-out of more than 10 items is one line of counts
    assert f"brn_pad[0..{ITEMS - 1}]  {ITEMS} items: {ITEMS} completed" in text.stdout
    assert len(text.stdout.splitlines()) < 10
    with TestClient(create_app(client)) as web:
        page = web.get(f"/runs/{handle.id}")
        assert page.status_code == 200
        # items collapsed into a counter (docs/ui.md); the timeline draws the first 100
        assert f"{ITEMS}/{ITEMS} items" in page.text
        assert 'id="node-brn_pad[5000]"' not in page.text
        assert len(page.text) < 900_000  # less than the collected output itself
        download = web.get(f"/runs/{handle.id}/steps/brn_pad/output.json")
        assert download.json() == expected
    assert client.purge() == 1
    assert leftovers(cyclone_dsn) == {}


def test_brn_for_each_with_max_parallel_paused_and_resumed_runs_each_item_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    n = 2_000
    start_worker(brn_twice, brn_sum, concurrency=16, batch_size=100)
    handle = client.submit(brn_fan_window, list(range(n)))
    wait_until(lambda: len(calls("twice")) >= 300, what="300 items ran", timeout=60)
    window = client.get_run(handle.id)
    # docs: at most max_parallel items are available or running at a time
    assert (
        sum(
            1
            for s in window.steps
            if s.item_of == "brn_twice" and s.state in (StepState.AVAILABLE, StepState.RUNNING)
        )
        <= 50
    )
    client.pause(handle.id)
    paused = client.get_run(handle.id)
    assert paused.state is RunState.PAUSED
    open_items = {
        s.state
        for s in paused.steps
        if s.item_of == "brn_twice" and s.state is not StepState.COMPLETED
    }
    assert open_items <= {StepState.PAUSED, StepState.RUNNING}
    client.resume(handle.id)
    assert handle.result(timeout=60) == n * (n - 1)
    ran = calls("twice")
    assert set(ran) == set(range(n))
    assert max(ran.values()) == 1


def test_brn_for_each_of_5000_root_items_pauses_resumes_cancels_and_cli_purges(
    client: Client, cyclone_dsn: str, clock: Clock
) -> None:
    handle = client.submit(brn_fan_root, list(range(ROOT_ITEMS)))
    run = client.get_run(handle.id)
    assert states(s for s in run.steps if s.item_of == "brn_inc") == {"available": ROOT_ITEMS}
    client.pause(handle.id)
    run = client.get_run(handle.id)
    assert states(run.steps) == {"paused": ROOT_ITEMS + 1}
    client.resume(handle.id)
    run = client.get_run(handle.id)
    assert states(s for s in run.steps if s.item_of == "brn_inc") == {"available": ROOT_ITEMS}
    client.cancel(handle.id)
    run = client.get_run(handle.id)
    assert run.state is RunState.CANCELLED
    assert states(run.steps) == {"cancelled": ROOT_ITEMS + 1}
    cli = in_process(cyclone_dsn)
    text = cli("run", str(handle.id))
    assert text.returncode == 0, text.stderr
    assert f"{ROOT_ITEMS} items: {ROOT_ITEMS} cancelled" in text.stdout
    assert len(text.stdout) < 1_000
    clock(timedelta(hours=2))
    dry = cli("purge", "--older-than", "1h", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert leftovers(cyclone_dsn).get("cyclone_steps") == ROOT_ITEMS + 1
    purged = cli("purge", "--older-than", "1h", "--yes", "--json")
    assert purged.returncode == 0, purged.stderr
    assert leftovers(cyclone_dsn) == {}


def test_brn_the_dashboard_drills_down_into_every_item_of_a_500_item_fan_out(
    client: Client,
) -> None:
    n = 500
    handle = client.submit(brn_fan_root, list(range(n)))
    with TestClient(create_app(client)) as web:
        page = web.get(f"/runs/{handle.id}?items=brn_inc")
        assert page.status_code == 200
        for i in (0, n // 2, n - 1):
            assert f'id="node-brn_inc[{i}]"' in page.text
        assert page.text.count('<tr id="node-brn_inc[') == n
        collapsed = web.get(f"/runs/{handle.id}")
        assert f"(0/{n} items)" in collapsed.text
        assert collapsed.text.count('<tr id="node-brn_inc[') == 0


# -- for_each over 1,000 child runs -------------------------------------------------------------


def test_brn_for_each_over_300_child_runs_fails_then_retry_many_completes_and_purge_takes_all(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add(20)
    start_worker(brn_twice, brn_sum, brn_kid, brn_kids, concurrency=16, batch_size=200)
    handle = client.submit(brn_kids, list(range(KIDS)))
    failed = handle.wait(timeout=120)
    assert failed.state is RunState.FAILED
    kids = kid_states(client, handle.id)
    assert kids.get("failed") == 1
    assert set(kids) <= {"completed", "failed", "cancelled"}
    started = sum(kids.values())
    unfinished = {
        r.input
        for r in client.list_runs(parent_run_id=handle.id, limit=10_000)
        if r.state is not RunState.COMPLETED
    }
    assert started < KIDS  # no further item started after the failure
    with pytest.raises(InvalidTransition):
        client.retry(handle.id, "brn_kid", force=True)  # a replay cannot restart child runs

    FAILING.clear()
    result = client.retry_many(RunFilter(workflows="brn_kids"))
    assert (result.matched, result.acted, result.skipped) == (1, 1, 0)
    assert handle.result(timeout=120) == KIDS * (KIDS - 1)
    assert kid_states(client, handle.id) == {"completed": KIDS}  # one child run per item, ever
    ran = calls("twice")
    assert set(ran) == set(range(KIDS))
    # a child run that completed is never run again by the retry
    assert {i for i, n in ran.items() if n > 1} <= unfinished
    assert client.purge() == KIDS + 1
    assert leftovers(cyclone_dsn) == {}


def test_brn_cancelling_a_for_each_over_150_child_runs_cancels_the_open_ones_and_starts_no_more(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(brn_twice, brn_sum, brn_kid, brn_kids, concurrency=16, batch_size=200)
    handle = client.submit(brn_kids, list(range(KIDS // 2)))
    wait_until(lambda: len(calls("twice")) >= KIDS // 4, what="child runs ran", timeout=60)
    client.cancel(handle.id)
    after_cancel = kid_states(client, handle.id)
    assert set(after_cancel) <= {"completed", "cancelled"}
    assert client.get_run(handle.id).state is RunState.CANCELLED
    assert states(client.get_run(handle.id).steps).get("running", 0) == 0
    ran = len(calls("twice"))
    assert client.stats()["queues"] == []
    scanner_passes(worker)  # time for a stray child run or item to start, if any would
    assert kid_states(client, handle.id) == after_cancel
    assert len(calls("twice")) == ran
    assert client.purge() == sum(after_cancel.values()) + 1
    assert leftovers(cyclone_dsn) == {}


def test_brn_150_open_child_runs_pause_resume_fail_their_parent_and_retry_in_place(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(brn_kids_open, list(range(OPEN_KIDS)))  # no worker yet
    kids = client.list_runs(parent_run_id=handle.id, limit=10_000)
    ids = sorted(k.id for k in kids)
    assert len(ids) == OPEN_KIDS
    client.pause(handle.id)
    assert kid_states(client, handle.id) == {"paused": OPEN_KIDS}
    client.resume(handle.id)
    assert kid_states(client, handle.id) == {"running": OPEN_KIDS}

    client.cancel(ids[17])  # cancelling a child run fails its parent node, and only that
    failed = client.get_run(handle.id)
    assert failed.state is RunState.FAILED
    assert failed.step("brn_kid").state is StepState.DISCARDED
    assert kid_states(client, handle.id) == {"cancelled": OPEN_KIDS}

    client.retry(handle.id, "brn_kid")  # each child run retried in place
    assert sorted(k.id for k in client.list_runs(parent_run_id=handle.id, limit=10_000)) == ids
    assert kid_states(client, handle.id) == {"running": OPEN_KIDS}
    start_worker(brn_twice, brn_sum, brn_kid, brn_kids_open, concurrency=16, batch_size=200)
    assert handle.result(timeout=60) == OPEN_KIDS * (OPEN_KIDS - 1)
    assert sorted(k.id for k in client.list_runs(parent_run_id=handle.id, limit=10_000)) == ids
    assert max(calls("twice").values()) == 1
    assert client.purge() == OPEN_KIDS + 1
    assert leftovers(cyclone_dsn) == {}


# -- child runs nested 50 levels deep ----------------------------------------------------------


def _descendants(client: Client, top: int) -> list[int]:
    chain: list[int] = []
    parent = top
    while True:
        kids = client.list_runs(parent_run_id=parent)
        if not kids:
            return chain
        assert len(kids) == 1
        parent = kids[0].id
        chain.append(parent)


def test_brn_children_nested_50_deep_pause_resume_complete_and_the_retention_scanner_takes_all(
    client: Client, cyclone_dsn: str, clock: Clock, start_worker: Callable[..., Worker]
) -> None:
    top = client.submit(NEST[-1], 0)
    below = _descendants(client, top.id)
    assert len(below) == DEPTH - 1
    client.pause(top.id)
    assert {r.state for r in client.list_runs(limit=100)} == {RunState.PAUSED}
    client.resume(top.id)
    assert {r.state for r in client.list_runs(limit=100)} == {RunState.RUNNING}
    other = client.submit(NEST[-1], 0)
    client.cancel(other.id)
    assert Counter(r.state for r in client.list_runs(limit=1_000)) == {
        RunState.RUNNING: DEPTH,
        RunState.CANCELLED: DEPTH,
    }

    start_worker(brn_inc, *NEST, concurrency=4, retention=timedelta(hours=1))
    client.signal(below[-1], "brn_leaf", 100)
    assert top.result(timeout=60) == 100 + DEPTH  # the leaf adds one, each level above too
    text = in_process(cyclone_dsn)("run", str(top.id))
    assert text.returncode == 0, text.stderr
    assert f"→ child run {below[0]}" in text.stdout
    clock(timedelta(hours=2))
    wait_until(lambda: client.list_runs(limit=1_000) == [], what="every run purged", timeout=30)
    assert leftovers(cyclone_dsn) == {}


def test_brn_children_nested_as_deep_as_allowed_are_accepted(client: Client) -> None:
    levels = _nest(MAX_CHILD_DEPTH, "deepest")
    handle = client.submit(levels[-1], 0)
    assert client.get_run(handle.id).state == RunState.RUNNING


@pytest.mark.parametrize("depth", [MAX_CHILD_DEPTH + 1, 250])
def test_brn_children_nested_deeper_are_refused_with_a_typed_error(
    depth: int, client: Client
) -> None:
    """docs/guarantees.md: bad input is refused with a typed error and nothing is written.
    Child workflows nest up to MAX_CHILD_DEPTH levels (workflows.md); deeper is refused
    with InvalidGraph. At 250 levels the build raised a raw RecursionError."""
    levels = _nest(depth, f"deep{depth}")
    try:
        with pytest.raises(InvalidGraph, match=f"nested deeper than {MAX_CHILD_DEPTH} levels"):
            client.submit(levels[-1], 0)
        # Kept: the next look (a worker's start looks at every workflow of the process)
        # raises it again without building the levels below once more.
        with pytest.raises(InvalidGraph, match="nested deeper"):
            _ = levels[-1].graph
        assert client.list_runs() == []
    finally:
        # Later tests of this process start workers, which look at every workflow.
        for level in levels:
            default_registry().workflows.pop(level.name, None)


# -- a run with 300 signal waits ------------------------------------------------------------------


def test_brn_a_run_with_80_signal_waits_takes_every_signal_once_and_is_shown(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(brn_waits)
    run = client.get_run(handle.id)
    assert states(run.steps) == {"waiting_signal": WAITS, "pending": 1}
    start_worker(brn_sum)
    for i in range(WAITS):
        client.signal(handle.id, f"brn_s{i}", i)
    assert handle.result(timeout=60) == WAITS * (WAITS - 1) // 2
    signals = client.signals_of(handle.id)
    assert len(signals) == WAITS
    assert all(row["consumed_at"] is not None for row in signals)
    text = in_process(cyclone_dsn)("run", str(handle.id))
    assert text.returncode == 0, text.stderr
    with TestClient(create_app(client)) as web:
        assert web.get(f"/runs/{handle.id}").status_code == 200
        assert len(web.get(f"/api/runs/{handle.id}").json()["steps"]) == WAITS + 1
    assert client.purge() == 1
    assert leftovers(cyclone_dsn) == {}
