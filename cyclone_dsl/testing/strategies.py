"""Hypothesis strategies for workflow graphs: random valid ones, and ones with one known defect.

``graphs()`` draws :class:`~cyclone_dsl.graph.model.Graph` objects directly
(the lower-level API the decorators also produce): chains, diamonds, wide
joins in tuple and array mode, control edges, fan-outs, signal waits, timers
and child nodes. ``invalid_graphs()`` draws ``(graph, bad_node_id)`` where the
graph breaks exactly one rule at that node. Use them in your own property
tests, for instance to check that your tooling accepts any valid graph.
"""

from __future__ import annotations

from datetime import timedelta

import attrs
from hypothesis import strategies as st

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
from cyclone_dsl.graph.rows import KIND_CHILD, KIND_SIGNAL, KIND_TIMER

KINDS = ("k_alpha", "k_beta", "k_gamma")

options_strategy = st.builds(
    NodeOptions,
    queue=st.sampled_from(["default", "high", "q-ü"]),
    priority=st.integers(-5, 5),
    max_attempts=st.integers(1, 5),
    timeout=st.none() | st.integers(1, 600).map(lambda s: timedelta(seconds=s)),
    retention=st.none() | st.integers(1, 10**6).map(lambda s: timedelta(seconds=s)),
    on_dep_failure=st.sampled_from(["fail_run", "cancel_branch"]),
)


@st.composite
def graphs(draw: st.DrawFn, max_nodes: int = 12) -> Graph:
    """A random valid workflow graph."""
    count = draw(st.integers(1, max_nodes))
    nodes: list[Node] = []
    signal_number = 0
    for index in range(count):
        earlier = [n.id for n in nodes]
        node_id = f"n{index}"
        shape = draw(
            st.sampled_from(
                ["step", "step", "step", "tuple", "array", "fan_out", "signal", "timer", "child"]
            )
        )
        refs = draw(st.lists(st.sampled_from(earlier), max_size=4)) if earlier else []
        control = (
            tuple(sorted(set(draw(st.lists(st.sampled_from(earlier), max_size=2)))))
            if earlier
            else ()
        )
        options = draw(options_strategy)
        kind = draw(st.sampled_from(KINDS))
        if shape == "tuple" and len(refs) >= 2:
            args = tuple(
                Arg(ArgKind.REF, ref=r) if draw(st.booleans()) else Arg(ArgKind.STATIC, value=i)
                for i, r in enumerate(refs)
            )
            nodes.append(Node(node_id, kind, Binding.TUPLE, args, control, options))
        elif shape == "array" and refs:
            args = tuple(Arg(ArgKind.REF, ref=r) for r in refs)
            nodes.append(Node(node_id, kind, Binding.ARRAY, args, control, options))
        elif shape == "fan_out":
            source = (
                (Binding.SINGLE, (Arg(ArgKind.REF, ref=refs[0]),))
                if refs
                else (Binding.STATIC, (Arg(ArgKind.STATIC, value=[1, 2, 3]),))
            )
            spec = FanOutSpec(
                max_parallel=draw(st.integers(0, 4)),
                max_bytes=draw(st.sampled_from([0, 1000, None])),
            )
            nodes.append(Node(node_id, kind, *source, control, options, fan_out=spec))
        elif shape == "signal":
            signal_number += 1
            wait = draw(
                st.sampled_from(
                    [
                        WaitSpec(signal_name=f"s{signal_number}"),
                        WaitSpec(signal_name=f"s{signal_number}", count=2),
                        WaitSpec(signal_names=(f"s{signal_number}", f"t{signal_number}")),
                        WaitSpec(signal_name=f"s{signal_number}", duration=timedelta(seconds=5)),
                    ]
                )
            )
            nodes.append(
                Node(
                    node_id,
                    KIND_SIGNAL,
                    Binding.NONE,
                    (),
                    tuple(sorted(set(refs))) or control,
                    options,
                    wait=wait,
                )
            )
        elif shape == "timer":
            wait = WaitSpec(duration=timedelta(seconds=draw(st.integers(1, 60))), timer=True)
            nodes.append(
                Node(
                    node_id,
                    KIND_TIMER,
                    Binding.NONE,
                    (),
                    tuple(sorted(set(refs))) or control,
                    options,
                    wait=wait,
                )
            )
        elif shape == "child":
            args = (Arg(ArgKind.REF, ref=refs[0]),) if refs else ()
            binding = Binding.SINGLE if refs else Binding.NONE
            child_spec = ChildSpec(workflow="other_workflow", needs_result=draw(st.booleans()))
            nodes.append(
                Node(node_id, KIND_CHILD, binding, args, control, options, child=child_spec)
            )
        elif refs:
            nodes.append(
                Node(
                    node_id,
                    kind,
                    Binding.SINGLE,
                    (Arg(ArgKind.REF, ref=refs[0]),),
                    control,
                    options,
                )
            )
        else:
            static = draw(
                st.sampled_from([(), (Arg(ArgKind.INPUT),), (Arg(ArgKind.STATIC, value="x"),)])
            )
            binding = Binding.STATIC if static else Binding.NONE
            nodes.append(Node(node_id, kind, binding, static, control, options))
    result = draw(st.none() | st.sampled_from([n.id for n in nodes]))
    return Graph("generated", tuple(nodes), result)


