"""The builder session a ``@workflow`` function runs in: it records nodes instead of running.

A contextvar holds the active :class:`Builder`; step calls, waits, ``for_each``
and ``child`` add a :class:`PendingNode` to it and return a :class:`NodeRef`.
Node ids are settled when the session ends: explicit ``.named()`` ids first,
then default ids (the handler's name) made unique with ``_2``, ``_3``...
"""

from __future__ import annotations

import collections.abc
import contextvars
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar

import attrs

from cyclone_dsl import payload
from cyclone_dsl.errors import BuildTimeValue, InvalidPayload
from cyclone_dsl.graph import conditions
from cyclone_dsl.graph.conditions import Condition, Operand, PathItem, Scalar
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

if TYPE_CHECKING:
    from cyclone_dsl.dsl.step import StepDef
    from cyclone_dsl.dsl.workflow import WorkflowDef

_active: contextvars.ContextVar[Builder | None] = contextvars.ContextVar(
    "cyclone_builder", default=None
)

T_co = TypeVar("T_co", covariant=True)

OPTION_NAMES = frozenset(
    {"queue", "priority", "max_attempts", "timeout", "retention", "on_dep_failure"}
)


def active_builder() -> Builder | None:
    return _active.get()


@attrs.define(eq=False)
class PendingNode:
    default_id: str
    kind: str
    binding: Binding
    args: list[Arg | NodeRef[Any]]
    control: list[NodeRef[Any]]
    options: dict[str, Any]
    wait: WaitSpec | None = None
    fan_out: FanOutSpec | None = None
    child: ChildSpec | None = None
    keep_output: bool = True
    explicit_id: str | None = None
    final_id: str = ""
    #: The condition the node runs under (sources: references); see :meth:`Builder.branch`.
    when: Condition | None = None
    on_skip: str = "skip"
    #: Problems of this call, reported with the node's id once ids are settled.
    problems: list[str] = attrs.field(factory=list)


_ONCE = "a @workflow builder runs once, to build the graph, not once per run"
_IN_A_STEP = "pass the reference to a step and {what} inside the step, where it is the real value"
_BRANCH = (
    "branch inside a step (it gets the real value and can skip its work), or use a child "
    "workflow for the part that depends on it"
)


