"""``def_version``: a stable fingerprint of everything that changes how a workflow executes.

What goes in, per node (sorted by id): the id, the kind, the input binding
(mode, and for each argument whether it is a reference — and to which node —
the run input, or a literal, but never the literal's value), the control
dependencies (sorted), the options (queue, priority, max_attempts, timeout,
retention, on_dep_failure), the wait spec (signal names, quorum, duration,
timer), the fan-out spec (max_parallel, max_bytes, max_items), the child spec
(workflow, whether it needs the result) and whether the output is kept; then
the result node. A conditional node adds its condition (``when``) and a
node that runs when all its dependencies were skipped its ``on_skip``; a
graph without them hashes as it did before conditions existed. Docstrings,
function bodies and literal argument values do not count. The encoding is
canonical JSON (sorted keys, no whitespace), so the hash does not depend on dict
order, the process or ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

from cyclone_dsl.graph import conditions
from cyclone_dsl.graph.model import Graph, Node

VERSION_PREFIX = "v1:"


def _seconds(value: timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()


def _node_shape(node: Node) -> dict[str, Any]:
    shape = _core_shape(node)
    # Only when set, so that the def_version of a graph without conditions is unchanged.
    if node.when is not None:
        shape["when"] = conditions.to_json(node.when)
    if node.on_skip != "skip":
        shape["on_skip"] = node.on_skip
    return shape


def _core_shape(node: Node) -> dict[str, Any]:
    options = node.options
    return {
        "id": node.id,
        "kind": node.kind,
        "binding": node.binding.value,
        "args": [[a.kind.value, a.ref] for a in node.args],
        "after": sorted(node.control_deps),
        "options": {
            "queue": options.queue,
            "priority": options.priority,
            "max_attempts": options.max_attempts,
            "timeout": _seconds(options.timeout),
            "retention": _seconds(options.retention),
            "on_dep_failure": options.on_dep_failure,
        },
        "wait": None
        if node.wait is None
        else {
            "name": node.wait.signal_name,
            "names": list(node.wait.signal_names) if node.wait.signal_names else None,
            "count": node.wait.count,
            "duration": _seconds(node.wait.duration),
            "timer": node.wait.timer,
        },
        "fan_out": None
        if node.fan_out is None
        else {
            "max_parallel": node.fan_out.max_parallel,
            "max_bytes": node.fan_out.max_bytes,
            "max_items": node.fan_out.max_items,
        },
        "child": None
        if node.child is None
        else {"workflow": node.child.workflow, "needs_result": node.child.needs_result},
        "keep_output": node.keep_output,
    }


def canonical(graph: Graph) -> str:
    """The canonical JSON text that :func:`fingerprint` hashes."""
    shape = {
        "nodes": [_node_shape(n) for n in sorted(graph.nodes, key=lambda n: n.id)],
        "result": graph.result,
    }
    return json.dumps(shape, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def fingerprint(graph: Graph) -> str:
    """``v1:`` followed by 32 hex digits of the SHA-256 of :func:`canonical`."""
    return VERSION_PREFIX + hashlib.sha256(canonical(graph).encode("ascii")).hexdigest()[:32]
