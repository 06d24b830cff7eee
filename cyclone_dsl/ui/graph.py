"""Lays out a run's DAG in layers and draws it as SVG (server-side, escaped, no scripts)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

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
WIDTH, HEIGHT, GAP_X, GAP_Y = 170, 46, 40, 28


def layers(nodes: Sequence[str], deps: dict[str, list[str]]) -> list[list[str]]:
    """Nodes grouped by depth (the longest path from a root), in their original order."""
    depth: dict[str, int] = {}

    def of(node: str, seen: frozenset[str] = frozenset()) -> int:
        if node not in depth:
            parents = [d for d in deps.get(node, []) if d in nodes and d not in seen]
            depth[node] = 1 + max((of(p, seen | {node}) for p in parents), default=-1)
        return depth[node]

    grouped: dict[int, list[str]] = {}
    for node in nodes:
        grouped.setdefault(of(node), []).append(node)
    return [grouped[level] for level in sorted(grouped)]


def draw(steps: Sequence[Step], deps: dict[str, list[str]], run_id: int) -> str:
    """The SVG of a run: fan-out items are collapsed into a counter on their fan-out node."""
    main = [s for s in steps if s.item_of is None]
    items: dict[str, list[Step]] = {}
    for step in steps:
        if step.item_of is not None:
            items.setdefault(step.item_of, []).append(step)
    by_node = {s.node: s for s in main}
    grid = layers([s.node for s in main], deps)
    position: dict[str, tuple[int, int]] = {}
    for row, level in enumerate(grid):
        for column, node in enumerate(level):
            position[node] = (20 + column * (WIDTH + GAP_X), 20 + row * (HEIGHT + GAP_Y))
    width = 40 + max((len(level) for level in grid), default=1) * (WIDTH + GAP_X)
    height = 40 + len(grid) * (HEIGHT + GAP_Y)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="dag" width="{width}" '
        f'height="{height}" role="img" aria-label="run {run_id} graph">'
    ]
    for node, (x, y) in position.items():
        for dep in deps.get(node, []):
            if dep in position:
                dx, dy = position[dep]
                parts.append(
                    f'<line x1="{dx + WIDTH // 2}" y1="{dy + HEIGHT}" x2="{x + WIDTH // 2}" '
                    f'y2="{y}" stroke="#888" stroke-width="1.5"/>'
                )
    for node, (x, y) in position.items():
        step = by_node[node]
        colour = COLOURS.get(step.state.value, "#9e9e9e")
        label = escape(node if len(node) <= 22 else node[:21] + "…")
        detail = escape(step.state.value)
        if node in items:
            done = sum(1 for i in items[node] if i.state.value == "completed")
            detail += f" · {done}/{len(items[node])} items"
        parts.append(
            f'<a href="#node-{escape(node)}"><g class="node" data-node="{escape(node)}" '
            f'data-state="{escape(step.state.value)}">'
            f'<rect x="{x}" y="{y}" width="{WIDTH}" height="{HEIGHT}" rx="8" '
            f'fill="{colour}"/>'
            f'<text x="{x + 10}" y="{y + 19}" fill="#fff" font-size="13">{label}</text>'
            f'<text x="{x + 10}" y="{y + 36}" fill="#fff" font-size="11">{detail}</text></g></a>'
        )
    parts.append("</svg>")
    return "".join(parts)