class Ref(Generic[T_co]):
    """What a builder hands out: the run input or a node's output, standing for a ``T_co``.

    References stand for values that exist only when a run executes, so every
    operation that needs the value raises :class:`BuildTimeValue` (a
    ``TypeError``) instead of freezing a placeholder into the graph. ``repr()``,
    ``is`` and hashing (by identity) keep working. The type checker sees none
    of the refusing operations, so ``ref["id"]``, ``ref + 1``, ``len(ref)``, a
    ``for`` loop over a reference or a typo in an attribute are type errors too.
    """

    __slots__ = ()

    def _described(self) -> str:
        raise NotImplementedError

    # Conditions for when= (decided by the engine on the recorded value, never here).

    def at(self, *path: PathItem) -> Operand:
        """The value at ``path`` (object keys and list indices) inside this one, to build a
        condition on: ``score.at("risk", "level").eq("high")``."""
        return Operand(self, tuple(path))

    def eq(self, value: Scalar) -> Condition:
        """A condition: the value equals ``value`` (for ``when=``)."""
        return Operand(self).eq(value)

    def ne(self, value: Scalar) -> Condition:
        """A condition: the value does not equal ``value``."""
        return Operand(self).ne(value)

    def lt(self, value: Scalar) -> Condition:
        """A condition: the value is less than ``value`` (numbers, or strings)."""
        return Operand(self).lt(value)

    def le(self, value: Scalar) -> Condition:
        """A condition: the value is at most ``value``."""
        return Operand(self).le(value)

    def gt(self, value: Scalar) -> Condition:
        """A condition: the value is greater than ``value``."""
        return Operand(self).gt(value)

    def ge(self, value: Scalar) -> Condition:
        """A condition: the value is at least ``value``."""
        return Operand(self).ge(value)

    def isin(self, values: Sequence[Scalar]) -> Condition:
        """A condition: the value is one of ``values``."""
        return Operand(self).isin(values)

    def truthy(self) -> Condition:
        """A condition: the value is truthy as in Python (not null, false, 0, "", [] or {})."""
        return Operand(self).truthy()

    def falsy(self) -> Condition:
        """A condition: the value is falsy (or the path is missing)."""
        return Operand(self).falsy()

    def _refuse(self, operation: str, advice: str) -> NoReturn:
        what = self._described()
        raise BuildTimeValue(
            f"cannot use {what} in {operation}: {_ONCE}, so the reference ({self!r}) has no "
            f"value yet. {advice[0].upper()}{advice[1:]}."
        )

    __hash__ = object.__hash__

    if not TYPE_CHECKING:

        def __str__(self) -> str:
            self._refuse("str()", _IN_A_STEP.format(what="build the text"))

        def __format__(self, spec: str) -> str:
            self._refuse("an f-string or format()", _IN_A_STEP.format(what="build the text"))

        def __bool__(self) -> bool:
            self._refuse("an `if`, `while`, `and`, `or`, `not` or bool()", _BRANCH)

        def __iter__(self) -> NoReturn:
            self._refuse(
                "iteration (a `for` loop, unpacking, list())",
                _IN_A_STEP.format(what="loop")
                + ", or run a step per element with for_each(handler, over=reference)",
            )

        def __len__(self) -> int:
            self._refuse("len()", _IN_A_STEP.format(what="measure it"))

        def __contains__(self, item: object) -> bool:
            self._refuse("an `in` test", _IN_A_STEP.format(what="test it") + "; " + _BRANCH)

        def __getitem__(self, key: object) -> NoReturn:
            self._refuse(f"indexing ([{key!r}])", _IN_A_STEP.format(what="read the item"))

        def __int__(self) -> int:
            self._refuse("int()", _IN_A_STEP.format(what="convert it"))

        def __float__(self) -> float:
            self._refuse("float()", _IN_A_STEP.format(what="convert it"))

        def __index__(self) -> int:
            self._refuse(
                "an integer index (a list index, a slice, range())",
                _IN_A_STEP.format(what="use it"),
            )

        def _compare(self, symbol: str) -> NoReturn:
            self._refuse(
                f"a comparison ({symbol})",
                _IN_A_STEP.format(what="compare") + "; to act on the outcome, " + _BRANCH,
            )

        def __eq__(self, other: object) -> bool:
            self._compare("==")

        def __ne__(self, other: object) -> bool:
            self._compare("!=")

        def __lt__(self, other: object) -> bool:
            self._compare("<")

        def __le__(self, other: object) -> bool:
            self._compare("<=")

        def __gt__(self, other: object) -> bool:
            self._compare(">")

        def __ge__(self, other: object) -> bool:
            self._compare(">=")

        def _arithmetic(self, symbol: str) -> NoReturn:
            self._refuse(f"arithmetic ({symbol})", _IN_A_STEP.format(what="compute"))

        def __add__(self, other: object) -> NoReturn:
            self._arithmetic("+")

        def __radd__(self, other: object) -> NoReturn:
            self._arithmetic("+")

        def __sub__(self, other: object) -> NoReturn:
            self._arithmetic("-")

        def __rsub__(self, other: object) -> NoReturn:
            self._arithmetic("-")

        def __mul__(self, other: object) -> NoReturn:
            self._arithmetic("*")

        def __rmul__(self, other: object) -> NoReturn:
            self._arithmetic("*")

        def __truediv__(self, other: object) -> NoReturn:
            self._arithmetic("/")

        def __rtruediv__(self, other: object) -> NoReturn:
            self._arithmetic("/")

        def __floordiv__(self, other: object) -> NoReturn:
            self._arithmetic("//")

        def __rfloordiv__(self, other: object) -> NoReturn:
            self._arithmetic("//")

        def __mod__(self, other: object) -> NoReturn:
            self._arithmetic("%")

        def __rmod__(self, other: object) -> NoReturn:
            self._arithmetic("%")

        def __pow__(self, other: object) -> NoReturn:
            self._arithmetic("**")

        def __rpow__(self, other: object) -> NoReturn:
            self._arithmetic("**")

        def __neg__(self) -> NoReturn:
            self._arithmetic("unary -")

        def __pos__(self) -> NoReturn:
            self._arithmetic("unary +")

        def __abs__(self) -> NoReturn:
            self._arithmetic("abs()")

        def __round__(self, ndigits: int | None = None) -> NoReturn:
            self._arithmetic("round()")

        def _logic(self, symbol: str) -> NoReturn:
            self._refuse(
                f"a condition ({symbol})",
                "a condition on a reference is built from it: ref.truthy() (ref.falsy() for "
                "its negation), ref.gt(0), ref.at('key').eq('x'); combine those with &, | "
                "and ~",
            )

        def __and__(self, other: object) -> NoReturn:
            self._logic("&")

        def __rand__(self, other: object) -> NoReturn:
            self._logic("&")

        def __or__(self, other: object) -> NoReturn:
            self._logic("|")

        def __ror__(self, other: object) -> NoReturn:
            self._logic("|")

        def __invert__(self) -> NoReturn:
            self._logic("~")

        def __getattr__(self, name: str) -> NoReturn:
            # Dunder and private names (copy, pickle, attrs, introspection) and the
            # fields themselves (while an instance is being restored) stay plain misses.
            if name.startswith("_") or name in _field_names(type(self)):
                raise AttributeError(name)
            self._refuse(f"attribute access (.{name})", _IN_A_STEP.format(what=f"read .{name}"))


