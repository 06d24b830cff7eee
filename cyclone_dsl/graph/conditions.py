"""Conditions of conditional nodes: data, evaluated by PostgreSQL when a node is activated.

A condition is a tree of comparisons on an *operand* (a node's recorded output, or the run
input, optionally a path into it), combined with ``&``, ``|`` and ``~``. It is never
evaluated in Python: :func:`to_jsonpath` turns it into a SQL/JSON path predicate that the
activation statement matches against the outputs it names, in the transaction that
completes the upstream step.

Semantics, on JSON values:

* comparisons are between values of the same JSON type (numbers numerically, strings by
  code point, booleans and null for equality only); a comparison between different types
  is false, and so is one whose path does not exist in the value;
* ``truthy()`` is Python's truthiness of the value (``null``, ``false``, ``0``, ``""``,
  ``[]`` and ``{}`` are falsy); a missing path is not truthy;
* ``~c`` is true exactly when ``c`` is false: every comparison is two-valued.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

import attrs

from cyclone_dsl import payload
from cyclone_dsl.errors import BuildTimeValue, InvalidPayload

#: A value a condition compares with: a JSON scalar.
Scalar: TypeAlias = str | int | float | bool | None
#: One step of a path into a JSON value: an object key or a list index.
PathItem: TypeAlias = str | int

OPERATORS = ("==", "<", "<=", ">", ">=")

#: Where a condition's operand comes from when it is the run input.
RUN_INPUT = None


def is_scalar(value: object) -> bool:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, int):
        return True
    return (
        isinstance(value, float)
        and value == value
        and value
        not in (
            float("inf"),
            float("-inf"),
        )
    )


class Condition:
    """A condition on recorded outputs, for ``when=`` (combine with ``&``, ``|``, ``~``)."""

    __slots__ = ()

    def __and__(self, other: Condition) -> Condition:
        return AllOf((self, _condition(other, "&")))

    def __or__(self, other: Condition) -> Condition:
        return AnyOf((self, _condition(other, "|")))

    # ``True & c``, or a reference on the left (which refuses ``&`` itself).
    def __rand__(self, other: object) -> Condition:
        return AllOf((_condition(other, "&"), self))

    def __ror__(self, other: object) -> Condition:
        return AnyOf((_condition(other, "|"), self))

    def __invert__(self) -> Condition:
        return Not(self)

    if not TYPE_CHECKING:

        def __bool__(self) -> NoReturn:
            raise BuildTimeValue(
                "a condition has no value while the workflow is built: pass it as when= "
                "(the engine decides it when the run gets there), and combine conditions "
                "with &, | and ~ instead of and, or and not"
            )

    def map_sources(self, change: Callable[[Any], Any]) -> Condition:
        """The same condition with every operand's source replaced by ``change(source)``."""
        raise NotImplementedError

    def operands(self) -> list[Operand]:
        raise NotImplementedError


def _condition(value: object, symbol: str) -> Condition:
    """``value`` if it is a condition, else a stand-in the graph's validation refuses (with
    the workflow's other problems, as InvalidGraph)."""
    if isinstance(value, Condition):
        return value
    return NotACondition(
        f"{symbol} combines conditions, not {value!r} (a reference's truthiness is "
        "ref.truthy(), its falsiness ref.falsy())"
    )


@attrs.frozen
class Operand:
    """A node's output or the run input (``source``), at ``path`` (empty: the whole value).

    In a builder the source is a reference; in a graph it is the node id, or ``None``
    for the run input.
    """

    source: Any
    path: tuple[PathItem, ...] = ()

    def at(self, *path: PathItem) -> Operand:
        """The value at ``path`` inside this one: object keys (str) and list indices (int)."""
        return Operand(self.source, (*self.path, *path))

    def eq(self, value: Scalar) -> Condition:
        return Compare("==", self, value)

    def ne(self, value: Scalar) -> Condition:
        return Not(Compare("==", self, value))

    def lt(self, value: Scalar) -> Condition:
        return Compare("<", self, value)

    def le(self, value: Scalar) -> Condition:
        return Compare("<=", self, value)

    def gt(self, value: Scalar) -> Condition:
        return Compare(">", self, value)

    def ge(self, value: Scalar) -> Condition:
        return Compare(">=", self, value)

    def isin(self, values: Sequence[Scalar]) -> Condition:
        return Member(self, tuple(values) if isinstance(values, list | tuple) else values)

    def truthy(self) -> Condition:
        return Truthy(self)

    def falsy(self) -> Condition:
        return Not(Truthy(self))


