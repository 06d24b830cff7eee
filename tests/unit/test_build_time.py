"""What a builder may and may not do with its references, and the messages it gets (no database).

A ``@workflow`` builder runs once, to record a graph: the run input and node
outputs it sees are references with no value. Every operation that would
need the value raises :class:`BuildTimeValue` at once; calls whose shape does
not fit the handler are reported in :class:`InvalidGraph` with the node id.
"""

from __future__ import annotations

import copy
import operator
import pickle
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given, settings

from cyclone_dsl import InvalidGraph, action, for_each, step, wait_any, wait_signal, workflow
from cyclone_dsl.dsl.builder import Builder, BuildTimeRef, NodeRef, RunInputRef
from cyclone_dsl.dsl.registry import default_registry
from cyclone_dsl.errors import BuildTimeValue, CycloneError
from cyclone_dsl.graph.model import Graph
from cyclone_dsl.graph.validate import validate
from cyclone_dsl.testing.strategies import graphs, invalid_graphs
from tests.unit import flows


def invalid(definition: object) -> InvalidGraph:
    with pytest.raises(InvalidGraph) as caught:
        _ = definition.graph  # type: ignore[attr-defined]
    return caught.value


# -- 1. an empty workflow ----------------------------------------------------------------


def test_an_empty_workflow_is_refused_when_its_graph_is_built() -> None:
    @workflow(name="bt_empty")
    def empty(x):  # type: ignore[no-untyped-def]
        return None

    error = invalid(empty)
    assert "needs at least one node" in str(error)
    assert error.workflow == "bt_empty"


def test_an_empty_workflow_without_a_parameter_is_refused_too() -> None:
    @workflow(name="bt_empty_no_param")
    def empty():  # type: ignore[no-untyped-def]
        pass

    assert "needs at least one node" in str(invalid(empty))


def test_an_empty_graph_does_not_validate() -> None:
    with pytest.raises(InvalidGraph, match="needs at least one node"):
        validate(Graph("bt_bare", ()))


def test_building_stays_lazy_so_a_builder_may_use_a_step_defined_later() -> None:
    @workflow(name="bt_lazy")
    def lazy(x):  # type: ignore[no-untyped-def]
        return later(x)  # defined below: fine, the builder has not run yet

    @step(name="bt_later")
    def later(x: int) -> int:
        return x

    assert [n.id for n in lazy.graph.nodes] == ["bt_later"]


@given(graphs())
@settings(max_examples=100)
def test_the_graph_strategy_never_draws_an_empty_graph(graph: Graph) -> None:
    assert graph.nodes
    validate(graph)


@given(invalid_graphs())
@settings(max_examples=50)
def test_the_invalid_graph_strategy_never_draws_an_empty_graph(case: tuple[Graph, str]) -> None:
    assert case[0].nodes


# -- 2. references have no value at build time -------------------------------------------


@step(name="bt_fetch")
def fetch(order_id: str) -> dict[str, object]:
    return {"id": order_id}


@action(name="bt_send")
def send(text: str) -> None:
    return None


def refused_in_builder(operation: Callable[[Any], object], *, on: str) -> BuildTimeValue:
    """Run ``operation`` on the run input (``on="input"``) or on a node output inside a builder."""
    caught: list[BuildTimeValue] = []

    @workflow(name=f"confirm_{len(registry_names)}")
    def confirm(order_id):  # type: ignore[no-untyped-def]
        target = order_id if on == "input" else fetch(order_id)
        try:
            operation(target)
        except BuildTimeValue as exc:
            caught.append(exc)
        return fetch(order_id)

    registry_names.append(confirm.name)
    _ = confirm.graph
    assert caught, "the operation did not raise BuildTimeValue"
    return caught[0]


registry_names: list[str] = []


def _if(ref: Any) -> object:
    if ref:
        return 1
    return 0


def _iterate(ref: Any) -> object:
    for item in ref:
        return item
    return None


def _unpack(ref: Any) -> object:
    first, _second = ref
    return first


def _attribute(ref: Any) -> object:
    return ref.id


