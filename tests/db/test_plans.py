"""The hot path's statements look rows up by key: none scans cyclone_runs or cyclone_steps.

The schema is freshly loaded and never analyzed, which is when the planner's
guesses are worst (right after a burst of submits) and when a join with
``unnest()`` or an anti-join used to turn into a scan of every run or step. Both
the plan for these parameters (custom) and the plan psycopg's prepared
statements end up with (generic) are checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, LiteralString

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from cyclone_dsl import Client, Concurrency, RateLimit, step, wait_signal, workflow
from cyclone_dsl.dsl.gating import fair_key
from cyclone_dsl.sql import Q

#: The tables that grow with every run. (Small joins against cyclone_deps and
#: cyclone_step_inputs may be hashed when the planner finds that cheaper; those plans
#: turn into index probes as the tables grow, which the cost-growth benchmark measures.)
BIG_TABLES = ("cyclone_runs", "cyclone_steps")
#: Statements that must not scan a smaller table either (each ran once per completion).
ALSO = {
    "activate_dependents": ("cyclone_deps",),
    # A rate limit has a slot per unit of its window (20,000 here): the claim reads the
    # shares it needs through their key, never every slot of every limit.
    "claim_gated_steps_rated": ("cyclone_ext_slots",),
    # Runs under a workflow limit wake the steps queued on their slots as they end.
    "finish_runs": ("cyclone_ext_gates",),
    "end_runs": ("cyclone_ext_gates",),
    "queues_waiting_for_run_slots": ("cyclone_ext_gates",),
    # A limited step's end (every completion batch of them) wakes its key's waiters.
    "queues_waiting_for_step_slots": ("cyclone_ext_gates",),
    "gated_queues": ("cyclone_ext_gates",),
    "gate_window_end": ("cyclone_ext_gates",),
}
#: Plan nodes a statement must not use: the gated claim looks steps up by primary key, never
#: by walking every available step of the queue for each gated one; the main claim probes
#: the gates per row, never as an anti-join, which reads every available step before the
#: LIMIT can stop it.
AVOID = {
    "claim_gated_steps": ("idx_steps_claim",),
    "claim_gated_steps_of_keys": ("idx_steps_claim",),
    "claim_steps": ("Anti Join",),
}


@step(name="plan_noop")
def noop(x: object) -> object:
    return x


@step(name="plan_keyed", concurrency=Concurrency(key="k", limit=5))
def keyed(x: object) -> object:
    return x


@step(name="plan_rated", rate_limit=RateLimit(limit=20_000, per=timedelta(seconds=1)))
def rated(x: object) -> object:
    return x


@workflow(name="plan_run_limited", concurrency=Concurrency(key="k", limit=2))
def run_limited(x):  # type: ignore[no-untyped-def]
    return noop.named("only")(x)


@workflow(name="plan_chain")
def chain(x):  # type: ignore[no-untyped-def]
    return noop.named("c")(noop.named("b")(noop.named("a")(x)))


def gated_claim(kind: str) -> dict[str, object]:
    """The parameters of a gated claim of 100 standalone steps of ``kind``."""
    return {
        "owner": "w",
        "queue": "default",
        "kinds": [kind],
        "workflows": [kind],
        "versions": ["standalone"],
        "limit": 100,
        "lease": timedelta(seconds=30),
        "after_key": "",
        "max_keys": 100,
        "capped": False,
        "only_keys": None,
    }


def limited_runs(conn: psycopg.Connection[Any]) -> list[int]:
    """100 runs under the workflow limit (as a completion batch of them would end)."""
    rows = conn.execute(
        "SELECT id FROM cyclone_runs WHERE workflow = 'plan_run_limited' ORDER BY id LIMIT 100"
    ).fetchall()
    return [r["id"] for r in rows]


def keyed_steps(conn: psycopg.Connection[Any]) -> list[int]:
    """100 steps under a step limit (as a completion batch of them would end)."""
    rows = conn.execute(
        "SELECT id FROM cyclone_steps WHERE kind = 'plan_keyed' ORDER BY id LIMIT 100"
    ).fetchall()
    return [r["id"] for r in rows]


def hot_queries(conn: psycopg.Connection[Any]) -> dict[str, tuple[str, dict[str, object]]]:
    """Each hot statement with parameters taken from the loaded rows (100 of each)."""
    steps = conn.execute(
        "SELECT id, run_id, node, lease_generation FROM cyclone_steps"
        " WHERE state = 'available' ORDER BY id LIMIT 100"
    ).fetchall()
    ids = [r["id"] for r in steps]
    runs = sorted({r["run_id"] for r in steps})
    generations = [r["lease_generation"] for r in steps]
    lease = timedelta(seconds=30)
    return {
        "claim_steps": (
            Q.claim_steps,
            {
                "owner": "w",
                "queue": "default",
                "kinds": ["plan_noop"],
                "workflows": ["plan_noop", "plan_chain"],
                "versions": ["standalone", chain.def_version],
                "limit": 100,
                "lease": lease,
            },
        ),
        "lock_runs_of_steps": (Q.lock_runs_of_steps, {"ids": ids}),
        "lock_runs": (Q.lock_runs, {"run_ids": runs}),
        "complete_steps": (
            Q.complete_steps,
            {"ids": ids, "generations": generations, "outputs": ["1"] * len(ids)},
        ),
        "finish_runs": (Q.finish_runs, {"run_ids": runs}),
        "end_runs": (Q.end_runs, {"run_ids": runs, "state": "cancelled"}),
        "heartbeat_steps": (
            Q.heartbeat_steps,
            {"ids": ids, "generations": generations, "lease": lease},
        ),
        "release_steps": (Q.release_steps, {"ids": ids, "generations": generations}),
        "assemble_inputs": (Q.assemble_inputs, {"ids": ids}),
        "activate_dependents": (
            Q.activate_dependents,
            {"run_ids": [r["run_id"] for r in steps], "nodes": [r["node"] for r in steps]},
        ),
        "activate_ready": (
            Q.activate_ready,
            {"run_ids": [r["run_id"] for r in steps], "nodes": ["b"] * len(steps)},
        ),
        "claim_capped_steps": (
            Q.claim_capped_steps,
            {
                "owner": "w",
                "queue": "default",
                "kinds": ["plan_noop"],
                "workflows": ["plan_noop"],
                "versions": ["standalone"],
                "limit": 100,
                "lease": lease,
            },
        ),
        "claim_gated_steps": (Q.claim_gated_steps, gated_claim("plan_keyed")),
        "gate_window_end": (
            Q.gate_window_end,
            {"queue": "default", "after_key": "k5", "max_keys": 16, "origin": "k5"},
        ),
        "queues_waiting_for_run_slots": (
            Q.queues_waiting_for_run_slots,
            {"run_ids": limited_runs(conn)},
        ),
        "claim_gated_steps_rated": (Q.claim_gated_steps, gated_claim("plan_rated")),
        # A claim again of the keys that gave all it looked at (claim._refill).
        "claim_gated_steps_of_keys": (
            Q.claim_gated_steps,
            {**gated_claim("plan_keyed"), "only_keys": [fair_key(("step:plan_keyed", "k5"))]},
        ),
        "queues_waiting_for_step_slots": (
            Q.queues_waiting_for_step_slots,
            {"ids": keyed_steps(conn)},
        ),
        "gated_queues": (Q.gated_queues, {}),
        # Scanner passes: each runs every second on the pass's leader.
        "scan_probe": (
            Q.scan_probe,
            {"grace": timedelta(seconds=5), "retention_every": timedelta(minutes=1)},
        ),
        "expired_leases": (
            Q.expired_leases,
            {"after_id": 0, "limit": 500, "grace": timedelta(seconds=5)},
        ),
        "due_waits_in_order": (Q.due_waits_in_order, {"run_ids": runs}),
        "wake_due_steps": (Q.wake_due_steps, {}),
        # Every operation on a run (a signal, a pause, a cancel...) walks its tree first.
        "run_tree": (Q.run_tree, {"run_id": runs[0]}),
        "due_in_tree": (Q.due_in_tree, {"run_id": runs[0]}),
        "timed_out_steps": (
            Q.timed_out_steps,
            {"after_id": 0, "limit": 500, "grace": timedelta(seconds=5)},
        ),
        "due_timers": (Q.due_timers, {"after_id": 0, "limit": 500}),
        "expired_signal_waits": (Q.expired_signal_waits, {"after_id": 0, "limit": 500}),
        "expired_deadlines": (Q.expired_deadlines, {"after_id": 0, "limit": 500}),
        "ended_children_of_waiting_nodes": (
            Q.ended_children_of_waiting_nodes,
            {"after_id": 0, "limit": 500},
        ),
        # Handlers' events (one, and a batch), and what a client's watcher reads for its
        # waits and its event followers.
        "record_event": (
            Q.record_event,
            {
                "step_id": ids[0],
                "generation": generations[0],
                "attempt": 1,
                "kind": "event",
                "payload": "1",
                "decided": False,
                "cap": 10_000,
            },
        ),
        "record_events": (
            Q.record_events,
            {
                "step_ids": ids,
                "generations": generations,
                "attempts": [1] * len(ids),
                "kinds": ["event"] * len(ids),
                "payloads": ["1"] * len(ids),
                "decided": [False] * len(ids),
                "cap": 10_000,
            },
        ),
        "get_run_states": (Q.get_run_states, {"run_ids": runs}),
        "followed_events": (
            Q.followed_events,
            {"run_ids": runs, "afters": [0] * len(runs), "limit": 500},
        ),
    }


@contextmanager
def filled_schema(admin: str, fill: Callable[[Client], None], *, analyzed: bool) -> Iterator[str]:
    """A schema of its own, filled by ``fill`` (and analyzed); dropped afterwards."""
    from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path

    name = create_schema(admin)
    try:
        dsn = with_search_path(admin, name)
        if not analyzed:  # kept without statistics: autovacuum would analyze it mid-module
            each_table(dsn, "ALTER TABLE {} SET (autovacuum_enabled = off)")
        with Client(dsn) as client:
            fill(client)
        if analyzed:
            analyze(dsn)
        yield dsn
    finally:
        drop_schema(admin, name)


def fill_large(client: Client) -> None:
    for start in range(0, 30_000, 5_000):
        client.enqueue_many(noop, list(range(start, start + 5_000)))
    for start in range(0, 6_000, 2_000):
        client.submit_many(chain, list(range(start, start + 2_000)))
    client.enqueue_many(keyed, [{"k": f"k{i % 20}"} for i in range(5_000)])
    client.enqueue_many(rated, list(range(1_000)))
    client.submit_many(run_limited, [{"k": f"k{i % 20}"} for i in range(2_000)])


def fill_each_kind(
    client: Client, *, noops: int, chains: int, keyed_: int, rated_: int, limited: int
) -> None:
    """Runs of each kind of work: no-ops, chains, steps under a concurrency key and a rate
    limit, runs under a workflow limit (10 keys each)."""
    client.enqueue_many(noop, list(range(noops)))
    client.submit_many(chain, list(range(chains)))
    client.enqueue_many(keyed, [{"k": f"k{i % 10}"} for i in range(keyed_)])
    client.enqueue_many(rated, list(range(rated_)))
    client.submit_many(run_limited, [{"k": f"k{i % 10}"} for i in range(limited)])


def fill_small(client: Client) -> None:
    fill_each_kind(client, noops=5_000, chains=300, keyed_=2_000, rated_=1_000, limited=500)


@pytest.fixture(scope="module")
def loaded(cyclone_admin_dsn: str) -> Iterator[str]:
    with filled_schema(cyclone_admin_dsn, fill_large, analyzed=False) as dsn:
        yield dsn


@pytest.fixture(scope="module")
def loaded_analyzed(cyclone_admin_dsn: str) -> Iterator[str]:
    """The same rows with statistics, as autovacuum soon gives a production table."""
    with filled_schema(cyclone_admin_dsn, fill_large, analyzed=True) as dsn:
        yield dsn


@pytest.fixture(scope="module")
def small(cyclone_admin_dsn: str) -> Iterator[str]:
    """A few thousand rows, analyzed: the planner may hash a whole table it finds small."""
    with filled_schema(cyclone_admin_dsn, fill_small, analyzed=True) as dsn:
        yield dsn


def analyze(dsn: str) -> None:
    """ANALYZE the tables of this schema only (a bare ANALYZE would change the plans other
    tests see in their own schemas)."""
    each_table(dsn, "ANALYZE {}")


def each_table(dsn: str, statement: LiteralString) -> None:
    """Run ``statement`` (``{}`` is the table) on each table of the DSN's schema."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
        ).fetchall()
        for (table,) in tables:
            conn.execute(sql.SQL(statement).format(sql.Identifier(table)))


