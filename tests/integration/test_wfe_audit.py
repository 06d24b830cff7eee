"""Differential audit of the workflow DSL: a run of pure steps gives what Python gives.

A workflow reads as plain Python (docs/workflows.md): for pure steps, the run's
result and every node's output must equal what the same functions compute when
called directly, after the JSON round trip every kept output goes through (a
tuple comes back as a list; numbers compare as JSON numbers). Shapes the docs
refuse are refused with a typed error when the graph is built, and nothing is
written.

The hypothesis test draws small programs the engine property test leaves out:
literals and the run input mixed with references in tuple calls, defaults and
``*args``, list (array) joins with repeated references, ``for_each`` over step
outputs, literals and the run input, child runs and ``for_each`` over a child
workflow, with values that are falsy, empty, nested, unicode or at the 64-bit
bounds; each program is submitted by ``submit``, ``submit_many`` or
``submit_tx`` (the template path and the compiled path).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cyclone_dsl import (
    BuildTimeValue,
    Client,
    InvalidGraph,
    NoOutput,
    Worker,
    action,
    child,
    define_result,
    for_each,
    step,
    workflow,
)
from cyclone_dsl.states import RunState, StepState

StartWorker = Callable[..., Worker]
names = itertools.count()

# ---------------------------------------------------------------------------- handlers


def kind(x: Any) -> str:
    """The JSON type of a value (ints and floats are both numbers in JSON)."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int | float):
        return "num"
    if isinstance(x, str):
        return "str"
    if isinstance(x, list | tuple):
        return "list"
    return "dict"


@step(name="wfe_ident")
def ident(x: Any) -> Any:
    return x


@step(name="wfe_wrap")
def wrap(x: Any) -> Any:
    return {"w": x, "k": kind(x)}


@step(name="wfe_pack")
def pack(a: Any, b: Any = "B", c: Any = ("C", 1), d: Any = None) -> Any:
    return (a, b, c, d)  # a tuple: it comes back as a list


@step(name="wfe_star")
def star(*xs: Any) -> Any:
    return list(xs)


@step(name="wfe_listsum")
def listsum(xs: Any) -> Any:
    return {"n": len(xs), "xs": xs, "kinds": [kind(x) for x in xs]}


@step(name="wfe_to_list")
def to_list(x: Any) -> Any:
    """A list made of any value, independent of the order of a dict's keys."""
    if isinstance(x, list | tuple):
        return list(x)
    if isinstance(x, dict):
        return [[k, x[k]] for k in sorted(x)]
    return [x, None, x]


@step(name="wfe_item")
def item(x: Any) -> Any:
    return {"i": x, "k": kind(x)}


@step(name="wfe_keys")
def keys_of(x: Any) -> Any:
    return list(x)


@step(name="wfe_nothing")
def nothing() -> Any:
    return None


@action(name="wfe_act")
def act(x: Any) -> None:
    return None


@step(name="wfe_two")
def two(a: Any, b: Any) -> Any:
    return [a, b]


@workflow(name="wfe_child_res")
def child_res(x):  # type: ignore[no-untyped-def]
    return wrap(x)


@workflow(name="wfe_child_quiet")
def child_quiet(x):  # type: ignore[no-untyped-def]
    ident(x)


@workflow(name="wfe_child_fan")
def child_fan(x):  # type: ignore[no-untyped-def]
    return for_each(child_res, over=to_list(x))


HANDLERS = [ident, wrap, pack, star, listsum, to_list, item, keys_of, nothing, act, two]
CHILDREN = [child_res, child_quiet, child_fan]
CHILD_OF = {0: child_quiet, 1: child_res, 2: child_fan}


def direct_child(which: int, value: Any) -> Any:
    """What the child workflows compute, called as Python (0: no result, 1: a step's
    output, 2: a fan-out of child runs over the input made a list)."""
    if which == 2:
        return [direct_child(1, v) for v in stored(to_list.fn(value))]
    return stored(wrap.fn(value)) if which else None


# ---------------------------------------------------------------------------- comparison


def stored(value: Any) -> Any:
    """The documented round trip of a kept value: JSON (a tuple comes back as a list)."""
    return json.loads(json.dumps(value, allow_nan=False))