OPERATIONS: list[tuple[str, Callable[[Any], object], str]] = [
    ("f-string", lambda r: f"Order {r}", "f-string"),
    ("format", lambda r: format(r, ">10"), "format()"),
    ("str", str, "str()"),
    ("if", _if, "if"),
    ("bool", bool, "bool()"),
    ("not", operator.not_, "not"),
    ("iter", _iterate, "iterat"),
    ("unpack", _unpack, "iterat"),
    ("list", list, "iterat"),
    ("len", len, "len()"),
    ("contains", lambda r: "x" in r, "`in`"),
    ("getitem", lambda r: r["id"], "['id']"),
    ("int", int, "int()"),
    ("float", float, "float()"),
    ("index", lambda r: [1, 2, 3][r], "index"),
    ("lt", lambda r: r < 3, "<"),
    ("le", lambda r: r <= 3, "<="),
    ("gt", lambda r: r > 3, ">"),
    ("ge_reflected", lambda r: operator.ge(3, r), "<="),
    ("ge", lambda r: r >= 3, ">="),
    ("eq", lambda r: r == "x", "=="),
    ("eq_reflected", lambda r: operator.eq("x", r), "=="),
    ("ne", lambda r: r != "x", "!="),
    ("add", lambda r: r + 1, "+"),
    ("radd_str", lambda r: "Order " + r, "+"),
    ("sub", lambda r: r - 1, "-"),
    ("rsub", lambda r: 10 - r, "-"),
    ("mul", lambda r: r * 2, "*"),
    ("rmul", lambda r: 2 * r, "*"),
    ("rmul_str", lambda r: "ab" * r, "*"),
    ("truediv", lambda r: r / 2, "/"),
    ("rtruediv", lambda r: 2 / r, "/"),
    ("mod", lambda r: r % 2, "%"),
    ("rmod", lambda r: 7 % r, "%"),
    ("attribute", _attribute, ".id"),
    ("method", lambda r: r.get("id"), ".get"),
]


@pytest.mark.parametrize("on", ["input", "node"])
@pytest.mark.parametrize(
    ("label", "operation", "named"), OPERATIONS, ids=[o[0] for o in OPERATIONS]
)
def test_every_value_operation_on_a_reference_raises_build_time_value(
    on: str, label: str, operation: Callable[[Any], object], named: str
) -> None:
    error = refused_in_builder(operation, on=on)
    assert isinstance(error, TypeError)
    assert isinstance(error, CycloneError)
    message = str(error)
    assert named in message, message
    if on == "input":
        assert "the run input of workflow 'confirm_" in message, message
    else:
        assert "the output of node 'bt_fetch'" in message, message
    assert "once" in message and "not once per run" in message, message
    assert "inside a step" in message or "inside the step" in message, message


def test_the_f_string_of_the_user_report_is_refused_with_its_fix() -> None:
    caught: list[BuildTimeValue] = []

    @workflow(name="confirm")
    def confirm(order_id):  # type: ignore[no-untyped-def]
        try:
            send(f"Order {order_id}")
        except BuildTimeValue as exc:
            caught.append(exc)
        return fetch(order_id)

    _ = confirm.graph
    (error,) = caught
    message = str(error)
    assert message.startswith("cannot use the run input of workflow 'confirm' in an f-string")
    assert "pass the reference to a step" in message.lower()


def test_if_on_a_reference_suggests_a_step_or_a_child_workflow() -> None:
    error = refused_in_builder(_if, on="input")
    assert "branch inside a step" in str(error).lower()
    assert "child workflow" in str(error)


def test_a_build_time_error_propagates_out_of_the_build() -> None:
    @workflow(name="bt_propagates")
    def wf(order_id):  # type: ignore[no-untyped-def]
        return send(f"Order {order_id}")

    try:
        with pytest.raises(BuildTimeValue, match="f-string"):
            _ = wf.graph
        with pytest.raises(BuildTimeValue, match="f-string"):
            _ = wf.graph  # not cached: every use raises again
    finally:
        # A worker of this process builds every registered workflow: leave none that raises.
        del default_registry().workflows["bt_propagates"]


def test_repr_hash_and_identity_keep_working() -> None:
    seen: dict[str, object] = {}

    @workflow(name="bt_repr")
    def wf(order_id):  # type: ignore[no-untyped-def]
        order = fetch(order_id)
        seen["input"] = order_id
        seen["node"] = order
        seen["repr"] = (repr(order_id), repr(order), f"{order!r}")
        seen["hash"] = {order_id: 1, order: 2}
        seen["is"] = order is order and order_id is not order
        return order

    _ = wf.graph
    node_repr = "<ref bt_fetch of bt_repr>"
    assert seen["repr"] == ("<run input of bt_repr>", node_repr, node_repr)
    assert seen["hash"] == {seen["input"]: 1, seen["node"]: 2}
    assert seen["is"] is True
    assert isinstance(seen["input"], BuildTimeRef)
    assert isinstance(seen["node"], BuildTimeRef)


