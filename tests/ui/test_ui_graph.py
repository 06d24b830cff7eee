"""The run graph's layout, as pure geometry (no database).

What every layout keeps: every dependency is drawn; no drawn edge (curves included)
touches a node that is not one of its two ends, nor goes into its ends; an edge
that passes a row does so in a slot of its own, apart from the nodes and from the
other edges of that row; the edges of one node leave and enter it at distinct ports.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from cyclone_dsl.ui.graph import EDGE_GAP, Box, Layout, layers, layout
from tests.ui.geometry import check_routes, polyline

#: The least distance between two ports of a node, for nodes with up to 13 edges a side.
PORT_APART = 10


def check_layout(
    nodes: Sequence[str], deps: dict[str, list[str]], *, acyclic: bool = True
) -> Layout:
    placed = layout(nodes, deps)
    assert set(placed.boxes) == set(nodes)
    wanted = {(d, n) for n in nodes for d in deps.get(n, []) if d in placed.boxes and d != n}
    assert sorted((e.source, e.target) for e in placed.edges) == sorted(wanted)
    assert placed == layout(nodes, deps)  # the same picture every time

    boxes = list(placed.boxes.values())
    for i, a in enumerate(boxes):
        assert a.x >= 0 and a.x + a.width <= placed.width
        assert a.y >= 0 and a.y + a.height <= placed.height
        for b in boxes[i + 1 :]:  # no two nodes overlap
            assert (
                a.x + a.width <= b.x
                or b.x + b.width <= a.x
                or a.y + a.height <= b.y
                or b.y + b.height <= a.y
            )

    drawn = {(e.source, e.target): polyline(e.path) for e in placed.edges}
    assert check_routes(placed.boxes, [(s, t, p) for (s, t), p in drawn.items()]) == []
    for (source, target), points in drawn.items():
        assert all(0 <= x <= placed.width and 0 <= y <= placed.height for x, y in points)
        if acyclic:  # from the bottom border of the source to the top border of the target
            a, b = placed.boxes[source], placed.boxes[target]
            assert points[0][1] == a.y + a.height and a.x < points[0][0] < a.x + a.width
            assert points[-1][1] == b.y and b.x < points[-1][0] < b.x + b.width

    # Distinct ports: the edges of a node leave (and enter) it at points apart.
    ports: dict[tuple[str, float], list[float]] = {}  # (node, border y) -> port xs
    for (source, target), points in drawn.items():
        ports.setdefault((source, points[0][1]), []).append(points[0][0])
        ports.setdefault((target, points[-1][1]), []).append(points[-1][0])
    for (node, _), xs in ports.items():
        for left, right in itertools.pairwise(sorted(xs)):
            assert right - left >= PORT_APART, f"{node}: ports {xs}"

    # Each row an edge passes: one vertical slot, apart from the row's nodes and other edges.
    bands = {(b.y, b.y + b.height) for b in boxes}
    rows_passed = 0
    for top, bottom in bands:
        passes: list[float] = []
        for (source, target), points in drawn.items():
            inside = {
                (p[0], q[0])
                for p, q in itertools.pairwise(points)
                if max(p[1], q[1]) > top and min(p[1], q[1]) < bottom
            }
            assert len(inside) <= 1, f"{source}->{target} passes a row more than once"
            for x, other_x in inside:
                assert x == other_x, f"{source}->{target} is not vertical in a row"
                passes.append(x)
        rows_passed += len(passes)
        for left, right in itertools.pairwise(sorted(passes)):
            assert right - left >= EDGE_GAP
        for x in passes:
            for box in boxes:
                if box.y == top:
                    assert x <= box.x - EDGE_GAP or x >= box.x + box.width + EDGE_GAP
    assert rows_passed == sum(e.skips for e in placed.edges)
    return placed


def test_the_checker_sees_an_edge_behind_a_node_or_inside_its_ends() -> None:
    boxes = {"a": Box(0, 0, 100, 40), "b": Box(0, 80, 100, 40), "c": Box(0, 160, 100, 40)}
    straight = [(50.0, 40.0), (50.0, 160.0)]
    assert check_routes(boxes, [("a", "c", straight)]) == [
        "a->c crosses b at (50.0, 40.0)-(50.0, 160.0)"
    ]
    around = [(50.0, 40.0), (120.0, 60.0), (120.0, 140.0), (50.0, 160.0)]
    assert check_routes(boxes, [("a", "c", around)]) == []
    into = [(50.0, 40.0), (50.0, 60.0), (50.0, 170.0)]
    assert check_routes(boxes, [("b", "c", into)]) == [
        "b->c crosses a at (50.0, 40.0)-(50.0, 60.0)",
        "b->c enters its end b at (50.0, 60.0)-(50.0, 170.0)",
        "b->c enters its end c at (50.0, 60.0)-(50.0, 170.0)",
    ]


def test_a_skip_level_edge_passes_beside_the_node_between() -> None:
    placed = check_layout(["a", "b", "c"], {"b": ["a"], "c": ["a", "b"]})
    skip = next(e for e in placed.edges if (e.source, e.target) == ("a", "c"))
    assert skip.skips == 1 and [e.skips for e in placed.edges if e is not skip] == [0, 0]
    b = placed.boxes["b"]
    (x_in, y_in), (x_out, y_out) = skip.points[1:3]  # where it enters and leaves b's row
    assert (y_in, y_out) == (b.y, b.y + b.height) and x_in == x_out
    assert not b.x - EDGE_GAP < x_in < b.x + b.width + EDGE_GAP


def test_a_diamond_needs_no_skips() -> None:
    deps = {"b": ["a"], "c": ["a"], "d": ["b", "c"]}
    placed = check_layout(["a", "b", "c", "d"], deps)
    assert not any(e.skips for e in placed.edges)
    assert layers(["a", "b", "c", "d"], deps) == [["a"], ["b", "c"], ["d"]]
    # The parent is centred over its children, the join under its parents.
    centre = {n: b.x + b.width / 2 for n, b in placed.boxes.items()}
    assert centre["a"] == centre["d"] == (centre["b"] + centre["c"]) / 2


def test_rows_are_ordered_to_avoid_crossings() -> None:
    # Given in an order that would cross both pairs of edges.
    deps = {"b1": ["b"], "a1": ["a"], "b2": ["b1"], "a2": ["a1"]}
    placed = check_layout(["a", "b", "b1", "a1", "b2", "a2"], deps)
    x = {n: b.x for n, b in placed.boxes.items()}
    assert (x["a"] < x["b"]) == (x["a1"] < x["b1"]) == (x["a2"] < x["b2"])


def test_a_wide_fan_in_with_skips_from_every_level() -> None:
    mids = [f"m{i}" for i in range(8)]
    deps = {m: ["root"] for m in mids}
    deps |= {"c1": ["m0"], "c2": ["c1"], "c3": ["c2"]}
    deps["sink"] = ["root", *mids, "c1", "c2", "c3"]
    placed = check_layout(["root", *mids, "c1", "c2", "c3", "sink"], deps)
    skips = {(e.source, e.target): e.skips for e in placed.edges if e.skips}
    assert skips == {("root", "sink"): 4, **{(m, "sink"): 3 for m in mids}} | {
        ("c1", "sink"): 2,
        ("c2", "sink"): 1,
    }


def test_the_flagship_shape() -> None:
    deps = {
        "demo_price": ["demo_fetch_order"],
        "demo_check_stock": ["demo_fetch_order"],
        "demo_list_lines": ["demo_fetch_order"],
        "demo_confirm": ["demo_price", "demo_check_stock", "approved"],
        "demo_ship_line": ["demo_list_lines", "demo_confirm"],
        "demo_invoice": ["demo_fetch_order", "demo_confirm"],
        "demo_summarize": ["demo_confirm", "demo_ship_line", "demo_invoice"],
    }
    nodes = ["demo_fetch_order", "approved", *(n for n in deps if n != "demo_fetch_order")]
    placed = check_layout(nodes, deps)
    skipping = {(e.source, e.target): e.skips for e in placed.edges if e.skips}
    assert skipping == {
        ("demo_fetch_order", "demo_invoice"): 2,
        ("demo_list_lines", "demo_ship_line"): 1,
        ("demo_confirm", "demo_summarize"): 1,
        ("approved", "demo_confirm"): 1,
    }


def test_odd_inputs_still_lay_out() -> None:
    empty = check_layout([], {})
    assert (empty.boxes, empty.edges) == ({}, ())
    check_layout(["a"], {"a": ["a", "missing"]})
    check_layout(["a", "b"], {"b": ["a", "a"]})
    # A cycle cannot come from a validated workflow; it is still drawn, not hidden.
    check_layout(["a", "b"], {"a": ["b"], "b": ["a"]}, acyclic=False)
    check_layout(["a", "b", "c"], {"b": ["a"], "c": ["b"], "a": ["c"]}, acyclic=False)


def test_a_long_chain_lays_out() -> None:
    names = [f"n{i}" for i in range(3000)]  # deeper than Python's recursion limit
    placed = layout(names, {b: [a] for a, b in itertools.pairwise(names)})
    assert len({box.x for box in placed.boxes.values()}) == 1
    assert placed.boxes["n2999"].y > placed.boxes["n0"].y


@st.composite
def dags(draw: st.DrawFn) -> tuple[list[str], dict[str, list[str]]]:
    size = draw(st.integers(1, 14))
    names = [f"n{i}" for i in range(size)]
    deps: dict[str, list[str]] = {}
    for j in range(1, size):
        parents = draw(st.lists(st.integers(0, j - 1), max_size=4, unique=True))
        if parents:
            deps[names[j]] = [names[i] for i in parents]
    return draw(st.permutations(names)), deps


@given(dags())
def test_no_edge_of_a_random_dag_hides_behind_a_node(
    graph: tuple[list[str], dict[str, list[str]]],
) -> None:
    check_layout(*graph)


@given(
    st.dictionaries(
        st.sampled_from("abcdef"), st.lists(st.sampled_from("abcdefg"), max_size=4), max_size=6
    )
)
def test_any_graph_lays_out(deps: dict[str, list[str]]) -> None:
    check_layout(list("abcdef"), deps, acyclic=False)
