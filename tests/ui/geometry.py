"""Geometry checks shared by the graph, page and chart tests: SVG paths as polylines,
segments against boxes, and the parts of a page's SVG."""

from __future__ import annotations

import itertools
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence

from cyclone_dsl.ui.graph import Box

SVG = "{http://www.w3.org/2000/svg}"
Point = tuple[float, float]
#: Pieces each cubic curve is cut into: a chord is then within a fraction of a pixel of it.
PIECES = 32


def polyline(d: str) -> list[Point]:
    """The points of an SVG path made of absolute ``M``, ``L`` and ``C`` commands, each
    curve sampled in :data:`PIECES` pieces."""
    tokens = re.findall(r"[MLC]|-?\d+(?:\.\d+)?", d)
    points: list[Point] = []
    command = ""
    numbers: list[float] = []

    def take(count: int) -> list[float]:
        nonlocal numbers
        assert len(numbers) >= count, f"short path data: {d!r}"
        taken, numbers = numbers[:count], numbers[count:]
        return taken

    for token in [*tokens, "M"]:  # the sentinel flushes the last command
        if token not in "MLC":
            numbers.append(float(token))
            continue
        while numbers:
            if command in "ML":
                x, y = take(2)
                points.append((x, y))
            elif command == "C":
                assert points, "a curve needs a start"
                x1, y1, x2, y2, x, y = take(6)
                (x0, y0) = points[-1]
                for i in range(1, PIECES + 1):
                    t = i / PIECES
                    a, b, c, e = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t**2, t**3
                    points.append(
                        (a * x0 + b * x1 + c * x2 + e * x, a * y0 + b * y1 + c * y2 + e * y)
                    )
            else:
                raise AssertionError(f"unexpected path data {d!r}")
        command = token
    return points


def meets(p: Point, q: Point, box: Box, inset: float = 0.0) -> bool:
    """Whether the segment ``pq`` touches ``box`` shrunk by ``inset`` (Liang-Barsky)."""
    low_t, high_t = 0.0, 1.0
    for start, delta, low, high in (
        (p[0], q[0] - p[0], box.x + inset, box.x + box.width - inset),
        (p[1], q[1] - p[1], box.y + inset, box.y + box.height - inset),
    ):
        if delta == 0:
            if not low <= start <= high:
                return False
            continue
        t1, t2 = sorted(((low - start) / delta, (high - start) / delta))
        low_t, high_t = max(low_t, t1), min(high_t, t2)
        if low_t > high_t:
            return False
    return True


def check_routes(
    boxes: Mapping[str, Box], edges: Sequence[tuple[str, str, Sequence[Point]]]
) -> list[str]:
    """What is wrong with the edges' polylines (empty when nothing is): a segment that
    touches a node that is not one of its ends, or goes more than half a pixel into one
    of its ends."""
    problems = []
    for source, target, points in edges:
        for p, q in itertools.pairwise(points):
            for node, box in boxes.items():
                if node in (source, target):
                    if meets(p, q, box, inset=0.5):
                        problems.append(f"{source}->{target} enters its end {node} at {p}-{q}")
                elif meets(p, q, box):
                    problems.append(f"{source}->{target} crosses {node} at {p}-{q}")
    return problems


def parse_svg(html: str, marker: str) -> ET.Element:
    """The ``<svg>`` element of a page whose start tag contains ``marker``."""
    found = re.search(rf"<svg[^>]*{re.escape(marker)}.*?</svg>", html, re.DOTALL)
    assert found, f"no <svg ... {marker}> on the page"
    return ET.fromstring(found.group(0))


def graph_of(
    svg: ET.Element,
) -> tuple[dict[str, Box], list[tuple[str, str, list[Point]]], set[str]]:
    """A drawn run graph: the node boxes, each edge's ends and polyline, and the edges
    (``source->target``) drawn as skipping rows."""
    boxes = {}
    for node in svg.iter(f"{SVG}g"):
        if node.get("class") == "node":
            rect = node.find(f"{SVG}rect")
            assert rect is not None
            size = [int(rect.get(a, "")) for a in ("x", "y", "width", "height")]
            boxes[str(node.get("data-node"))] = Box(*size)
    edges, skipping = [], set()
    for path in svg.iter(f"{SVG}path"):
        classes = (path.get("class") or "").split()
        if "edge" not in classes:
            continue
        ends = (str(path.get("data-from")), str(path.get("data-to")))
        edges.append((*ends, polyline(path.get("d", ""))))
        if "skip" in classes:
            skipping.add("->".join(ends))
    return boxes, edges, skipping


def axis_labels(chart: ET.Element, axis: str) -> list[str]:
    """The tick labels of a chart's axis (which must have its line)."""
    group = chart.find(f"{SVG}g[@class='axis {axis}']")
    assert group is not None, f"no {axis}"
    assert group.find(f"{SVG}line[@class='axis-line']") is not None
    return [t.text or "" for t in group.iter(f"{SVG}text") if t.get("class") == "tick-label"]