def test_dunder_and_private_attributes_stay_plain_attribute_errors() -> None:
    builder = Builder("bt_plain")
    ref = RunInputRef(builder)
    node = builder.add("n", "n", ())
    for value in (ref, node):
        assert not hasattr(value, "__deepcopy_me__")
        assert not hasattr(value, "_private")
        assert getattr(value, "__wrapped__", None) is None
        with pytest.raises(AttributeError) as caught:
            value._secret  # type: ignore[union-attr]  # noqa: B018
        assert not isinstance(caught.value, BuildTimeValue)
        twin = copy.copy(value)
        assert repr(twin) == repr(value)
        deep = copy.deepcopy(value)
        assert repr(deep) == repr(value)
    assert repr(attrs.evolve(node)) == repr(node)
    restored = pickle.loads(pickle.dumps(ref))
    assert repr(restored) == repr(ref)
    assert isinstance(node, NodeRef)
    assert node.named("x") is node


def test_the_library_never_compares_references_with_eq() -> None:
    """Lists of references, after=, array mode, define_result, for_each and child all build."""
    graph = flows.orders.graph
    assert graph.result == "u_summarize"
    parent = flows.parent.graph
    assert parent.result == "u_orders"

    @workflow(name="bt_many_refs")
    def many(x):  # type: ignore[no-untyped-def]
        a = flows.ship(x)
        b = flows.ship(a)
        c = flows.ship(b, after=[a, b, a])
        flows.notify(flows.summarize([a, b, c, a]), after=(c, b))
        lines = for_each(flows.ship, over=flows.lines(a), after=[a, c])
        return flows.summarize([lines, c])

    built = many.graph
    assert built.node("u_ship_3").control_deps == ("u_ship", "u_ship_2")


# -- 3. clearer messages -----------------------------------------------------------------


@step(name="bt_charge")
def charge(order: dict[str, object]) -> str:
    return "charged"


@step(name="bt_pay")
def pay(order: dict[str, object], total: int) -> str:
    return "paid"


def test_keyword_inputs_get_a_message_that_explains_positional_inputs() -> None:
    @workflow(name="bt_keywords")
    def wf(x):  # type: ignore[no-untyped-def]
        o = fetch(x)
        t = fetch(x)
        return pay(order=o, total=t)

    error = invalid(wf)
    text = str(error)
    assert "inside a @workflow, a step's inputs are passed positionally" in text
    assert "bt_pay(order, total)" in text
    assert "keyword arguments are node options" in text
    for option in ("after", "node_id", "queue", "max_attempts", "timeout"):
        assert option in text
    assert "'order', 'total' are not options" in text
    assert "unknown option" not in text
    assert "bt_pay" in error.node_ids


def test_one_unknown_keyword_is_not_an_option() -> None:
    @workflow(name="bt_keyword")
    def wf(x):  # type: ignore[no-untyped-def]
        return charge(x, retries=3)

    text = str(invalid(wf))
    assert "'retries' is not an option" in text
    assert "takes 1 positional" not in text  # no arity noise on top


def test_known_options_are_still_accepted_as_keywords() -> None:
    @workflow(name="bt_options_ok")
    def wf(x):  # type: ignore[no-untyped-def]
        first = charge(x, queue="q", node_id="first")
        return charge(x, after=[first], max_attempts=2)

    assert [n.id for n in wf.graph.nodes] == ["first", "bt_charge"]


def test_too_many_arguments_are_reported_with_the_node() -> None:
    @workflow(name="bt_arity_many")
    def wf(x):  # type: ignore[no-untyped-def]
        o = fetch(x)
        return charge(o, x)

    error = invalid(wf)
    assert "handler 'bt_charge' takes 1 positional argument (order), but the workflow passes 2" in (
        str(error)
    )
    assert error.node_ids == ("bt_charge",)