def explain(dsn: str, name: str, mode: str, how: str = "") -> list[dict[str, Any]]:
    """``EXPLAIN`` (with options ``how``) of hot statement ``name`` at ``plan_cache_mode``."""
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        query, params = hot_queries(conn)[name]
        return explained(conn, query, params, mode, how)


def explained(
    conn: psycopg.Connection[dict[str, Any]],
    query: str,
    params: dict[str, Any],
    mode: str,
    how: str = "",
) -> list[dict[str, Any]]:
    conn.execute(f"SET plan_cache_mode = {mode}")  # type: ignore[call-overload]
    params = {"shift": timedelta(0), **params}
    rows = conn.execute(f"EXPLAIN {how} {query}", params).fetchall()  # type: ignore[call-overload]
    conn.rollback()
    return rows


#: The statements of the hot path and the scanner passes (see hot_queries).
HOT_STATEMENTS = [
    "claim_steps",
    "lock_runs_of_steps",
    "lock_runs",
    "complete_steps",
    "finish_runs",
    "end_runs",
    "heartbeat_steps",
    "release_steps",
    "assemble_inputs",
    "activate_dependents",
    "activate_ready",
    "claim_capped_steps",
    "claim_gated_steps",
    "claim_gated_steps_rated",
    "claim_gated_steps_of_keys",
    "queues_waiting_for_run_slots",
    "queues_waiting_for_step_slots",
    "gated_queues",
    "gate_window_end",
    "scan_probe",
    "expired_leases",
    "wake_due_steps",
    "timed_out_steps",
    "due_timers",
    "due_waits_in_order",
    "run_tree",
    "due_in_tree",
    "expired_signal_waits",
    "expired_deadlines",
    "ended_children_of_waiting_nodes",
    "record_event",
    "record_events",
    "get_run_states",
    "followed_events",
]


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize(
    "name",
    HOT_STATEMENTS,
)
def test_hot_statements_never_scan_a_big_table(loaded: str, name: str, mode: str) -> None:
    rows = explain(loaded, name, mode)
    plan = "\n".join(r["QUERY PLAN"] for r in rows)
    scans = [t for t in (*BIG_TABLES, *ALSO.get(name, ())) if f"Seq Scan on {t} " in plan]
    assert scans == [], plan
    for index in AVOID.get(name, ()):
        assert index not in plan, plan