def same(a: Any, b: Any) -> bool:
    """Equal as JSON values: numbers by value (``1e16`` may come back as an int), but a
    bool is never a number, and a list never a dict."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b or (math.isclose(a, b, rel_tol=1e-15) and abs(a) >= 2**63)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def counts(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM cyclone_runs), (SELECT count(*) FROM cyclone_steps)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


# ---------------------------------------------------------------------------- strategies

text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=6
) | st.sampled_from(["", "é", "🦀", "\u2028", "a\\u0000b", "ﬁ", "e\u0301", "\"'%s", "שלום"])
numbers = (
    st.integers(-5, 5)
    | st.sampled_from([2**63 - 1, -(2**63), 2**53 + 1, 0])
    | st.sampled_from([0.5, -2.25, 3.0, 1e-7, 1e16, 1e300, -0.0, 0.1])
)
scalars = st.none() | st.booleans() | numbers | text
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(text, inner, max_size=3)
    ),
    max_leaves=6,
)

SHAPES = ["lit", "inp", "wrap", "pack", "star", "array", "tolist", "fan", "child", "fan_child"]


@st.composite
def programs(draw: st.DrawFn) -> tuple[list[tuple[Any, ...]], Any, int]:
    """A program: per node a shape and its sources (("ref", i), ("lit", v) or ("inp",))."""
    run_input = draw(json_values)
    count = draw(st.integers(1, 6))
    spec: list[tuple[Any, ...]] = []
    lists: list[int] = []  # nodes whose output is always a list

    def source() -> tuple[Any, ...]:
        options = ["lit", "inp"] + (["ref"] * 3 if spec else [])
        chosen = draw(st.sampled_from(options))
        if chosen == "ref":
            return ("ref", draw(st.integers(0, len(spec) - 1)))
        if chosen == "lit":
            return ("lit", draw(json_values))
        return ("inp",)

    def list_source() -> tuple[Any, ...]:
        options = ["lit"] + (["ref"] * 3 if lists else [])
        if isinstance(run_input, list | tuple):
            options.append("inp")
        chosen = draw(st.sampled_from(options))
        if chosen == "ref":
            return ("ref", draw(st.sampled_from(lists)))
        if chosen == "lit":
            literal = st.lists(json_values, max_size=3)
            return ("lit", draw(literal | literal.map(tuple)))
        return ("inp",)

    for index in range(count):
        shape = draw(st.sampled_from(SHAPES if spec else ["lit", "inp", "wrap", "pack", "star"]))
        if shape == "lit":
            spec.append(("lit", draw(json_values)))
        elif shape == "inp":
            spec.append(("inp",))
        elif shape in ("wrap", "tolist"):
            spec.append((shape, source()))
        elif shape == "pack":
            spec.append(("pack", [source() for _ in range(draw(st.integers(1, 4)))]))
        elif shape == "star":
            spec.append(("star", [source() for _ in range(draw(st.integers(0, 4)))]))
        elif shape == "array":
            refs = draw(st.lists(st.integers(0, index - 1), min_size=1, max_size=4))
            spec.append(("array", refs, draw(st.booleans())))
        elif shape == "fan":
            spec.append(("fan", list_source()))
        elif shape == "child":
            if draw(st.booleans()):
                refs = draw(st.lists(st.integers(0, index - 1), min_size=1, max_size=3))
                given_input: tuple[Any, ...] = ("refs", refs)
            else:
                given_input = source()
            spec.append(("child", given_input, draw(st.integers(0, 2))))
        else:
            spec.append(("fan_child", list_source(), draw(st.integers(0, 2))))
        last = spec[-1]
        is_list = (
            last[0] in ("star", "pack", "tolist", "fan")
            or (last[0] == "fan_child" and last[2] > 0)
            or (last[0] == "child" and last[2] == 2)
            or (last[0] == "lit" and isinstance(last[1], list | tuple))
            or (last[0] == "inp" and isinstance(run_input, list | tuple))
        )
        if is_list:
            lists.append(index)
    result = draw(st.integers(-1, count - 1))  # -1: the builder returns the last node
    return spec, run_input, result


def build(spec: list[tuple[Any, ...]], result: int) -> Any:
    def builder(x):  # type: ignore[no-untyped-def]
        refs: list[Any] = []

        def arg(src: tuple[Any, ...]) -> Any:
            if src[0] == "ref":
                return refs[src[1]]
            if src[0] == "lit":
                return src[1]
            return x

        for index, node in enumerate(spec):
            shape = node[0]
            if shape == "lit":
                ref = ident(node[1], node_id=f"n{index}")
            elif shape == "inp":
                ref = ident(x, node_id=f"n{index}")
            elif shape == "wrap":
                ref = wrap.named(f"n{index}")(arg(node[1]))
            elif shape == "tolist":
                ref = to_list(arg(node[1]), node_id=f"n{index}")
            elif shape == "pack":
                ref = pack(*[arg(s) for s in node[1]], node_id=f"n{index}")
            elif shape == "star":
                ref = star(*[arg(s) for s in node[1]], node_id=f"n{index}")
            elif shape == "array":
                items = [refs[i] for i in node[1]]
                ref = listsum(tuple(items) if node[2] else items, node_id=f"n{index}")
            elif shape == "fan":
                ref = for_each(item, over=arg(node[1]), node_id=f"n{index}")
            elif shape == "child":
                wf = CHILD_OF[node[2]]
                given_input = node[1]
                value = [refs[i] for i in given_input[1]] if given_input[0] == "refs" else None
                ref = child(wf, value if value is not None else arg(given_input)).named(f"n{index}")
            else:
                wf = CHILD_OF[node[2]]
                ref = for_each(wf, over=arg(node[1]), node_id=f"n{index}")
            refs.append(ref)
        if result >= 0:
            define_result(refs[result])
            return None
        return refs[-1]

    builder.__name__ = f"wfe_prog_{next(names)}"
    return workflow(builder)


def evaluate(spec: list[tuple[Any, ...]], run_input: Any) -> list[Any]:
    """Every node's output, computed by calling the same functions directly."""
    values: list[Any] = []
    inp = stored(run_input)

    def arg(src: tuple[Any, ...]) -> Any:
        if src[0] == "ref":
            return values[src[1]]
        if src[0] == "lit":
            return src[1]
        return inp

    for node in spec:
        shape = node[0]
        if shape == "lit":
            out = ident.fn(node[1])
        elif shape == "inp":
            out = ident.fn(inp)
        elif shape == "wrap":
            out = wrap.fn(arg(node[1]))
        elif shape == "tolist":
            out = to_list.fn(arg(node[1]))
        elif shape == "pack":
            out = pack.fn(*[arg(s) for s in node[1]])
        elif shape == "star":
            out = star.fn(*[arg(s) for s in node[1]])
        elif shape == "array":
            out = listsum.fn([values[i] for i in node[1]])
        elif shape == "fan":
            out = [item.fn(stored(v)) for v in arg(node[1])]
        elif shape == "child":
            given_input = node[1]
            value = (
                [values[i] for i in given_input[1]]
                if given_input[0] == "refs"
                else arg(given_input)
            )
            out = direct_child(node[2], stored(value))
        else:
            outs = [direct_child(node[2], stored(v)) for v in arg(node[1])]
            out = outs if node[2] else None
        values.append(stored(out))
    return values