DEFECTS = (
    "bad_queue",
    "long_queue",
    "zero_attempts",
    "bad_policy",
    "unknown_dep",
    "cycle",
    "duplicate_signal",
    "zero_quorum",
    "bad_duration",
    "wide_tuple",
    "duplicate_id",
)


@st.composite
def invalid_graphs(draw: st.DrawFn) -> tuple[Graph, str]:
    """A graph with exactly one defect, and the id of the node it concerns."""
    graph = draw(graphs(max_nodes=8))
    nodes = list(graph.nodes)
    defect = draw(st.sampled_from(DEFECTS))
    index = draw(st.integers(0, len(nodes) - 1))
    target = nodes[index]
    if defect == "bad_queue":
        target = attrs.evolve(target, options=attrs.evolve(target.options, queue=""))
    elif defect == "long_queue":
        target = attrs.evolve(target, options=attrs.evolve(target.options, queue="q" * 257))
    elif defect == "zero_attempts":
        target = attrs.evolve(target, options=attrs.evolve(target.options, max_attempts=0))
    elif defect == "bad_policy":
        target = attrs.evolve(target, options=attrs.evolve(target.options, on_dep_failure="skip"))
    elif defect == "unknown_dep":
        target = attrs.evolve(target, control_deps=(*target.control_deps, "ghost"))
    elif defect == "cycle":
        extra = Node("loop_a", "k_alpha", Binding.NONE, (), ("loop_b",))
        other = Node("loop_b", "k_alpha", Binding.NONE, (), ("loop_a",))
        return Graph(graph.workflow, (*nodes, extra, other), graph.result), "loop_a"
    elif defect == "duplicate_signal":
        first = Node("wait_x", KIND_SIGNAL, Binding.NONE, (), wait=WaitSpec(signal_name="dup"))
        second = Node(
            "wait_y", KIND_SIGNAL, Binding.NONE, (), wait=WaitSpec(signal_names=("dup", "z"))
        )
        return Graph(graph.workflow, (*nodes, first, second), graph.result), "wait_y"
    elif defect == "zero_quorum":
        bad = Node(
            "quorum", KIND_SIGNAL, Binding.NONE, (), wait=WaitSpec(signal_name="q0", count=0)
        )
        return Graph(graph.workflow, (*nodes, bad), graph.result), "quorum"
    elif defect == "bad_duration":
        bad = Node(
            "timer_x",
            KIND_TIMER,
            Binding.NONE,
            (),
            wait=WaitSpec(duration=timedelta(0), timer=True),
        )
        return Graph(graph.workflow, (*nodes, bad), graph.result), "timer_x"
    elif defect == "wide_tuple":
        args = tuple(Arg(ArgKind.STATIC, value=i) for i in range(5))
        bad = Node("wide", "k_alpha", Binding.TUPLE, args)
        return Graph(graph.workflow, (*nodes, bad), graph.result), "wide"
    else:
        twin = attrs.evolve(nodes[0], control_deps=())
        return Graph(graph.workflow, (*nodes, twin), graph.result), nodes[0].id
    nodes[index] = target
    return Graph(graph.workflow, tuple(nodes), graph.result), target.id