#: The gated claims: for a limit per run (a workflow's), the planner scans the runs of a
#: small analyzed table for the ended holders it expects to be few (well under a
#: millisecond at 8,000 runs), and with statistics the claim's estimate is above the JIT
#: threshold (Cyclone's own sessions run with jit=off). Each share's slots are limited by
#: a count only known per row, which the planner takes for a tenth of the table.
SMALL_TABLE_EXCEPTIONS = {
    "claim_gated_steps",
    "claim_gated_steps_rated",
    "claim_gated_steps_of_keys",
}


@pytest.mark.parametrize("name", HOT_STATEMENTS)
def test_hot_statements_probe_small_analyzed_tables_by_key(small: str, name: str) -> None:
    rows = explain(small, name, "auto")
    plan = "\n".join(r["QUERY PLAN"] for r in rows)
    tables = (*BIG_TABLES, *ALSO.get(name, ()))
    if name in SMALL_TABLE_EXCEPTIONS:
        tables = tuple(t for t in tables if t != "cyclone_runs")
    scans = [t for t in tables if f"Seq Scan on {t} " in plan]
    assert scans == [], plan


#: PostgreSQL JIT-compiles a statement whose estimated cost reaches ``jit_above_cost``
#: (100000 by default, on every server built with LLVM: most packaged and managed ones).
#: Compiling takes milliseconds, on every execution: a completion batch that cost 1 ms
#: took 8 to 20 ms. Cyclone's own sessions turn JIT off, but a transactional handler's
#: connection and a pooled (PgBouncer) one keep the server's setting.
JIT_ABOVE_COST = 100_000


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize(
    "name",
    HOT_STATEMENTS,
)
def test_hot_statements_stay_below_the_jit_threshold(loaded: str, name: str, mode: str) -> None:
    (row,) = explain(loaded, name, mode, "(FORMAT JSON)")
    cost = row["QUERY PLAN"][0]["Plan"]["Total Cost"]
    assert cost < JIT_ABOVE_COST, f"{name}: estimated cost {cost:,.0f}"


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("name", [n for n in HOT_STATEMENTS if n not in SMALL_TABLE_EXCEPTIONS])
def test_hot_statements_stay_below_the_jit_threshold_on_analyzed_tables(
    loaded_analyzed: str, name: str, mode: str
) -> None:
    """With statistics, a claim's gate check written as ``IS NULL`` got the default
    selectivity of 0.5%: the planner expected to walk most of the queue for 100 steps."""
    (row,) = explain(loaded_analyzed, name, mode, "(FORMAT JSON)")
    cost = row["QUERY PLAN"][0]["Plan"]["Total Cost"]
    assert cost < JIT_ABOVE_COST, f"{name}: estimated cost {cost:,.0f}"


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("name", ["activate_dependents", "activate_ready"])
def test_an_activation_judges_each_node_once(loaded: str, name: str, mode: str) -> None:
    """The judgement whether a node of a conditional definition is skipped (its guard's
    condition on the outputs it reads) was written once but planned once per column the
    update sets from it: six copies, each evaluated for every guarded node, and twice
    the planning time of the statement, which a connection through PgBouncer pays on
    every completion batch that activates a node."""
    plan = "\n".join(r["QUERY PLAN"] for r in explain(loaded, name, mode))
    assert plan.count("ANY (g.sources)") == 1, plan