# ---------------------------------------------------------------------------- the property

started: set[int] = set()


@given(program=programs(), how=st.sampled_from(["submit", "submit_many", "submit_tx"]))
@settings(max_examples=25, deadline=None)
def test_random_programs_give_what_python_gives(
    client: Client,
    start_worker: StartWorker,
    cyclone_dsn: str,
    program: tuple[list[tuple[Any, ...]], Any, int],
    how: str,
) -> None:
    if id(start_worker) not in started:  # one worker for every example of this test
        started.add(id(start_worker))
        start_worker(*HANDLERS, *CHILDREN, concurrency=8)
    spec, run_input, result = program
    wf = build(spec, result)
    expected = evaluate(spec, run_input)
    if how == "submit":
        handle = client.submit(wf, run_input)
    elif how == "submit_many":
        handle = client.submit_many(wf, [run_input])[0]
    else:
        with psycopg.connect(cyclone_dsn) as conn:
            handle = client.submit_tx(conn, wf, run_input)
            conn.commit()
    got = handle.result(timeout=30)
    want = expected[result]
    assert same(got, want), (got, want)
    run = handle.get()
    assert run.state is RunState.COMPLETED
    for index, value in enumerate(expected):
        row = run.step(f"n{index}")
        assert row.state is StepState.COMPLETED
        assert same(row.output, value), (f"n{index}", row.output, value)


# ---------------------------------------------------------------------------- fixed shapes

FALSY = [None, False, 0, 0.0, "", [], {}, [[]], {"": {}}, [None], {"k": None}]