#: The former name of :class:`Ref`.
BuildTimeRef = Ref


def _field_names(cls: type) -> frozenset[str]:
    return frozenset(a.name for a in getattr(cls, "__attrs_attrs__", ()))


@attrs.define(eq=False, repr=False)
class NodeRef(Ref[T_co]):
    """A symbolic reference to a node's output inside a workflow builder."""

    builder: Builder
    node: PendingNode

    def named(self, node_id: str) -> NodeRef[T_co]:
        """Give the node an explicit id (unique within the workflow); returns the same ref."""
        given: object = node_id  # untyped callers may pass a reference
        if not isinstance(given, str):
            self.builder.problems.append(
                (None, f"a node id is a string fixed when the workflow is built, not {given!r}")
            )
            return self
        self.node.explicit_id = given
        return self

    def __repr__(self) -> str:
        return f"<ref {self.node.explicit_id or self.node.default_id} of {self.builder.name}>"

    def _described(self) -> str:
        node_id = self.node.explicit_id or self.node.default_id
        return f"the output of node {node_id!r} (workflow {self.builder.name!r})"


@attrs.define(eq=False, repr=False)
class RunInputRef(Ref[T_co]):
    """The run input as seen by the builder (it becomes a literal at submit)."""

    builder: Builder

    def __repr__(self) -> str:
        return f"<run input of {self.builder.name}>"

    def _described(self) -> str:
        return f"the run input of workflow {self.builder.name!r}"