@pytest.mark.parametrize("name", ["claim_steps", "claim_gated_steps"])
def test_a_claim_probes_its_runs_and_steps_by_key(cyclone_admin_dsn: str, name: str) -> None:
    """On a small, analyzed table the planner found hashing every run (and, to lease the
    chosen steps, every step) cheaper than a claim's worth of probes: those scans cost
    more than the rest of the claim."""

    def fill(client: Client) -> None:
        client.enqueue_many(noop, list(range(5_000)))
        client.enqueue_many(keyed, [{"k": f"k{i % 10}"} for i in range(2_000)])

    with filled_schema(cyclone_admin_dsn, fill, analyzed=True) as dsn:
        rows = explain(dsn, name, "auto")
    plan = "\n".join(r["QUERY PLAN"] for r in rows)
    assert "Seq Scan on cyclone_runs " not in plan, plan
    assert "Seq Scan on cyclone_steps " not in plan, plan


@workflow(name="plan_wait_first")
def wait_first(x):  # type: ignore[no-untyped-def]
    return noop.named("after")(wait_signal("go"))


def test_activating_many_nodes_probes_each_by_key(cyclone_admin_dsn: str) -> None:
    """A bulk submit activates the roots of every run it wrote, in its own transaction,
    before any statistics exist: activate_ready joined its (run, node) pairs to the steps
    by scanning every step once per pair (4,000 runs of a workflow starting with a wait:
    1.7 s, growing with the square of the batch)."""

    def fill(client: Client) -> None:
        client.submit_many(wait_first, list(range(4_000)))

    with (
        filled_schema(cyclone_admin_dsn, fill, analyzed=False) as dsn,
        psycopg.connect(dsn) as conn,
    ):
        run_ids = [r[0] for r in conn.execute("SELECT id FROM cyclone_runs ORDER BY id")]
        plan = "\n".join(
            r[0]
            for r in conn.execute(
                f"EXPLAIN {Q.activate_ready}",  # type: ignore[call-overload]
                {"run_ids": run_ids, "nodes": ["after"] * len(run_ids), "shift": timedelta(0)},
            )
        )
    assert "Seq Scan on cyclone_steps " not in plan, plan


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _plan_nodes(child)


