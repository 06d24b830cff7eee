"""Lays out a run's DAG in layers and draws it as SVG (server-side, escaped, no scripts).

The layout is a small Sugiyama layout:

1. **Rows.** Each node goes on the row of its depth (the longest path from a root),
   so every dependency points down.
2. **Dummy points.** An edge that skips rows gets one dummy point on every row it
   passes; a dummy takes a narrow slot in its row like a node, so the nodes of
   that row move aside and the edge passes *between* them, never behind one.
3. **Order.** Rows are reordered by the mean position of their neighbours (the
   barycenter heuristic, swept down and up), keeping the order with the fewest
   edge crossings.
4. **Coordinates.** Each element moves towards its neighbours' mean x, keeping the
   row's order and the least spacing (an exact isotonic regression per row), so
   long edges run straight and parents sit above their children.
5. **Drawing.** An edge leaves its source at a port on the bottom border and
   enters its target at a port on the top border (ports of one node are spread
   apart, ordered by the other end's x); between two rows it is a cubic curve
   whose control points stay in the gap between the rows, and across a row it
   is a vertical line through its dummy slot. No node lies in a row gap or in a
   dummy slot, so no edge passes through a node box.

:func:`layout` is the pure geometry; :func:`draw` renders it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from html import escape

import attrs

from cyclone_dsl.client.model import Step

COLOURS = {
    "completed": "#2e7d32",
    "running": "#1565c0",
    "available": "#6a1b9a",
    "pending": "#9e9e9e",
    "paused": "#f9a825",
    "waiting_signal": "#ad1457",
    "waiting_timer": "#ad1457",
    "waiting_child": "#ad1457",
    "discarded": "#c62828",
    "cancelled": "#795548",
}
WIDTH, HEIGHT, GAP_X, GAP_Y = 170, 46, 40, 44
#: The least distance between an edge passing through a row and a node or another edge.
EDGE_GAP = 14
#: The distance between two ports on a node's border, and the port-free margin at its corners.
PORT_GAP, PORT_MARGIN = 14, 16
#: Space around the drawing.
MARGIN = 20
#: Barycenter sweeps (ordering) and coordinate passes.
SWEEPS, PASSES = 12, 8

Point = tuple[float, float]


@attrs.frozen
class Box:
    """A node's rectangle."""

    x: int
    y: int
    width: int
    height: int


@attrs.frozen
class Edge:
    """A drawn dependency: ``source`` runs before ``target``.

    ``points`` is the route from the source's border to the target's: the two
    ports and, for an edge that skips rows, where it enters and leaves each row it
    passes. ``path`` is the SVG path data through those points.
    """

    source: str
    target: str
    points: tuple[Point, ...]
    skips: int  # rows passed between its two ends

    @property
    def path(self) -> str:
        """Curves through the row gaps, straight lines through the rows."""
        (x, y), *rest = self.points
        parts = [f"M{_n(x)},{_n(y)}"]
        for index, (nx, ny) in enumerate(rest):
            if index % 2 == 0:  # across a gap between two rows
                bend = (ny - y) / 2
                parts.append(f"C{_n(x)},{_n(y + bend)} {_n(nx)},{_n(ny - bend)} {_n(nx)},{_n(ny)}")
            else:  # down (or up) through a row, in the edge's own slot
                parts.append(f"L{_n(nx)},{_n(ny)}")
            x, y = nx, ny
        return " ".join(parts)


@attrs.frozen
class Layout:
    """A laid-out graph: each node's box and each edge's route, in a canvas of
    ``width`` by ``height`` pixels."""

    boxes: dict[str, Box]
    edges: tuple[Edge, ...]
    width: int
    height: int


def _n(value: float) -> str:
    """A coordinate for SVG: whole pixels bare, others with one decimal."""
    return str(int(value)) if value == int(value) else f"{value:.1f}"


def _pairs(nodes: Sequence[str], deps: dict[str, list[str]]) -> list[tuple[str, str]]:
    """Each dependency once, as ``(runs first, runs after)``, between known distinct nodes."""
    known = set(nodes)
    found = {
        (dep, node): None
        for node in dict.fromkeys(nodes)
        for dep in deps.get(node, [])
        if dep in known and dep != node
    }
    return list(found)


