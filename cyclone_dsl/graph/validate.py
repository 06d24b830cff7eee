"""Every rule a workflow graph must satisfy; :func:`validate` reports all broken ones at once."""

from __future__ import annotations

from collections import Counter

from cyclone_dsl.durations import is_duration, refusal
from cyclone_dsl.errors import InvalidGraph
from cyclone_dsl.graph import conditions
from cyclone_dsl.graph.model import ArgKind, Binding, Graph, Node, NodeOptions
from cyclone_dsl.graph.rows import KIND_CHILD, SPECIAL_KINDS
from cyclone_dsl.payload import is_text, text_problem, utf8_size
from cyclone_dsl.states import OnDepFailure

MAX_QUEUE_BYTES = 256
MAX_TUPLE_ARGS = 4
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
#: The longest signal name (bytes of UTF-8): the longest client.signal sends.
MAX_SIGNAL_NAME_BYTES = 1024
#: The longest node id (bytes of UTF-8): two of them fit one key of cyclone_deps' index.
MAX_NODE_ID_BYTES = 1024
Problem = tuple[str | None, str]


def queue_problem(queue: object) -> str | None:
    """What is wrong with a queue name, or None: a non-empty string of at most
    :data:`MAX_QUEUE_BYTES` bytes, without NUL."""
    if not isinstance(queue, str) or not queue:
        return f"queue must be a non-empty string, not {queue!r}"
    return text_problem("queue name", queue, MAX_QUEUE_BYTES)


def check_options(options: NodeOptions) -> list[str]:
    """Problems with one node's options (empty when they are fine)."""
    problems: list[str] = []
    queue_wrong = queue_problem(options.queue)
    if queue_wrong is not None:
        problems.append(queue_wrong)
    if not _is_int(options.priority) or abs(options.priority) > INT32_MAX:
        problems.append(f"priority must be a 32-bit integer, not {options.priority!r}")
    if not _is_int(options.max_attempts) or not 1 <= options.max_attempts <= INT32_MAX:
        problems.append(
            f"max_attempts must be an integer of at least 1, not {options.max_attempts!r}"
        )
    for name in ("timeout", "retention"):
        value = getattr(options, name)
        if value is not None and not is_duration(value):
            problems.append(refusal(name, value))
    if not isinstance(options.on_dep_failure, str) or options.on_dep_failure not in {
        p.value for p in OnDepFailure
    }:
        problems.append(
            f"on_dep_failure must be 'fail_run' or 'cancel_branch', not {options.on_dep_failure!r}"
        )
    return problems


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_range(value: object, low: int, high: int) -> bool:
    return _is_int(value) and low <= value <= high  # type: ignore[operator]


def problems_of(graph: Graph) -> list[Problem]:
    """Every problem of the graph, each with the id of the node it concerns."""
    problems: list[Problem] = []
    if not graph.nodes:
        problems.append(
            (
                None,
                "a workflow needs at least one node: its builder must call a @step or @action "
                "(or wait_*, for_each, child); a run without nodes would never end",
            )
        )
    ids = [n.id for n in graph.nodes]
    for node_id, times in Counter(ids).items():
        if times > 1:
            problems.append(
                (node_id, f"{times} nodes share the id {node_id!r}: give each a unique .named() id")
            )
    known = set(ids)
    for node in graph.nodes:
        problems.extend((node.id, message) for message in _node_problems(node, known))
    problems.extend(_signal_name_problems(graph))
    problems.extend(_cycle_problems(graph, known))
    if graph.result is not None and graph.result not in known:
        problems.append((graph.result, f"the result node {graph.result!r} is not in the workflow"))
    problems.extend(_unkept_output_problems(graph))
    return problems


def _unkept_output_problems(graph: Graph) -> list[Problem]:
    """An @action's output is not kept: it cannot be the result (which would always be
    None), nor be read by a condition (which would always see None)."""
    unkept = {n.id for n in graph.nodes if not n.keep_output}
    problems: list[Problem] = []
    if graph.result in unkept:
        problems.append(
            (
                graph.result,
                f"the result node {graph.result!r} is an @action, whose output is not kept: "
                "make it a @step, or return a @step's output",
            )
        )
    for node in graph.nodes:
        if node.when is None:
            continue
        for source in conditions.sources(node.when):
            if source in unkept:
                problems.append(
                    (
                        node.id,
                        f"its condition reads the output of {source!r}, an @action, whose "
                        "output is not kept (it would always be None): make it a @step",
                    )
                )
    return problems