def test_a_keys_slots_are_made_once(client: Client, cyclone_dsn: str) -> None:
    """Every submit of a limited step makes sure its keys have their slot rows. With the
    slots in place it generated the limit's whole range again, with as many conflict
    checks: 0.26 s per submit at a limit of 100,000. A raised limit still gets its new
    slots."""
    client.enqueue(rated, 1)
    with psycopg.connect(cyclone_dsn, row_factory=dict_row) as conn:
        (scope,) = conn.execute("SELECT scope FROM cyclone_ext_limits").fetchone().values()
        params = {"scopes": [scope], "keys": [""]}
        (row,) = conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {Q.ensure_slots}", params)
        series = [
            node
            for node in _plan_nodes(row["QUERY PLAN"][0]["Plan"])
            if node.get("Function Name") == "generate_series"
        ]
        assert series, row
        assert [node["Actual Rows"] for node in series] == [0] * len(series), row
        conn.execute(Q.upsert_limits, {"scopes": [scope], "max_counts": [20_005], "pers": [None]})
        conn.execute(Q.ensure_slots, params)
        counted = conn.execute("SELECT count(*) AS n, max(slot) AS top FROM cyclone_ext_slots")
        assert counted.fetchone() == {"n": 20_005, "top": 20_005}
        conn.rollback()


