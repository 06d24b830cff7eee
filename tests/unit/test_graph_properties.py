"""Property tests of the graph layer: validate, compile, fingerprint (no database)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from cyclone_dsl.errors import InvalidGraph
from cyclone_dsl.graph.compile import compile_run
from cyclone_dsl.graph.fingerprint import fingerprint
from cyclone_dsl.graph.model import Graph, Node
from cyclone_dsl.graph.validate import validate
from cyclone_dsl.testing.strategies import graphs, invalid_graphs

ROOT = Path(__file__).resolve().parents[2]


def is_acyclic(edges: set[tuple[str, str]], nodes: set[str]) -> bool:
    indegree = dict.fromkeys(nodes, 0)
    for node, _dep in edges:
        indegree[node] += 1
    ready = [n for n, d in indegree.items() if d == 0]
    seen = 0
    while ready:
        current = ready.pop()
        seen += 1
        for node, dep in edges:
            if dep == current:
                indegree[node] -= 1
                if indegree[node] == 0:
                    ready.append(node)
    return seen == len(nodes)


@given(graphs())
@settings(max_examples=150)
def test_valid_graphs_compile_to_the_same_dag(graph: Graph) -> None:
    validate(graph)
    compiled = compile_run(graph, {"input": [1, 2]})
    nodes = {s.node for s in compiled.steps}
    assert nodes == {n.id for n in graph.nodes}
    edges = {(d.node, d.dep_node) for d in compiled.deps}
    assert edges == {(n.id, dep) for n in graph.nodes for dep in n.deps}
    assert is_acyclic(edges, nodes)
    data_edges = {(d.node, d.dep_node) for d in compiled.deps if d.dep_type == "data"}
    for binding in compiled.inputs:
        assert (binding.node, binding.dep_node) in data_edges
    for step in compiled.steps:
        if step.input_from is not None:
            assert (step.node, step.input_from) in data_edges
        roots_ready = step.state == "available"
        assert not roots_ready or not any(d.node == step.node for d in compiled.deps)
    assert compiled.def_version == fingerprint(graph)


@given(invalid_graphs())
@settings(max_examples=150)
def test_invalid_graphs_name_the_bad_node(case: tuple[Graph, str]) -> None:
    graph, bad_node = case
    with pytest.raises(InvalidGraph) as caught:
        validate(graph)
    assert bad_node in caught.value.node_ids


MUTATIONS = ("rename", "kind", "add_edge", "drop_edges", "queue", "result")


def applies(mutation: str, nodes: list[Node], index: int) -> bool:
    """Whether ``mutation`` changes something at ``nodes[index]``: an edge can be added
    only if a later node does not depend on it yet, and dropped only if there is one."""
    node = nodes[index]
    if mutation == "add_edge":
        return any(node.id not in n.deps for n in nodes[index + 1 :])
    if mutation == "drop_edges":
        return bool(node.control_deps)
    return True


@given(graphs(), st.sampled_from(MUTATIONS), st.data())
@settings(max_examples=150)
def test_any_topology_change_changes_the_fingerprint(
    graph: Graph, mutation: str, data: st.DataObject
) -> None:
    nodes = list(graph.nodes)
    # Draw a node the mutation applies to, so that every example asserts; a graph with
    # none (one node, or no control edge at all) is rejected, which is rare.
    candidates = [i for i in range(len(nodes)) if applies(mutation, nodes, i)]
    assume(candidates)
    index = data.draw(st.sampled_from(candidates), label="node index")
    node = nodes[index]
    event(f"mutation: {mutation}")
    if mutation == "rename":
        renamed = f"{node.id}_renamed"
        nodes = [
            attrs.evolve(
                n,
                id=renamed if n.id == node.id else n.id,
                args=tuple(attrs.evolve(a, ref=renamed) if a.ref == node.id else a for a in n.args),
                control_deps=tuple(renamed if d == node.id else d for d in n.control_deps),
            )
            for n in nodes
        ]
        result = renamed if graph.result == node.id else graph.result
        changed = Graph(graph.workflow, tuple(nodes), result)
    elif mutation == "kind":
        nodes[index] = attrs.evolve(node, kind=node.kind + "_other")
        changed = Graph(graph.workflow, tuple(nodes), graph.result)
    elif mutation == "add_edge":
        later = [n for n in nodes[index + 1 :] if node.id not in n.deps]
        target = data.draw(st.sampled_from(later))
        position = nodes.index(target)
        nodes[position] = attrs.evolve(target, control_deps=(*target.control_deps, node.id))
        changed = Graph(graph.workflow, tuple(nodes), graph.result)
    elif mutation == "drop_edges":
        nodes[index] = attrs.evolve(node, control_deps=())
        changed = Graph(graph.workflow, tuple(nodes), graph.result)
    elif mutation == "queue":
        nodes[index] = attrs.evolve(node, options=attrs.evolve(node.options, queue="elsewhere"))
        changed = Graph(graph.workflow, tuple(nodes), graph.result)
    else:
        result = None if graph.result is not None else node.id
        changed = Graph(graph.workflow, tuple(nodes), result)
    assert fingerprint(changed) != fingerprint(graph)


@given(graphs())
@settings(max_examples=50)
def test_fingerprint_ignores_node_order(graph: Graph) -> None:
    shuffled = Graph(graph.workflow, tuple(reversed(graph.nodes)), graph.result)
    assert fingerprint(shuffled) == fingerprint(graph)


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_fingerprint_is_stable_across_interpreters(seed: str) -> None:
    from tests.unit import flows

    code = (
        "from tests.unit import flows; "
        "print(flows.orders.def_version); print(flows.parent.def_version)"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [flows.orders.def_version, flows.parent.def_version]
    assert out[0].startswith("v1:") and len(out[0]) == 35