def _node_problems(node: Node, known: set[str]) -> list[str]:
    problems = [f"option problem: {p}" for p in check_options(node.options)]
    if not is_text(node.id):
        problems.append(
            f"node ids must be non-empty strings without NUL characters or lone surrogates, "
            f"not {node.id!r}"
        )
    elif "[" in node.id or "]" in node.id:
        problems.append("node ids may not contain '[' or ']' (they name fan-out items)")
    elif len(node.id.encode("utf-8")) > MAX_NODE_ID_BYTES:
        problems.append(
            f"node ids are at most {MAX_NODE_ID_BYTES} bytes of UTF-8, this one has "
            f"{len(node.id.encode('utf-8'))}: give the node a shorter id with .named()"
        )
    for dep in node.deps:
        if dep not in known:
            problems.append(
                f"depends on {dep!r}, which is not a node of this workflow "
                "(a reference from another workflow's builder cannot be used here)"
            )
    if node.binding is Binding.TUPLE and not 2 <= len(node.args) <= MAX_TUPLE_ARGS:
        problems.append(
            f"a call takes at most {MAX_TUPLE_ARGS} arguments, this one has {len(node.args)}: "
            "pass a list of references instead (array mode)"
        )
    if node.binding is Binding.ARRAY and any(a.kind is not ArgKind.REF for a in node.args):
        problems.append("a list argument may only hold node references (no literals or run input)")
    if node.wait is not None:
        wait = node.wait
        if wait.count is not None and not _in_range(wait.count, 1, INT32_MAX):
            problems.append(f"wait_n needs n from 1 to {INT32_MAX}, not {wait.count!r}")
        if wait.duration is not None and not is_duration(wait.duration):
            problems.append(refusal("a wait's timer or timeout", wait.duration))
        elif wait.timer and wait.duration is None:
            problems.append(refusal("a timer's length", None))
        names = wait.signal_names or ((wait.signal_name,) if wait.signal_name is not None else ())
        if not wait.timer and not names:
            problems.append("a signal wait needs at least one signal name")
        for name in names:
            if not is_text(name):
                problems.append(
                    "signal names must be non-empty strings without NUL characters or lone "
                    f"surrogates, not {name!r}"
                )
            elif (utf8_size(name) or 0) > MAX_SIGNAL_NAME_BYTES:
                problems.append(
                    f"signal names are at most {MAX_SIGNAL_NAME_BYTES} bytes (client.signal "
                    f"sends no longer one), not {utf8_size(name)}"
                )
    if node.fan_out is not None:
        spec = node.fan_out
        if not _in_range(spec.max_parallel, 0, INT32_MAX):
            problems.append(
                f"max_parallel must be an integer from 0 to {INT32_MAX}, not {spec.max_parallel!r}"
            )
        if spec.max_bytes is not None and not _in_range(spec.max_bytes, 0, INT64_MAX):
            problems.append(
                f"max_bytes must be an integer from 0 to {INT64_MAX}, not {spec.max_bytes!r}"
            )
        if spec.max_items is not None and not _in_range(spec.max_items, 1, INT32_MAX):
            problems.append(
                f"max_items must be an integer from 1 to {INT32_MAX}, not {spec.max_items!r}"
            )
        if node.kind in SPECIAL_KINDS and node.kind != KIND_CHILD:
            problems.append("for_each needs a @step, @action or @workflow")
    if node.when is not None:
        problems.extend(f"condition problem: {p}" for p in conditions.problems(node.when))
        for source in conditions.sources(node.when):
            if source not in known:
                problems.append(
                    f"its condition reads {source!r}, which is not a node of this workflow"
                )
            elif source not in node.deps:
                problems.append(
                    f"its condition reads {source!r}, which is not one of its dependencies"
                )
    if node.on_skip not in ("skip", "run"):
        problems.append(f"on_skip must be 'skip' or 'run', not {node.on_skip!r}")
    return problems


def _signal_name_problems(graph: Graph) -> list[Problem]:
    owners: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.wait is None or node.wait.timer:
            continue
        names = node.wait.signal_names or (node.wait.signal_name,)
        for name in names:
            if isinstance(name, str):
                owners.setdefault(name, []).append(node.id)
    return [
        (
            nodes[1],
            f"signal {name!r} is awaited by {len(nodes)} waits ({', '.join(nodes)}): "
            "each signal name may be awaited once per workflow",
        )
        for name, nodes in owners.items()
        if len(nodes) > 1
    ]


def _cycle_problems(graph: Graph, known: set[str]) -> list[Problem]:
    indegree = {n.id: 0 for n in graph.nodes}
    dependents: dict[str, list[str]] = {n.id: [] for n in graph.nodes}
    for node in graph.nodes:
        for dep in node.deps:
            if dep in known:
                indegree[node.id] += 1
                dependents[dep].append(node.id)
    ready = [n for n, d in indegree.items() if d == 0]
    while ready:
        current = ready.pop()
        for nxt in dependents[current]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    stuck = sorted(n for n, d in indegree.items() if d > 0)
    return [(n, "is part of a dependency cycle") for n in stuck]


def validate(graph: Graph) -> Graph:
    """Return the graph, or raise :class:`InvalidGraph` listing every problem."""
    problems = problems_of(graph)
    if problems:
        raise InvalidGraph(graph.workflow, problems)
    return graph