def _acyclic(nodes: Sequence[str], pairs: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """The pairs to turn upside down so that the graph has no cycle (DFS back edges).

    A run's graph is validated acyclic, so this is empty in practice; it keeps a
    corrupt graph drawable.
    """
    children: dict[str, list[str]] = {}
    for source, target in pairs:
        children.setdefault(source, []).append(target)
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    back: set[tuple[str, str]] = set()
    for root in dict.fromkeys(nodes):
        if root in state:
            continue
        state[root] = 1
        stack = [(root, iter(children.get(root, [])))]
        while stack:
            node, pending = stack[-1]
            child = next(pending, None)
            if child is None:
                state[node] = 2
                stack.pop()
            elif state.get(child) == 1:
                back.add((node, child))
            elif child not in state:
                state[child] = 1
                stack.append((child, iter(children.get(child, []))))
    return back


def _depths(nodes: Sequence[str], pairs: list[tuple[str, str]]) -> dict[str, int]:
    """The longest path from a root to each node (``pairs`` must be acyclic)."""
    parents: dict[str, list[str]] = {}
    children: dict[str, list[str]] = {}
    for source, target in pairs:
        parents.setdefault(target, []).append(source)
        children.setdefault(source, []).append(target)
    unique = list(dict.fromkeys(nodes))
    waiting = {node: len(parents.get(node, [])) for node in unique}
    ready = [node for node in unique if waiting[node] == 0]
    depth: dict[str, int] = {}
    while ready:
        node = ready.pop()
        depth[node] = 1 + max((depth[p] for p in parents.get(node, [])), default=-1)
        for child in children.get(node, []):
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    return depth


def _oriented(nodes: Sequence[str], deps: dict[str, list[str]]) -> list[tuple[str, str, bool]]:
    """Every pair pointing down, and whether it was turned upside down to do so."""
    pairs = _pairs(nodes, deps)
    back = _acyclic(nodes, pairs)
    return [(t, s, True) if (s, t) in back else (s, t, False) for s, t in pairs]


def layers(nodes: Sequence[str], deps: dict[str, list[str]]) -> list[list[str]]:
    """Nodes grouped by depth (the longest path from a root), in their original order."""
    oriented = _oriented(nodes, deps)
    depth = _depths(nodes, [(s, t) for s, t, _ in oriented])
    grouped: dict[int, list[str]] = {}
    for node in dict.fromkeys(nodes):
        grouped.setdefault(depth[node], []).append(node)
    return [grouped[level] for level in sorted(grouped)]


def _crossings(upper: dict[int, int], lower: dict[int, int], links: list[tuple[int, int]]) -> int:
    """How many of the links between two ordered rows cross."""
    ordered = sorted((upper[a], lower[b]) for a, b in links)
    seen: list[int] = []
    count = 0
    for _, position in ordered:
        count += len(seen) - bisect.bisect_right(seen, position)
        bisect.insort(seen, position)
    return count


def _isotonic(desired: list[float], weights: list[float], gaps: list[float]) -> list[float]:
    """Centres closest to ``desired`` (weighted least squares) that keep their order and
    at least ``gaps[i]`` between centre ``i - 1`` and centre ``i`` (pool adjacent violators)."""
    offsets = list(itertools.accumulate(gaps))
    blocks: list[list[float]] = []  # [value, weight, count]
    for want, weight, offset in zip(desired, weights, offsets, strict=True):
        blocks.append([want - offset, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            value, weight_b, count = blocks.pop()
            prior = blocks[-1]
            total = prior[1] + weight_b
            prior[0] = (prior[0] * prior[1] + value * weight_b) / total
            prior[1] = total
            prior[2] += count
    values = [value for value, _, count in blocks for _ in range(int(count))]
    return [value + offset for value, offset in zip(values, offsets, strict=True)]


def _order(rows: list[list[int]], above: list[list[int]], below: list[list[int]]) -> None:
    """Reorder the rows in place by barycenter sweeps, down then up, keeping the order
    with the fewest crossings."""
    links = [[(a, b) for a in rows[r] for b in below[a]] for r in range(len(rows) - 1)]
    at = {e: i for row in rows for i, e in enumerate(row)}

    def sweep(row: list[int], neighbours: list[list[int]]) -> None:
        def key(element: int) -> tuple[float, int]:
            linked = neighbours[element]
            centre = sum(at[n] for n in linked) / len(linked) if linked else at[element]
            return (centre, at[element])

        row.sort(key=key)
        at.update({e: i for i, e in enumerate(row)})

    for row in rows[1:]:  # a first order from the row above
        sweep(row, above)
    best = sum(_crossings(at, at, row_links) for row_links in links)
    best_rows = [list(row) for row in rows]
    for turn in range(SWEEPS):
        if best == 0:
            break
        if turn % 2 == 0:
            for row in rows[1:]:
                sweep(row, above)
        else:
            for row in reversed(rows[:-1]):
                sweep(row, below)
        count = sum(_crossings(at, at, row_links) for row_links in links)
        if count < best:
            best, best_rows = count, [list(row) for row in rows]
    rows[:] = best_rows


def _centres(
    rows: list[list[int]], above: list[list[int]], below: list[list[int]], is_node: list[bool]
) -> dict[int, float]:
    """Each element's x centre, in whole pixels from :data:`MARGIN`: every element is
    pulled towards its neighbours' mean x, row by row, down then up, keeping its row's
    order and spacing."""

    def half(element: int) -> float:
        return WIDTH / 2 if is_node[element] else 0.0

    def gap(a: int, b: int) -> float:
        space = GAP_X if is_node[a] and is_node[b] else EDGE_GAP
        return half(a) + space + half(b)

    x: dict[int, float] = {}
    for row in rows:  # packed from the left
        position = 0.0
        for i, element in enumerate(row):
            position += gap(row[i - 1], element) if i else 0.0
            x[element] = position
    weight = [1.0 if node else 4.0 for node in is_node]  # keep long edges straight
    for turn in range(PASSES):
        neighbours = above if turn % 2 == 0 else below
        for row in rows if turn % 2 == 0 else rows[::-1]:
            desired = [
                sum(x[n] for n in neighbours[e]) / len(neighbours[e]) if neighbours[e] else x[e]
                for e in row
            ]
            gaps = [gap(row[i - 1], e) if i else 0.0 for i, e in enumerate(row)]
            x.update(zip(row, _isotonic(desired, [weight[e] for e in row], gaps), strict=True))
    # Whole pixels, keeping every gap (the gaps are whole already).
    left = min((x[e] - half(e) for e in x), default=0.0)
    for row in rows:
        for i, element in enumerate(row):
            snapped = float(round(x[element] - left + MARGIN))
            x[element] = max(snapped, x[row[i - 1]] + gap(row[i - 1], element)) if i else snapped
    return x


def _ports(
    x: dict[int, float], chains: list[list[int]], end: int, neighbour: int
) -> dict[int, float]:
    """Edge number -> the x of its port on the border of ``chain[end]``: the node's
    ports are spread around its centre, ordered by the x of ``chain[neighbour]``."""
    groups: dict[int, list[int]] = {}
    for number, chain in enumerate(chains):
        groups.setdefault(chain[end], []).append(number)
    found: dict[int, float] = {}
    for element, numbers in groups.items():
        numbers.sort(key=lambda n: (x[chains[n][neighbour]], n))
        room = WIDTH - 2 * PORT_MARGIN
        step = min(PORT_GAP, room / (len(numbers) - 1)) if len(numbers) > 1 else 0
        first = x[element] - step * (len(numbers) - 1) / 2
        found.update({n: first + i * step for i, n in enumerate(numbers)})
    return found


def layout(nodes: Sequence[str], deps: dict[str, list[str]]) -> Layout:
    """Where every node and edge goes (see the module docstring)."""
    names = list(dict.fromkeys(nodes))
    oriented = _oriented(names, deps)
    depth = _depths(names, [(s, t) for s, t, _ in oriented])
    index = {name: i for i, name in enumerate(names)}

    # Elements: the nodes are 0..len(names)-1; every dummy point gets the next number.
    row_of = [depth[name] for name in names]
    chains: list[list[int]] = []  # per oriented edge: its elements from top to bottom
    for upper, lower, _ in oriented:
        chain = [index[upper]]
        for passed in range(depth[upper] + 1, depth[lower]):
            chain.append(len(row_of))
            row_of.append(passed)
        chain.append(index[lower])
        chains.append(chain)
    is_node = [element < len(names) for element in range(len(row_of))]
    above: list[list[int]] = [[] for _ in row_of]
    below: list[list[int]] = [[] for _ in row_of]
    for chain in chains:
        for a, b in itertools.pairwise(chain):
            below[a].append(b)
            above[b].append(a)
    rows: list[list[int]] = [[] for _ in range(max(row_of, default=-1) + 1)]
    for element, at_row in enumerate(row_of):
        rows[at_row].append(element)

    _order(rows, above, below)
    x = _centres(rows, above, below, is_node)
    top = [MARGIN + r * (HEIGHT + GAP_Y) for r in range(len(rows))]
    boxes = {
        name: Box(int(x[i] - WIDTH / 2), top[row_of[i]], WIDTH, HEIGHT)
        for i, name in enumerate(names)
    }
    out_at, in_at = _ports(x, chains, 0, 1), _ports(x, chains, -1, -2)
    edges: list[Edge] = []
    for number, ((upper, lower, flipped), chain) in enumerate(zip(oriented, chains, strict=True)):
        points: list[Point] = [(out_at[number], top[row_of[chain[0]]] + HEIGHT)]
        for dummy in chain[1:-1]:
            points += [(x[dummy], top[row_of[dummy]]), (x[dummy], top[row_of[dummy]] + HEIGHT)]
        points.append((in_at[number], top[row_of[chain[-1]]]))
        source, target = (lower, upper) if flipped else (upper, lower)
        route = tuple(reversed(points)) if flipped else tuple(points)
        edges.append(Edge(source, target, route, skips=len(chain) - 2))
    dummies = range(len(names), len(row_of))
    right = max([*(b.x + b.width for b in boxes.values()), *(x[e] for e in dummies)], default=0)
    width = int(right) + MARGIN if rows else 2 * MARGIN
    height = top[-1] + HEIGHT + MARGIN if rows else 2 * MARGIN
    return Layout(boxes, tuple(edges), width, height)


def draw(steps: Sequence[Step], deps: dict[str, list[str]], run_id: int) -> str:
    """The SVG of a run: fan-out items are collapsed into a counter on their fan-out node."""
    main = [s for s in steps if s.item_of is None]
    items: dict[str, list[Step]] = {}
    for step in steps:
        if step.item_of is not None:
            items.setdefault(step.item_of, []).append(step)
    by_node = {s.node: s for s in main}
    placed = layout([s.node for s in main], deps)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="dag" width="{placed.width}" '
        f'height="{placed.height}" viewBox="0 0 {placed.width} {placed.height}" role="img" '
        f'aria-label="run {run_id} graph">'
        '<defs><marker id="dag-arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="6" '
        'markerHeight="6" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#78909c"/>'
        "</marker></defs>"
        '<g class="edges">'
    ]
    for edge in placed.edges:
        kind = "edge skip" if edge.skips else "edge"
        parts.append(
            f'<path class="{kind}" data-from="{escape(edge.source)}" '
            f'data-to="{escape(edge.target)}" data-skips="{edge.skips}" d="{edge.path}" '
            'fill="none" stroke="#78909c" stroke-width="1.5" marker-end="url(#dag-arrow)"/>'
        )
    parts.append("</g>")
    for node, box in placed.boxes.items():
        step = by_node[node]
        x, y = box.x, box.y
        colour = COLOURS.get(step.state.value, "#9e9e9e")
        label = escape(node if len(node) <= 22 else node[:21] + "…")
        detail = escape(step.state.value)
        if node in items:
            done = sum(1 for i in items[node] if i.state.value == "completed")
            detail += f" · {done}/{len(items[node])} items"
        parts.append(
            f'<a href="#node-{escape(node)}"><g class="node" data-node="{escape(node)}" '
            f'data-state="{escape(step.state.value)}">'
            f'<rect x="{x}" y="{y}" width="{box.width}" height="{box.height}" rx="8" '
            f'fill="{colour}"/>'
            f'<text x="{x + 10}" y="{y + 19}" fill="#fff" font-size="13">{label}</text>'
            f'<text x="{x + 10}" y="{y + 36}" fill="#fff" font-size="11">{detail}</text></g></a>'
        )
    parts.append("</svg>")
    return "".join(parts)