@attrs.frozen
class Compare(Condition):
    op: str
    left: Operand
    value: Any

    def map_sources(self, change: Callable[[Any], Any]) -> Condition:
        return Compare(self.op, Operand(change(self.left.source), self.left.path), self.value)

    def operands(self) -> list[Operand]:
        return [self.left]


@attrs.frozen
class Member(Condition):
    left: Operand
    values: Any

    def map_sources(self, change: Callable[[Any], Any]) -> Condition:
        return Member(Operand(change(self.left.source), self.left.path), self.values)

    def operands(self) -> list[Operand]:
        return [self.left]


@attrs.frozen
class Truthy(Condition):
    left: Operand

    def map_sources(self, change: Callable[[Any], Any]) -> Condition:
        return Truthy(Operand(change(self.left.source), self.left.path))

    def operands(self) -> list[Operand]:
        return [self.left]


@attrs.frozen
class AllOf(Condition):
    parts: tuple[Condition, ...]

    def map_sources(self, change: Callable[[Any], Any]) -> Condition:
        return AllOf(tuple(p.map_sources(change) for p in self.parts))

    def operands(self) -> list[Operand]:
        return [o for p in self.parts for o in p.operands()]


@attrs.frozen
class AnyOf(Condition):
    parts: tuple[Condition, ...]

    def map_sources(self, change: Callable[[Any], Any]) -> Condition:
        return AnyOf(tuple(p.map_sources(change) for p in self.parts))

    def operands(self) -> list[Operand]:
        return [o for p in self.parts for o in p.operands()]


@attrs.frozen
class NotACondition(Condition):
    """What ``&`` or ``|`` was given instead of a condition (see :func:`_condition`)."""

    problem: str

    def map_sources(self, change: Callable[[Any], Any]) -> Condition:
        return self

    def operands(self) -> list[Operand]:
        return []


@attrs.frozen
class Not(Condition):
    part: Condition

    def map_sources(self, change: Callable[[Any], Any]) -> Condition:
        return Not(self.part.map_sources(change))

    def operands(self) -> list[Operand]:
        return self.part.operands()


def problems(condition: object) -> list[str]:
    """What is wrong with a condition of a graph (sources are node ids or None)."""
    if not isinstance(condition, Condition):
        return [
            f"when= takes a condition (ref.gt(0.8), ref.at('key').eq('x')...), not {condition!r}"
        ]
    found: list[str] = []
    _check(condition, found)
    return found


def _check(condition: Condition, found: list[str]) -> None:
    if isinstance(condition, AllOf | AnyOf):
        for part in condition.parts:
            _check(part, found)
        return
    if isinstance(condition, Not):
        _check(condition.part, found)
        return
    if isinstance(condition, NotACondition):
        found.append(condition.problem)
        return
    operand = condition.operands()[0]
    for item in operand.path:
        if not isinstance(item, str | int) or isinstance(item, bool):
            found.append(f"a path holds object keys (str) and list indices (int), not {item!r}")
        elif isinstance(item, int) and not -MAX_INDEX <= item <= MAX_INDEX:
            found.append(f"a list index is between -{MAX_INDEX} and {MAX_INDEX}, not {item}")
        elif isinstance(item, str) and (problem := _unstorable(item)) is not None:
            found.append(f"the path key {item!r} {problem}")
    if isinstance(condition, Compare):
        if condition.op not in OPERATORS:
            found.append(f"unknown comparison {condition.op!r}")
        if not is_scalar(condition.value):
            found.append(
                f"a condition compares with a JSON scalar (str, number, bool, None), "
                f"not {condition.value!r}"
            )
        elif (problem := _unstorable(condition.value)) is not None:
            found.append(f"the value {condition.value!r} {problem}")
        elif condition.op != "==" and (
            condition.value is None or isinstance(condition.value, bool)
        ):
            found.append(f"{condition.op} needs a number or a string, not {condition.value!r}")
    if isinstance(condition, Member):
        values = condition.values
        if not isinstance(values, tuple) or not values:
            found.append(f"isin() takes a non-empty list of JSON scalars, not {values!r}")
        elif not all(is_scalar(v) for v in values):
            found.append(f"isin() takes JSON scalars (str, number, bool, None), not {values!r}")
        else:
            found.extend(
                f"the value {v!r} {problem}"
                for v in values
                if (problem := _unstorable(v)) is not None
            )