@attrs.define(eq=False)
class Builder:
    name: str
    nodes: list[PendingNode] = attrs.field(factory=list)
    problems: list[tuple[str | None, str]] = attrs.field(factory=list)
    result: NodeRef[Any] | None = None
    steps: dict[str, StepDef[Any, Any]] = attrs.field(factory=dict)
    children: dict[str, WorkflowDef] = attrs.field(factory=dict)

    def arg(self, value: object, where: str) -> Arg | NodeRef[Any]:
        if isinstance(value, NodeRef):
            if value.builder is not self:
                self.problems.append(
                    (None, f"{where}: {value!r} belongs to workflow {value.builder.name!r}")
                )
            return value
        if isinstance(value, RunInputRef):
            return Arg(ArgKind.INPUT)
        try:
            payload.check(value)
        except InvalidPayload as exc:
            if _holds_ref(value):
                self.problems.append(
                    (
                        None,
                        f"{where}: a reference inside a literal ({value!r}) is not replaced by "
                        "its value: pass references as the call's arguments (up to 4, or one "
                        "list of node references) and build the structure inside the step",
                    )
                )
            else:
                self.problems.append((None, f"{where}: a literal argument is not JSON ({exc})"))
            return Arg(ArgKind.STATIC, value=None)
        return Arg(ArgKind.STATIC, value=value)  # type: ignore[arg-type]

    def add(
        self,
        default_id: str,
        kind: str,
        call_args: Sequence[object],
        *,
        after: object = None,
        options: dict[str, Any] | None = None,
        wait: WaitSpec | None = None,
        fan_out: FanOutSpec | None = None,
        child: ChildSpec | None = None,
        keep_output: bool = True,
        when: object = None,
        otherwise: object = None,
        on_skip: object = None,
    ) -> NodeRef[Any]:
        where = f"call of {default_id!r}"
        if (
            len(call_args) == 1
            and isinstance(call_args[0], list | tuple)
            and any(isinstance(v, NodeRef | RunInputRef) for v in call_args[0])
        ):
            # A list of node references: the handler gets their outputs as one list. A list
            # of literals is one static value like any other.
            binding = Binding.ARRAY
            args = [self.arg(v, where) for v in call_args[0]]
        else:
            args = [self.arg(v, where) for v in call_args]
            if not args:
                binding = Binding.NONE
            elif len(args) == 1:
                binding = Binding.SINGLE if isinstance(args[0], NodeRef) else Binding.STATIC
            else:
                binding = Binding.TUPLE
        control = self._control(after, where)
        condition = self._condition(when, otherwise, where)
        if condition is not None:
            # The node waits for what its condition reads.
            control += [o.source for o in condition.operands() if isinstance(o.source, NodeRef)]
        if on_skip is not None and on_skip not in ("skip", "run"):
            self.problems.append((None, f"{where}: on_skip= is 'skip' or 'run', not {on_skip!r}"))
            on_skip = None
        node = PendingNode(
            default_id,
            kind,
            binding,
            args,
            control,
            dict(options or {}),
            wait,
            fan_out,
            child,
            keep_output,
            when=condition,
            on_skip=str(on_skip or "skip"),
        )
        self.nodes.append(node)
        return NodeRef(self, node)

    def _condition(self, when: object, otherwise: object, where: str) -> Condition | None:
        """The condition a node runs under, from ``when=`` or ``otherwise=`` (the negation
        of another node's ``when=``); problems are recorded, not raised."""
        if otherwise is not None:
            if when is not None:
                self.problems.append((None, f"{where}: give when= or otherwise=, not both"))
                return None
            if not isinstance(otherwise, NodeRef) or otherwise.builder is not self:
                self.problems.append(
                    (None, f"{where}: otherwise= takes a node of this workflow, not {otherwise!r}")
                )
                return None
            if otherwise.node.when is None:
                self.problems.append(
                    (None, f"{where}: otherwise={otherwise!r} names a node without when=")
                )
                return None
            return ~otherwise.node.when
        if when is None:
            return None
        found = conditions.problems(when)
        if found or not isinstance(when, Condition):
            self.problems.extend((None, f"{where}: {problem}") for problem in found)
            return None
        for operand in when.operands():
            source = operand.source
            if not isinstance(source, NodeRef | RunInputRef):
                self.problems.append(
                    (
                        None,
                        f"{where}: a condition reads a node's output or the run input, "
                        f"not {source!r}",
                    )
                )
                return None
            if source.builder is not self:
                self.problems.append(
                    (None, f"{where}: {source!r} belongs to workflow {source.builder.name!r}")
                )
                return None
            if isinstance(source, NodeRef) and operand.path:
                problem = self._path_problem(source.node, operand.path)
                if problem is not None:
                    self.problems.append((None, f"{where}: {problem}"))
                    return None
        return when

    def _path_problem(self, node: PendingNode, path: tuple[PathItem, ...]) -> str | None:
        """Why ``path`` cannot exist in ``node``'s output, judged from its declared type."""
        shape = output_shape(node, self.steps)
        first = path[0]
        node_id = node.explicit_id or node.default_id
        if shape == "scalar" or (shape == "list" and isinstance(first, str)):
            what = "a list" if shape == "list" else "not an object"
            return (
                f"the condition's path {list(path)!r} goes into the output of {node_id!r}, "
                f"which is {what}"
            )
        if shape == "object" and isinstance(first, int):
            return (
                f"the condition's path {list(path)!r} indexes the output of {node_id!r}, "
                "which is an object"
            )
        return None

    def _control(self, after: object, where: str) -> list[NodeRef[Any]]:
        if after is None:
            return []
        items = list(after) if isinstance(after, list | tuple) else [after]
        refs = []
        for item in items:
            if not isinstance(item, NodeRef):
                self.problems.append((None, f"{where}: after= takes node references, not {item!r}"))
            elif item.builder is not self:
                self.problems.append(
                    (None, f"{where}: {item!r} belongs to workflow {item.builder.name!r}")
                )
            else:
                refs.append(item)
        return refs

    def finish(self, returned: object) -> Graph:
        if isinstance(returned, NodeRef) and returned.builder is not self:
            self.problems.append(
                (
                    None,
                    f"the builder returns {returned!r}, a node of workflow "
                    f"{returned.builder.name!r}: return a node of this workflow",
                )
            )
        elif isinstance(returned, NodeRef):
            if self.result is not None and self.result is not returned:
                self.problems.append((None, "define_result() and return name different nodes"))
            self.result = returned
        elif returned is not None:
            self.problems.append(
                (None, f"a workflow builder returns a node reference or None, not {returned!r}")
            )
        self._settle_ids()
        for pending in self.nodes:
            self.problems.extend((pending.final_id, message) for message in pending.problems)
        nodes = tuple(self._freeze(n) for n in self.nodes)
        result = self.result.node.final_id if self.result is not None else None
        return Graph(self.name, nodes, result)

    def _settle_ids(self) -> None:
        taken = {n.explicit_id for n in self.nodes if n.explicit_id}
        counts: dict[str, int] = {}
        for node in self.nodes:
            if node.explicit_id:
                node.final_id = node.explicit_id
                continue
            base = node.default_id
            number = counts.get(base, 0)
            candidate = base if number == 0 else f"{base}_{number + 1}"
            while candidate in taken:
                number += 1
                candidate = f"{base}_{number + 1}"
            counts[base] = number + 1
            taken.add(candidate)
            node.final_id = candidate

    def _freeze(self, node: PendingNode) -> Node:
        def to_arg(value: Arg | NodeRef[Any]) -> Arg:
            if isinstance(value, NodeRef):
                return Arg(ArgKind.REF, ref=value.node.final_id)
            return value

        options = NodeOptions(**node.options)
        when = (
            None
            if node.when is None
            else node.when.map_sources(
                lambda source: source.node.final_id if isinstance(source, NodeRef) else None
            )
        )
        return Node(
            id=node.final_id,
            kind=node.kind,
            binding=node.binding,
            args=tuple(to_arg(a) for a in node.args),
            control_deps=tuple(dict.fromkeys(r.node.final_id for r in node.control)),
            options=options,
            wait=node.wait,
            fan_out=node.fan_out,
            child=node.child,
            keep_output=node.keep_output,
            when=when,
            on_skip=node.on_skip,
        )