@workflow(name="wfe_falsy")
def falsy_flow(x):  # type: ignore[no-untyped-def]
    a = ident(x)
    b = wrap(a)
    c = pack(a, x, [], {})
    d = listsum([a, a, b])
    e = star(a, None, False, 0)
    f = child(child_res, a)
    g = child(child_res, [a, b])
    return listsum([a, b, c, d, e, f, g])


def direct_falsy(x: Any) -> Any:
    a = stored(ident.fn(x))
    b = stored(wrap.fn(a))
    c = stored(pack.fn(a, x, [], {}))
    d = stored(listsum.fn([a, a, b]))
    e = stored(star.fn(a, None, False, 0))
    f = direct_child(1, a)
    g = direct_child(1, stored([a, b]))
    return stored(listsum.fn([a, b, c, d, e, f, g]))


def test_falsy_and_empty_values_go_through_every_binding(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, *CHILDREN, concurrency=8)
    handles = [(x, client.submit(falsy_flow, x)) for x in FALSY]
    for x, handle in handles:
        got = handle.result(timeout=30)
        assert same(got, direct_falsy(x)), (x, got)


EXTREMES = [
    2**63 - 1,
    -(2**63),
    1e16,
    1e19,
    1.7976931348623157e308,
    5e-324,
    -0.0,
    "🦀 é\u2028\u0301 ﬁ",
    {"ключ": ["值", {"🦀": 1}]},
    ("t", ("u",)),
]


@workflow(name="wfe_extremes")
def extremes_flow(x):  # type: ignore[no-untyped-def]
    a = ident(x)
    return pack(a, wrap(a), x, listsum([a]))


