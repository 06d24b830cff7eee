"""The engine does not rely on the order of rows that PostgreSQL does not order.

The rows of an ``UPDATE ... RETURNING`` (and of a SELECT without ORDER BY) come in no set
order: the plan and the rows' places on disk decide it. Here the engine runs on a
transaction that hands those rows back reversed, as a server could, and what users see
(which node a run's failure names, the order child runs start in) stays the same.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, LiteralString

import psycopg
import pytest

from cyclone_dsl.db.tx import ConnectionTx, Row
from cyclone_dsl.engine import Engine, Failure, Success
from cyclone_dsl.graph.compile import compile_run
from cyclone_dsl.graph.model import Binding, ChildSpec, Graph, Node, NodeOptions
from cyclone_dsl.graph.rows import KIND_CHILD
from cyclone_dsl.sql import Q

KIND = "ro_k"
ENGINE = Engine()
LEAF = NodeOptions(max_attempts=1)


class ReversedRows(ConnectionTx):
    """A transaction whose ``rows`` of ``query`` come back in reverse order."""

    def __init__(self, conn: psycopg.Connection[Any], query: LiteralString) -> None:
        super().__init__(conn)
        self.query = query

    def rows(self, query: LiteralString, **params: object) -> list[Row]:
        found = super().rows(query, **params)
        return found[::-1] if query == self.query else found


def _claimed(conn: psycopg.Connection[Any], graph: Graph) -> tuple[int, dict[str, Any]]:
    compiled = compile_run(graph, "in")
    with conn.transaction():
        run_id = ENGINE.submit(ConnectionTx(conn), compiled)
    with conn.transaction():
        got = ENGINE.claim(
            ConnectionTx(conn),
            owner="ro",
            queues=["default"],
            kinds=[KIND],
            versions=[(compiled.workflow, compiled.def_version)],
            limit=100,
            lease=timedelta(seconds=30),
        )
    return run_id, {c.node: c for c in got}


@pytest.mark.parametrize("reversed_rows", [False, True])
def test_two_failures_in_one_batch_name_the_first_node_whatever_the_row_order(
    cyclone_dsn: str, reversed_rows: bool
) -> None:
    """Nodes a and b fail in one batch and fail the run; node c, still running, is
    cancelled naming a (the first node in step id order), however the failed rows came."""
    graph = Graph(
        "ro_three",
        (
            Node("a", KIND, Binding.NONE, (), options=LEAF),
            Node("b", KIND, Binding.NONE, (), options=LEAF),
            Node("c", KIND, Binding.NONE, (), options=LEAF),
        ),
        "c",
    )
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        run_id, claims = _claimed(conn, graph)
        failures = [
            Failure(claims[n].id, claims[n].generation, f"{n} broke", "error", retry=False)
            for n in ("b", "a")
        ]
        tx = ReversedRows(conn, Q.fail_steps) if reversed_rows else ConnectionTx(conn)
        with conn.transaction():
            ENGINE.fail(tx, failures)
        rows = conn.execute(
            "SELECT node, state, error FROM cyclone_steps WHERE run_id = %s ORDER BY node",
            (run_id,),
        ).fetchall()
    assert rows == [
        ("a", "discarded", "a broke"),
        ("b", "discarded", "b broke"),
        ("c", "cancelled", "cancelled: node 'a' failed"),
    ]


CHILD_GRAPH = Graph("ro_child", (Node("x", KIND, Binding.NONE, (), options=LEAF),), "x")


def _compile_child(workflow: str, run_input: Any, parent: tuple[str, str]) -> Any:
    return compile_run(CHILD_GRAPH, run_input)


@pytest.mark.parametrize("reversed_rows", [False, True])
def test_child_runs_started_together_start_in_node_order_whatever_the_row_order(
    cyclone_dsn: str, reversed_rows: bool
) -> None:
    """Three child nodes activated by one completion start their child runs in step id
    order (their ids follow the nodes'), however the activated rows came."""
    engine = Engine(compile_child=_compile_child)
    spec = ChildSpec(workflow="ro_child", needs_result=False)
    root = Node("r", KIND, Binding.NONE, (), options=LEAF)
    kids = tuple(
        Node(k, KIND_CHILD, Binding.NONE, (), ("r",), LEAF, child=spec) for k in ("k1", "k2", "k3")
    )
    graph = Graph("ro_children", (root, *kids), "r")
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        run_id, claims = _claimed(conn, graph)
        tx = ReversedRows(conn, Q.activate_dependents) if reversed_rows else ConnectionTx(conn)
        with conn.transaction():
            engine.complete(tx, [Success(claims["r"].id, claims["r"].generation, "null")])
        rows = conn.execute(
            "SELECT parent_node_id FROM cyclone_runs WHERE parent_run_id = %s ORDER BY id",
            (run_id,),
        ).fetchall()
    assert [r[0] for r in rows] == ["k1", "k2", "k3"]