def test_too_few_arguments_are_reported_with_the_node() -> None:
    @workflow(name="bt_arity_few")
    def wf(x):  # type: ignore[no-untyped-def]
        return pay(fetch(x)).named("paying")

    error = invalid(wf)
    assert (
        "handler 'bt_pay' takes 2 positional arguments (order, total), but the workflow passes 1"
        in str(error)
    )
    assert error.node_ids == ("paying",)


def test_a_list_is_one_argument_and_no_argument_is_zero() -> None:
    @step(name="bt_none")
    def nothing() -> int:
        return 1

    @workflow(name="bt_arity_list")
    def wf(x):  # type: ignore[no-untyped-def]
        a = fetch(x)
        pay([a, a])  # array mode: one argument
        nothing(a)
        return charge()

    text = str(invalid(wf))
    assert (
        "handler 'bt_pay' takes 2 positional arguments (order, total), but the workflow passes 1"
        in (text)
    )
    assert "handler 'bt_none' takes no positional argument, but the workflow passes 1" in text
    assert "handler 'bt_charge' takes 1 positional argument (order), but the workflow passes 0" in (
        text
    )


def test_fitting_calls_build_ctx_defaults_and_star_args() -> None:
    @step(name="bt_ctx")
    def with_ctx(order: object, ctx: object = None) -> None:
        return None

    @step(name="bt_ctx_first")
    def ctx_keyword(order: object, *, ctx: object) -> None:
        return None

    @step(name="bt_defaults")
    def defaults(a: object, b: object = None, c: object = None) -> None:
        return None

    @step(name="bt_star")
    def star(*parts: object) -> None:
        return None

    @step(name="bt_nothing")
    def nothing(ctx: object) -> int:
        return 1

    @workflow(name="bt_arity_ok")
    def wf(x):  # type: ignore[no-untyped-def]
        a = nothing()
        with_ctx(a)
        ctx_keyword(x)
        defaults(a)
        defaults(a, x)
        defaults(a, x, "z")
        star()
        star(a)
        star(a, x, 1, 2)
        star([a, a])
        return for_each(with_ctx, over=a)

    assert len(wf.graph.nodes) == 11


def test_defaults_give_a_range_in_the_message() -> None:
    @step(name="bt_range")
    def ranged(a: object, b: object = None) -> None:
        return None

    @workflow(name="bt_arity_range")
    def wf(x):  # type: ignore[no-untyped-def]
        return ranged(x, x, x)

    assert "takes 1 to 2 positional arguments (a, b), but the workflow passes 3" in str(invalid(wf))


def test_a_for_each_handler_gets_one_argument() -> None:
    @step(name="bt_pair_item")
    def pair_item(a: object, b: object) -> None:
        return None

    @workflow(name="bt_arity_fan")
    def wf(x):  # type: ignore[no-untyped-def]
        return for_each(pair_item, over=fetch(x))

    error = invalid(wf)
    assert (
        "handler 'bt_pair_item' takes 2 positional arguments (a, b), but the workflow passes 1"
        in (str(error))
    )
    assert error.node_ids == ("bt_pair_item",)


def test_a_required_keyword_only_parameter_is_reported() -> None:
    @step(name="bt_kwonly")
    def kwonly(a: object, *, flag: bool) -> None:
        return None

    @workflow(name="bt_arity_kwonly")
    def wf(x):  # type: ignore[no-untyped-def]
        return kwonly(x)

    text = str(invalid(wf))
    assert "handler 'bt_kwonly' cannot be called with 1 positional argument" in text
    assert "flag" in text


def test_a_step_outside_a_builder_is_still_a_plain_call() -> None:
    assert pay({"id": 1}, total=3) == "paid"
    assert charge(order={"id": 1}) == "charged"


def test_a_reference_inside_a_literal_is_explained() -> None:
    @workflow(name="bt_nested")
    def wf(x):  # type: ignore[no-untyped-def]
        return charge({"order": fetch(x), "note": "n"})

    text = str(invalid(wf))
    assert "a reference inside a literal" in text
    assert "is not JSON" not in text


def test_references_where_build_time_strings_belong_are_reported() -> None:
    @workflow(name="bt_ref_names")
    def wf(x):  # type: ignore[no-untyped-def]
        wait_signal(x)
        wait_any(x)
        return charge(x).named(x)

    text = str(invalid(wf))
    assert (
        "signal names must be non-empty strings without NUL characters or lone surrogates, "
        "not <run input of bt_ref_names>" in text
    )
    assert "a node id is a string fixed when the workflow is built" in text