@pytest.mark.parametrize("how", ["submit", "submit_many"])
def test_extreme_values_round_trip_as_documented(
    how: str, client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    if how == "submit":
        handles = [client.submit(extremes_flow, x) for x in EXTREMES]
    else:
        handles = client.submit_many(extremes_flow, list(EXTREMES))
    for x, handle in zip(EXTREMES, handles, strict=True):
        a = stored(x)
        want = stored(pack.fn(a, wrap.fn(a), x, listsum.fn([a])))
        got = handle.result(timeout=30)
        assert same(got, want), (x, got)


@workflow(name="wfe_reuse")
def reuse_flow(x):  # type: ignore[no-untyped-def]
    a = ident(x)
    b = ident(a)
    c = ident(b)
    first = wrap.named("first")
    d = first(c)
    e = wrap(c).named("second")
    f = wrap(c)
    wrap(c).named("wfe_wrap_2")  # an explicit id that a default id would take
    wrap(c)
    g = pack(a, b)
    h = pack(c, d, e, f)
    return listsum([g, h, a, a, f])


def test_the_same_step_used_many_times_and_named_copies(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    ids = {n.id for n in reuse_flow.graph.nodes}
    assert ids == {
        "wfe_ident",
        "wfe_ident_2",
        "wfe_ident_3",
        "first",
        "second",
        "wfe_wrap",
        "wfe_wrap_2",
        "wfe_wrap_3",
        "wfe_pack",
        "wfe_pack_2",
        "wfe_listsum",
    }
    handle = client.submit(reuse_flow, {"v": [1, (2, 3)]})
    x = stored({"v": [1, (2, 3)]})
    w = stored(wrap.fn(x))
    g = stored(pack.fn(x, x))
    h = stored(pack.fn(x, w, w, w))
    want = stored(listsum.fn([g, h, x, x, w]))
    assert same(handle.result(timeout=30), want)
    run = handle.get()
    assert same(run.step("first").output, w)
    assert same(run.step("second").output, w)
    assert same(run.step("wfe_wrap_3").output, w)


@workflow(name="wfe_defaults")
def defaults_flow(x):  # type: ignore[no-untyped-def]
    one = pack(x)
    two_args = pack(x, one)
    three = pack(ident(x), 0, None)
    none = star()
    const = pack(None, None)
    return listsum([one, two_args, three, none, const])


def test_default_arguments_and_star_args(client: Client, start_worker: StartWorker) -> None:
    start_worker(*HANDLERS)
    x = {"a": (1,)}
    one = stored(pack.fn(stored(x)))
    want = stored(
        listsum.fn(
            [
                one,
                stored(pack.fn(stored(x), one)),
                stored(pack.fn(stored(x), 0, None)),
                stored(star.fn()),
                stored(pack.fn(None, None)),
            ]
        )
    )
    assert same(client.submit(defaults_flow, x).result(timeout=30), want)


@workflow(name="wfe_none_result")
def none_result_flow(x):  # type: ignore[no-untyped-def]
    ident(x)
    return nothing()


@workflow(name="wfe_no_result")
def no_result_flow(x):  # type: ignore[no-untyped-def]
    ident(x)


def test_a_result_that_is_none_is_none_and_no_result_is_nooutput(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    assert client.submit(none_result_flow, 1).result(timeout=30) is None
    handle = client.submit(no_result_flow, 1)
    with pytest.raises(NoOutput):
        handle.result(timeout=30)


@workflow(name="wfe_fan_mix")
def fan_mix(x):  # type: ignore[no-untyped-def]
    over_input = for_each(item, over=x)
    over_literal = for_each(item, over=[None, [], {}, {"k": [None]}, ("t",), 0, False, ""])
    over_empty = for_each(item, over=[])
    over_output = for_each(wrap, over=to_list(ident(x)))
    children = for_each(child_res, over=over_output)
    quiet = for_each(child_quiet, over=x)
    nested = child(child_res, [over_input, over_empty, quiet])
    return pack(listsum([over_input, over_literal, over_empty]), children, nested, quiet)


def direct_fan_mix(x: Any) -> Any:
    x = stored(x)
    over_input = stored([item.fn(v) for v in x])
    over_literal = stored(
        [item.fn(v) for v in stored([None, [], {}, {"k": [None]}, ("t",), 0, False, ""])]
    )
    over_empty: list[Any] = []
    over_output = stored([wrap.fn(v) for v in stored(to_list.fn(x))])
    children = [direct_child(1, v) for v in over_output]
    quiet = None
    nested = direct_child(1, stored([over_input, over_empty, quiet]))
    return stored(
        pack.fn(listsum.fn([over_input, over_literal, over_empty]), children, nested, quiet)
    )


@pytest.mark.parametrize(
    "x", [[], [None], [{"a": 1}, [2, [3]], None, "é"], [[], {}, 0, False, ""], list(range(12))]
)
def test_for_each_over_inputs_outputs_literals_and_child_workflows(
    x: Any, client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, *CHILDREN, concurrency=8)
    got = client.submit(fan_mix, x).result(timeout=30)
    assert same(got, direct_fan_mix(x)), got


@workflow(name="wfe_child_inputs")
def child_inputs(x):  # type: ignore[no-untyped-def]
    a = ident(x)
    return listsum(
        [
            child(child_res, None),
            child(child_res),
            child(child_res, 0),
            child(child_res, False),
            child(child_res, ""),
            child(child_res, x),
            child(child_res, (a, a)),
            child(child_res, {"lit": [1, (2,)]}),
        ]
    )


def test_child_inputs_literal_falsy_and_nested(client: Client, start_worker: StartWorker) -> None:
    start_worker(*HANDLERS, *CHILDREN, concurrency=8)
    x = {"deep": [{"x": None}]}
    a = stored(x)
    want = stored(
        listsum.fn(
            [
                direct_child(1, v)
                for v in [None, None, 0, False, "", a, [a, a], stored({"lit": [1, (2,)]})]
            ]
        )
    )
    assert same(client.submit(child_inputs, x).result(timeout=30), want)


@workflow(name="wfe_key_order")
def key_order_flow(x):  # type: ignore[no-untyped-def]
    return keys_of(ident(x))


def test_a_dicts_keys_reach_the_next_step_in_jsonbs_order(
    client: Client, start_worker: StartWorker
) -> None:
    """Documented (runs-and-steps.md): objects come back with their keys in jsonb's order,
    shorter keys first, then by bytes; the dict is equal, its key order is not kept."""
    start_worker(*HANDLERS)
    x = {"zebra": 1, "b": 2, "aa": 3, "ab": 4}
    handle = client.submit(key_order_flow, x)
    assert handle.result(timeout=30) == ["b", "aa", "ab", "zebra"]
    assert handle.get().step("wfe_ident").output == x


@step(name="wfe_deep", max_attempts=3)
def deep(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


@workflow(name="wfe_deep_flow")
def deep_flow(depth):  # type: ignore[no-untyped-def]
    return deep(depth)


@pytest.mark.parametrize(("depth", "ends"), [(255, "completed"), (300, "failed")])
def test_an_output_nested_past_256_levels_fails_its_step_at_once(
    client: Client, start_worker: StartWorker, depth: int, ends: str
) -> None:
    """Documented (runs-and-steps.md): values nest at most 256 levels deep; a deeper output
    fails its step for good with invalid_output (a retry would return it again)."""
    start_worker(deep)
    run = client.submit(deep_flow, depth).wait(timeout=30)
    assert run.state.value == ends
    if ends == "failed":
        failed = run.step("wfe_deep")
        assert (failed.error_kind, failed.attempt) == ("invalid_output", 1)


# ---------------------------------------------------------------------------- refused shapes


def _wf(body: Callable[[Any], Any]) -> Any:
    def builder(x):  # type: ignore[no-untyped-def]
        return body(x)

    builder.__name__ = f"wfe_bad_{next(names)}"
    return workflow(builder)


def _define_two(x: Any) -> Any:
    define_result(ident(x))
    return ident(x)


REFUSED: list[tuple[str, Callable[[Any], Any], type[Exception]]] = [
    ("ref in a dict literal", lambda x: wrap({"k": ident(x)}), InvalidGraph),
    ("ref in a nested list", lambda x: wrap([[ident(x)], ident(x)]), InvalidGraph),
    ("list of a ref and a literal", lambda x: listsum([ident(x), 1]), InvalidGraph),
    ("list in a tuple call", lambda x: two(ident(x), [ident(x)]), InvalidGraph),
    ("tuple literal holding a ref", lambda x: two((ident(x),), 1), InvalidGraph),
    ("run input in a dict literal", lambda x: wrap({"k": x}), InvalidGraph),
    ("ref as a dict key", lambda x: wrap({ident(x): 1}), InvalidGraph),
    ("keyword input", lambda x: wrap(x=ident(x)), InvalidGraph),
    ("five arguments", lambda x: star(*[ident(x)] * 5), InvalidGraph),
    ("too many arguments", lambda x: two(x, x, x), InvalidGraph),
    ("too few arguments", lambda x: two(x), InvalidGraph),
    ("NaN literal", lambda x: wrap(float("nan")), InvalidGraph),
    ("NUL literal", lambda x: wrap("a\x00b"), InvalidGraph),
    ("int beyond 64 bits", lambda x: wrap(2**63), InvalidGraph),
    ("set literal", lambda x: wrap({1, 2}), InvalidGraph),
    ("define_result of a list", lambda x: define_result([ident(x)]), InvalidGraph),
    ("return a dict", lambda x: {"r": ident(x)}, InvalidGraph),
    ("return a tuple", lambda x: (ident(x), ident(x)), InvalidGraph),
    ("return a literal", lambda x: (ident(x), 5)[1], InvalidGraph),
    ("define_result and return differ", _define_two, InvalidGraph),
    ("result is an action", lambda x: act(x), InvalidGraph),
    ("for_each over a list of refs", lambda x: for_each(item, over=[ident(x)]), InvalidGraph),
    ("for_each over a dict", lambda x: for_each(item, over={"a": 1}), InvalidGraph),
    ("for_each over a string", lambda x: for_each(item, over="ab"), InvalidGraph),
    ("for_each two-argument handler", lambda x: for_each(two, over=x), InvalidGraph),
    ("child input dict with ref", lambda x: child(child_res, {"k": ident(x)}), InvalidGraph),
    ("duplicate named copy", lambda x: [wrap.named("d")(x), wrap.named("d")(x)][0], InvalidGraph),
    ("arithmetic on a ref", lambda x: wrap(ident(x) + 1), BuildTimeValue),
    ("f-string of a ref", lambda x: wrap(f"{ident(x)}"), BuildTimeValue),
    ("indexing a ref", lambda x: wrap(ident(x)["k"]), BuildTimeValue),
]


@pytest.mark.parametrize(("body", "error"), [pytest.param(b, e, id=n) for n, b, e in REFUSED])
def test_refused_shapes_raise_a_typed_error_and_write_nothing(
    body: Callable[[Any], Any], error: type[Exception], client: Client, cyclone_dsn: str
) -> None:
    wf = _wf(body)
    with pytest.raises(error):
        client.submit(wf, [1])
    with pytest.raises(error):
        client.submit_many(wf, [[1], [2]])
    with psycopg.connect(cyclone_dsn) as conn, pytest.raises(error):
        client.submit_tx(conn, wf, [1])
    with pytest.raises(error):
        _ = wf.graph
    assert counts(cyclone_dsn) == (0, 0)