#: Reads that dashboards, scrapers and every worker repeat (the dashboard's queue chart
#: every 2 s per open page, /metrics at every scrape, a worker's housekeeping every few
#: seconds): their cost must follow the open work, not the history of ended runs a
#: retention of days keeps.
POLLED_READS: dict[str, tuple[str, dict[str, Any]]] = {
    "queue_stats": (Q.queue_stats, {}),
    "kind_stats": (Q.kind_stats, {}),
    "database_gauges": (Q.database_gauges, {}),
    # Every worker's housekeeping, every few seconds.
    "unstarted_children": (
        Q.unstarted_children,
        {"workflows": ["plan_chain"], "versions": ["v"], "limit": 100},
    ),
    "unserved_work": (
        Q.unserved_work,
        {"queues": None, "live_for": timedelta(seconds=30), "sample": 10_000},
    ),
    "queues_with_gates": (Q.queues_with_gates, {"queues": ["default"]}),
}

ENDED_HISTORY = """
WITH runs AS (
    INSERT INTO cyclone_runs (workflow, def_version, state, finished_at)
    SELECT 'plan_old', 'v', 'completed', now() FROM generate_series(1, %(count)s)
    RETURNING id
)
INSERT INTO cyclone_steps (run_id, node, kind, state, output, completed_at)
SELECT id, 'plan_noop', 'plan_noop', 'completed', 'null', now() FROM runs
"""


def add_history(client: Client) -> None:
    """20,000 ended runs of one step each."""
    with psycopg.connect(client.dsn, autocommit=True) as conn:
        conn.execute(ENDED_HISTORY, {"count": 20_000})


def fill_work_after_history(client: Client) -> None:
    """Each kind of work of fill_small, a few hundred runs in all, after 20,000 ended runs."""
    add_history(client)
    fill_each_kind(client, noops=100, chains=30, keyed_=100, rated_=50, limited=50)


@pytest.fixture(scope="module")
def work_after_history(cyclone_admin_dsn: str) -> Iterator[str]:
    """Work in flight beside the history a retention of days keeps, analyzed."""
    with filled_schema(cyclone_admin_dsn, fill_work_after_history, analyzed=True) as dsn:
        yield dsn


@pytest.mark.parametrize("name", HOT_STATEMENTS)
def test_hot_statements_never_walk_the_ended_history(work_after_history: str, name: str) -> None:
    """The tables of history only: the others (edges, gates) are small here, and a scan of
    a small table is the planner's right choice."""
    rows = explain(work_after_history, name, "auto")
    plan = "\n".join(r["QUERY PLAN"] for r in rows)
    scans = [t for t in BIG_TABLES if f"Seq Scan on {t} " in plan]
    assert scans == [], plan


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("name", sorted(POLLED_READS))
def test_polled_reads_never_walk_the_ended_history(
    work_after_history: str, name: str, mode: str
) -> None:
    query, params = POLLED_READS[name]
    with psycopg.connect(work_after_history, row_factory=dict_row) as conn:
        rows = explained(conn, query, params, mode)
    plan = "\n".join(r["QUERY PLAN"] for r in rows)
    scans = [t for t in BIG_TABLES if f"Seq Scan on {t} " in plan]
    assert scans == [], plan