def output_shape(node: PendingNode, steps: dict[str, StepDef[Any, Any]]) -> str | None:
    """What a node's output is, when its declaration says: ``object``, ``list``,
    ``scalar``, or ``None`` (unknown: any path may exist)."""
    if node.fan_out is not None or (node.wait is not None and node.wait.count is not None):
        return "list"
    if node.wait is not None:
        if node.wait.timer:
            return "scalar"
        return "object" if node.wait.signal_names else None
    step = steps.get(node.kind)
    if step is None:
        return None
    try:
        hints = typing.get_type_hints(step.fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: unknown, not an error
        return None
    returned = hints.get("return")
    origin = typing.get_origin(returned) or returned
    if origin in (int, float, str, bool, type(None)):
        return "scalar"
    if origin in (list, tuple, collections.abc.Sequence):
        return "list"
    if origin in (dict, collections.abc.Mapping) or typing.is_typeddict(returned):
        return "object"
    return None


def _holds_ref(value: object, depth: int = 0) -> bool:
    """Whether a literal list, tuple or dict holds a builder reference (to explain the error)."""
    if isinstance(value, Ref):
        return True
    if depth > 32:
        return False
    if isinstance(value, list | tuple):
        return any(_holds_ref(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_ref(v, depth + 1) for v in value.values())
    return False


@contextmanager
def building(name: str) -> Iterator[Builder]:
    builder = Builder(name)
    token = _active.set(builder)
    try:
        yield builder
    finally:
        _active.reset(token)


def require_builder(what: str) -> Builder:
    builder = _active.get()
    if builder is None:
        raise RuntimeError(f"{what}() can only be called inside a @workflow builder")
    return builder