#: The largest list index a path may hold (SQL/JSON path subscripts are 32-bit).
MAX_INDEX = 2**31 - 1


def _unstorable(value: object) -> str | None:
    """Why ``value`` (a scalar) cannot be stored as JSON (a NUL, a lone surrogate, an
    integer beyond 64 bits), or None."""
    try:
        payload.check(value)
    except InvalidPayload as exc:
        return f"cannot be stored: {exc.reason}"
    return None


def to_json(condition: Condition) -> Any:
    """A canonical JSON form (for the fingerprint)."""
    if isinstance(condition, AllOf):
        return {"all": [to_json(p) for p in condition.parts]}
    if isinstance(condition, AnyOf):
        return {"any": [to_json(p) for p in condition.parts]}
    if isinstance(condition, Not):
        return {"not": to_json(condition.part)}
    operand = condition.operands()[0]
    shape: dict[str, Any] = {"source": operand.source, "path": list(operand.path)}
    if isinstance(condition, Compare):
        shape |= {"op": condition.op, "value": condition.value}
    elif isinstance(condition, Member):
        shape |= {"op": "in", "values": list(condition.values)}
    else:
        shape |= {"op": "truthy"}
    return shape


def sources(condition: Condition) -> list[str]:
    """The nodes whose outputs the condition reads, in first-use order (not the run input)."""
    return list(dict.fromkeys(o.source for o in condition.operands() if o.source is not None))


def reads_run_input(condition: Condition) -> bool:
    return any(o.source is RUN_INPUT for o in condition.operands())


@attrs.frozen
class JsonPath:
    """A condition as a SQL/JSON path predicate over ``{"nodes": {id: output}, "input": ...}``,
    with its comparison values passed as variables (never spliced into the text)."""

    text: str
    variables: dict[str, Any]


def to_jsonpath(condition: Condition) -> JsonPath:
    variables: dict[str, Any] = {}
    text = "strict " + _predicate(condition, variables)
    return JsonPath(text, variables)


def _accessor(operand: Operand) -> str:
    base = '$."input"' if operand.source is RUN_INPUT else f'$."nodes".{_key(operand.source)}'
    for item in operand.path:
        base += f"[{_index(item)}]" if isinstance(item, int) else f".{_key(item)}"
    return base


def _index(item: int) -> str:
    """A list index as Python reads it: ``-1`` is the last item (``last`` in a path)."""
    if item >= 0:
        return str(item)
    return "last" if item == -1 else f"last - {-item - 1}"


def _key(name: str) -> str:
    return json.dumps(name, ensure_ascii=True)


def _variable(value: Any, variables: dict[str, Any]) -> str:
    name = f"v{len(variables)}"
    variables[name] = value
    return f"${name}"


def _two_valued(atom: str) -> str:
    """True when ``atom`` is true; false when it is false or unknown (a type mismatch, a
    missing path): SQL/JSON predicates are three-valued, conditions are not."""
    return f"(!(({atom}) is unknown) && ({atom}))"


def _predicate(condition: Condition, variables: dict[str, Any]) -> str:
    if isinstance(condition, AllOf):
        return "(" + " && ".join(_predicate(p, variables) for p in condition.parts) + ")"
    if isinstance(condition, AnyOf):
        return "(" + " || ".join(_predicate(p, variables) for p in condition.parts) + ")"
    if isinstance(condition, Not):
        return f"!({_predicate(condition.part, variables)})"
    value = _accessor(condition.operands()[0])
    if isinstance(condition, Compare):
        return _two_valued(f"{value} {condition.op} {_variable(condition.value, variables)}")
    if isinstance(condition, Member):
        tests = [_two_valued(f"{value} == {_variable(v, variables)}") for v in condition.values]
        return "(" + " || ".join(tests) + ")"
    falsy = [
        f"{value} == null",
        f"{value} == false",
        f"{value} == 0",
        f'{value} == ""',
        f'({value}.type() == "array" && {value}.size() == 0)',
        f'({value}.type() == "object" && !exists({value}.keyvalue()))',
    ]
    return (
        f"({_two_valued(f'exists({value})')} && "
        f"!({' || '.join(_two_valued(atom) for atom in falsy)}))"
    )
