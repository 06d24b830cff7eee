"""What a worker serves, worked out from its registry once at start (no I/O).

A worker runs a step only for a run whose ``(workflow, def_version)`` it has
the definition of: then every node's kind and input binding in that run is
the one this worker's code describes, so the handler it calls is the one the
workflow calls there, with the arguments the workflow passes. Standalone work
(``enqueue``) is served as ``(kind, "standalone")`` for every handler kind.

A handler's *identity* is where its function is defined,
``module:qualname``; two live workers that give one kind different identities
would run each other's handlers, so registration refuses the second one.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

import attrs

from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.dsl.step import handler_signature, takes_positional
from cyclone_dsl.graph.model import Binding, Graph
from cyclone_dsl.graph.rows import KIND_CHILD, TUPLE_KEYS

log = logging.getLogger("cyclone.worker")

STANDALONE = "standalone"


@attrs.frozen
class Call:
    """How a node's handler is called from its assembled input."""

    binding: Binding
    arity: int  # positional arguments the workflow passes


#: An item task of a fan-out gets its list element as its one argument.
ITEM_CALL = Call(Binding.SINGLE, 1)


@attrs.frozen
class Serving:
    versions: tuple[tuple[str, str], ...]  # (workflow, def_version), standalone ones included
    identities: Mapping[str, str]  # kind -> module:qualname
    calls: Mapping[tuple[str, str], Mapping[str, Call]]  # (workflow, def_version) -> node -> call

    @property
    def workflows(self) -> list[str]:
        return [w for w, _ in self.versions]

    @property
    def def_versions(self) -> list[str]:
        return [v for _, v in self.versions]

    def call_of(self, workflow: str, def_version: str, node: str, item_of: str | None) -> Call:
        """The call of a claimed step; KeyError for a run this worker does not serve."""
        if item_of is not None:
            return ITEM_CALL
        return self.calls[(workflow, def_version)][node]


def serving_of(registry: Registry, also: Registry | None = None) -> Serving:
    """Every version the registry's workflows and kinds make this worker able to run.

    ``also`` adds the workflows of another registry (the process-wide one, for a
    worker given step objects: it has those definitions in memory too) that this
    worker has work in (:func:`has_work_in`). One of those whose definition fails to
    build is skipped, with a warning.
    """
    versions: dict[tuple[str, str], None] = {}
    calls: dict[tuple[str, str], Mapping[str, Call]] = {}
    for name, definition in sorted(registry.workflows.items()):
        key = (name, definition.def_version)
        versions[key] = None
        calls[key] = _calls_of(definition.graph)
    extra = also.workflows if also is not None else {}
    for name, definition in sorted(extra.items()):
        if name in registry.workflows:
            continue
        try:
            key = (name, definition.def_version)
            graph = definition.graph
        except Exception as exc:  # noqa: BLE001 - another module's broken workflow is not ours
            log.warning("not serving workflow %r, whose definition fails: %s", name, exc)
            continue
        if not has_work_in(graph, registry.kinds.keys()):
            continue
        versions[key] = None
        calls[key] = _calls_of(graph)
    for kind in sorted(registry.kinds):
        versions[(kind, STANDALONE)] = None
    identities = {kind: identity_of(d.fn) for kind, d in registry.kinds.items()}
    return Serving(tuple(versions), identities, calls)


def has_work_in(graph: Graph, kinds: Collection[str]) -> bool:
    """Whether a worker with handlers of ``kinds`` has work in runs of ``graph``: a node it
    runs, a child run to start (a ``child`` node: started by a worker serving the parent's
    version when the process that reached it lacked the child's definition), or no
    handler node at all (nothing to claim, so nothing to tell apart). A workflow that calls
    only other workers' handlers would add nothing but its version to every claim and to
    the worker's registration: a process that defines hundreds of workflows (a test suite)
    made every claim carry them all."""
    handler_kinds = {n.kind for n in graph.nodes if not n.kind.startswith("@")}
    return (
        not handler_kinds
        or not handler_kinds.isdisjoint(kinds)
        or any(n.kind == KIND_CHILD for n in graph.nodes)
    )


def _calls_of(graph: Graph) -> dict[str, Call]:
    calls = {}
    for node in graph.nodes:
        if node.binding is Binding.NONE:
            arity = 0
        elif node.binding is Binding.TUPLE:
            arity = len(node.args)
        else:
            arity = 1
        calls[node.id] = Call(node.binding, arity)
    return calls


def arguments(call: Call, value: Any) -> list[Any]:
    """The positional arguments of a call, from the input the claim assembled."""
    if call.arity == 0:
        return []
    if call.binding is Binding.TUPLE:
        if not isinstance(value, dict):
            raise TypeError(f"a call with {call.arity} arguments got the input {value!r}")
        return [value.get(key) for key in TUPLE_KEYS[: call.arity]]
    return [value]


def standalone_arguments(fn: Callable[..., Any], value: Any) -> list[Any]:
    """Standalone work passes its input as the one argument, or none to a handler without
    (``enqueue`` refuses an input for such a handler)."""
    return [value] if _passes_input(fn) else []


@functools.cache
def _passes_input(fn: Callable[..., Any]) -> bool:
    """Whether standalone work passes its input to ``fn`` (once per handler: reading a
    signature per step cost a no-op step about a twentieth of its worker CPU)."""
    signature = handler_signature(fn)
    return signature is None or takes_positional(signature)


def identity_of(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a handler; a script's ``__main__`` is named as Python ran it."""
    module = getattr(fn, "__module__", None) or "?"
    if module == "__main__":
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        if spec is not None and spec.name:
            module = spec.name
        else:
            path = getattr(main, "__file__", None) or "__main__"
            module = path.rsplit("/", 1)[-1].removesuffix(".py")
    return f"{module}:{getattr(fn, '__qualname__', repr(fn))}"
