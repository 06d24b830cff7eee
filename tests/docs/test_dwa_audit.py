"""Audit of the user documentation as a new user reads it (part A): docs/quickstart.md,
docs/workflows.md, docs/concepts/waits.md, docs/concepts/fan-out-and-children.md and the
usage parts of README.md.

Each test copies a page's sample (handlers renamed with the ``dwa_`` prefix) or checks one
of its claims through the public API, against the real database and a real worker.
tests/docs/test_docs.py already runs every example file; here the examples' *claims* are
checked (their output, the node ids, the states, the errors).
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    CycloneError,
    Delivery,
    InvalidArgument,
    InvalidGraph,
    MailboxFull,
    NodeRef,
    NoOutput,
    PassedDeadline,
    Permanent,
    Ref,
    RunFailed,
    RunState,
    SignalNotDeliverable,
    StepContext,
    StepState,
    Worker,
    action,
    child,
    define_result,
    for_each,
    migrate,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.errors import BuildTimeValue
from tests.waiting import wait_until

HOUR = timedelta(hours=1)
Clock = Callable[[datetime], None]
StartWorker = Callable[..., Worker]

CALLS: Counter[str] = Counter()
SEEN: dict[str, Any] = {}
_lock = threading.Lock()


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.clear()
    SEEN.clear()


def _count(tag: str) -> None:
    with _lock:
        CALLS[tag] += 1


# -- quickstart: examples/hello.py ---------------------------------------------------------


@step(name="dwa_greet")
def dwa_greet(name: str) -> str:
    return f"Hello, {name}"


@step(name="dwa_shout")
def dwa_shout(name: str) -> str:
    return name.upper() + "!"


@step(name="dwa_combine")
def dwa_combine(greeting: str, shouted: str) -> str:
    return f"{greeting} ({shouted})"


@workflow(name="dwa_hello")
def dwa_hello(name: Ref[str]) -> NodeRef[str]:
    return dwa_combine(dwa_greet(name), dwa_shout(name))


def test_quickstart_steps_called_outside_a_workflow_are_plain_functions() -> None:
    assert dwa_greet("Ada") == "Hello, Ada"
    assert dwa_combine("a", "b") == "a (b)"


def test_quickstart_hello_gives_the_joined_result_and_migrate_is_safe_to_repeat(
    cyclone_dsn: str, start_worker: StartWorker, client: Client
) -> None:
    migrate(cyclone_dsn)  # "safe to call on every start"
    migrate(cyclone_dsn)
    start_worker(dwa_greet, dwa_shout, dwa_combine)
    handle = client.submit(dwa_hello, "Ada")
    assert handle.result(timeout=30) == "Hello, Ada (ADA!)"
    run = client.get_run(handle.id)
    # greet and shout ran in parallel, then the join
    assert {s.node for s in run.steps} == {"dwa_greet", "dwa_shout", "dwa_combine"}


# -- README: "What it looks like" ----------------------------------------------------------


@step(max_attempts=3, timeout=timedelta(seconds=30), name="dwa_fetch")
def dwa_fetch(order_id: str) -> dict[str, object]:
    return {"id": order_id, "total": 42}


@step(name="dwa_charge")
def dwa_charge(order: dict[str, object]) -> dict[str, object]:
    return {"charged": order["total"]}


@workflow(name="dwa_orders")
def dwa_orders(order_id: Ref[str]) -> NodeRef[dict[str, object]]:
    return dwa_charge(dwa_fetch(order_id))


def test_readme_sample_prints_the_charge_and_keeps_the_step_options(
    cyclone_dsn: str, client: Client
) -> None:
    with Worker(cyclone_dsn, [dwa_fetch, dwa_charge], poll_interval=0.2):
        handle = client.submit(dwa_orders, "o-1")
        assert handle.result(timeout=10) == {"charged": 42}
    fetch = client.get_run(handle.id).step("dwa_fetch")
    assert fetch.max_attempts == 3
    assert fetch.state is StepState.COMPLETED


# -- workflows.md: options and their defaults ----------------------------------------------


@step(name="dwa_echo")
def dwa_echo(value: object) -> object:
    return value


@workflow(name="dwa_echo_wf")
def dwa_echo_wf(value: Ref[object]) -> NodeRef[object]:
    return dwa_echo(value)


def test_workflows_option_defaults_are_as_the_table_says(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_echo)
    handle = client.submit(dwa_echo_wf, {"a": 1})
    assert handle.result(timeout=10) == {"a": 1}
    echo = client.get_run(handle.id).step("dwa_echo")
    assert (echo.max_attempts, echo.queue, echo.priority) == (5, "default", 0)
    assert echo.kind == "dwa_echo"  # the handler kind stored is name=


@step(name="dwa_ctx_probe")
def dwa_ctx_probe(value: object, ctx: StepContext) -> dict[str, object]:
    return {
        "run_id": ctx.run_id,
        "node": ctx.node,
        "kind": ctx.kind,
        "workflow": ctx.workflow,
        "def_version": ctx.def_version,
        "attempt": ctx.attempt,
        "max_attempts": ctx.max_attempts,
        "deadline": None if ctx.deadline is None else ctx.deadline.isoformat(),
        "item_index": ctx.item_index,
        "idempotency_key": ctx.idempotency_key,
        "step_id": ctx.step_id,
    }


@workflow(name="dwa_ctx_wf")
def dwa_ctx_wf(value: Ref[object]) -> NodeRef[dict[str, object]]:
    return dwa_ctx_probe(value, max_attempts=2)


def test_workflows_step_context_fields(start_worker: StartWorker, client: Client) -> None:
    start_worker(dwa_ctx_probe)
    handle = client.submit(dwa_ctx_wf, 1)
    seen = handle.result(timeout=10)
    run = client.get_run(handle.id)
    assert isinstance(seen, dict)
    assert seen["run_id"] == handle.id
    assert seen["node"] == "dwa_ctx_probe"
    assert seen["kind"] == "dwa_ctx_probe"
    assert seen["workflow"] == "dwa_ctx_wf"
    assert seen["def_version"] == run.def_version
    assert seen["attempt"] == 1  # "this execution's number, from 1"
    assert seen["max_attempts"] == 2
    assert seen["deadline"] is None
    assert seen["item_index"] is None
    assert seen["idempotency_key"] == f"{handle.id}:dwa_ctx_probe"
    assert seen["step_id"] == run.step("dwa_ctx_probe").id


@step(name="dwa_flaky_ctx")
def dwa_flaky_ctx(value: object, ctx: StepContext) -> list[object]:
    _count(f"flaky:{ctx.attempt}")
    with _lock:
        SEEN.setdefault("keys", []).append(ctx.idempotency_key)
    if ctx.attempt < 2:
        raise RuntimeError("first attempt fails")
    return [ctx.attempt, ctx.idempotency_key]


@workflow(name="dwa_flaky_wf")
def dwa_flaky_wf(value: Ref[object]) -> NodeRef[list[object]]:
    return dwa_flaky_ctx(value)


def test_workflows_idempotency_key_is_stable_across_retries(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_flaky_ctx)  # the first retry waits 0.5-1 s of backoff
    handle = client.submit(dwa_flaky_wf, 1)
    assert handle.result(timeout=20) == [2, f"{handle.id}:dwa_flaky_ctx"]
    assert SEEN["keys"] == [f"{handle.id}:dwa_flaky_ctx"] * 2


@step(name="dwa_permanent", max_attempts=4)
def dwa_permanent(value: object) -> object:
    _count("permanent")
    raise Permanent("card declined")


@workflow(name="dwa_permanent_wf")
def dwa_permanent_wf(value: Ref[object]) -> NodeRef[object]:
    return dwa_permanent(value)


def test_workflows_permanent_fails_at_once_without_the_remaining_attempts(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_permanent)
    handle = client.submit(dwa_permanent_wf, 1)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.node == "dwa_permanent"
    assert failed.value.error_kind == "permanent"
    assert CALLS["permanent"] == 1
    assert client.get_run(handle.id).step("dwa_permanent").state is StepState.DISCARDED


@action(name="dwa_act")
def dwa_act(value: object) -> dict[str, object]:
    _count("act")
    return {"dropped": value}


@workflow(name="dwa_act_wf")
def dwa_act_wf(value: Ref[object]) -> None:
    dwa_act(value)


def test_workflows_action_output_is_not_kept_and_a_workflow_without_result_raises_no_output(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_act)
    handle = client.submit(dwa_act_wf, 7)
    with pytest.raises(NoOutput):
        handle.result(timeout=10)
    run = client.get_run(handle.id)
    assert run.state is RunState.COMPLETED
    assert run.step("dwa_act").output is None
    assert CALLS["act"] == 1


# -- workflows.md: how arguments travel ----------------------------------------------------


@step(name="dwa_args")
def dwa_args(*values: object) -> list[object]:
    return list(values)


@step(name="dwa_one")
def dwa_one(value: object) -> object:
    return value


@step(name="dwa_constant")
def dwa_constant() -> str:
    return "const"


@step(name="dwa_pair")
def dwa_pair(a: object, b: object) -> list[object]:
    return [a, b]


@step(name="dwa_gather")
def dwa_gather(parts: list[object]) -> list[object]:
    return parts


@workflow(name="dwa_travel")
def dwa_travel(order_id: Ref[str]) -> NodeRef[list[object]]:
    static = dwa_one(order_id)  # the run input: static input
    literal = dwa_one("x")  # a literal
    upstream = dwa_one(static)  # one reference: the upstream output
    pair = dwa_pair(static, literal)  # 2 arguments: tuple binding
    const = dwa_constant(node_id="dwa_constant")  # no argument
    return dwa_gather([upstream, pair, const])  # a list of references: a list, in order


def test_workflows_arguments_travel_as_the_table_says(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_one, dwa_constant, dwa_pair, dwa_gather)
    handle = client.submit(dwa_travel, "o-9")
    assert handle.result(timeout=10) == ["o-9", ["o-9", "x"], "const"]
    run = client.get_run(handle.id)
    assert run.step("dwa_one").input == "o-9"
    assert run.step("dwa_one_2").input == "x"
    assert run.step("dwa_one_3").input_from == "dwa_one"


@step(name="dwa_charge1")
def dwa_charge1(order: object) -> object:
    return order


def test_workflows_arity_mismatch_message_is_the_documented_one() -> None:
    @workflow(name="dwa_arity")
    def dwa_arity(o: Ref[object]) -> NodeRef[object]:
        return dwa_charge1(o, o)

    with pytest.raises(InvalidGraph) as bad:
        _ = dwa_arity.graph
    assert (
        "handler 'dwa_charge1' takes 1 positional argument (order), but the workflow passes 2"
        in str(bad.value)
    )
    assert bad.value.node_ids == ("dwa_charge1",)


def test_workflows_enqueue_refuses_what_the_handler_cannot_take(client: Client) -> None:
    with pytest.raises(InvalidArgument):
        client.enqueue(dwa_pair, [1, 2])
    with pytest.raises(InvalidArgument):
        client.enqueue(dwa_constant, 5)
    assert client.list_runs() == []  # "nothing written"


def test_workflows_enqueue_calls_a_no_argument_handler_with_none(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_constant, dwa_one)
    assert client.enqueue(dwa_constant).result(timeout=10) == "const"
    assert client.enqueue(dwa_one, {"k": [1]}).result(timeout=10) == {"k": [1]}


@pytest.mark.parametrize(
    "literal",
    [math.nan, "a\x00b", {1: "int key"}],
    ids=["nan", "nul", "int-key"],
)
def test_workflows_literals_must_be_json(literal: object) -> None:
    @workflow(name=f"dwa_literal_{abs(hash(repr(literal)))}")
    def dwa_literal(o: Ref[object]) -> NodeRef[object]:
        return dwa_one(literal)

    with pytest.raises(CycloneError):
        _ = dwa_literal.graph


# -- workflows.md: node ids ----------------------------------------------------------------


@workflow(name="dwa_invoice")
def dwa_invoice(order: Ref[object]) -> NodeRef[object]:
    return dwa_one(order)


@workflow(name="dwa_ids")
def dwa_ids(o: Ref[object]) -> None:
    a = dwa_one(o)
    dwa_one(a)
    wait_signal("approved")
    wait_any(["yes", "no"])
    wait_timer(HOUR)
    child(dwa_invoice, o)
    dwa_one(o).named("explicit")
    dwa_one.named("explicit_2")(o)
    for_each(dwa_one, over=a)


def test_workflows_node_ids_default_as_documented() -> None:
    ids = {node.id for node in dwa_ids.graph.nodes}
    assert {
        "dwa_one",
        "dwa_one_2",
        "approved",
        "any_yes_no",
        "timer",
        "dwa_invoice",
        "explicit",
        "explicit_2",
        "dwa_one_3",  # the for_each node
    } == ids


# -- workflows.md: what you can and cannot do in a builder ---------------------------------


def _loop_over(ref: Any) -> None:
    for _ in ref:  # `for x in ref`
        pass


def _unpack(ref: Any) -> None:
    a, b = ref  # `a, b = ref`
    del a, b


_BUILD_TIME_USES: dict[str, Callable[[Any], object]] = {
    "f-string": lambda r: f"Order {r}",
    "str": str,
    "format": format,
    "bool": bool,
    "if": lambda r: 1 if r else 0,
    "and": lambda r: r and 1,
    "not": lambda r: not r,
    "eq": lambda r: r == "x",
    "ne": lambda r: r != 1,
    "lt": lambda r: r < 3,
    "iter": lambda r: _loop_over(r),
    "unpack": lambda r: _unpack(r),
    "list": list,
    "len": len,
    "contains": lambda r: "k" in r,
    "getitem": lambda r: r["id"],
    "attr": lambda r: r.id,
    "get": lambda r: r.get("id"),
    "add": lambda r: r + 1,
    "radd": lambda r: "#" + r,
    "mul": lambda r: r * 2,
    "div": lambda r: r / 2,
    "mod": lambda r: r % 2,
    "int": int,
    "float": float,
    "index": lambda r: [1, 2][r],
    "and-cond": lambda r: r & r.truthy(),
    "invert": lambda r: ~r,
}


@pytest.mark.parametrize("use", sorted(_BUILD_TIME_USES))
@pytest.mark.parametrize("on", ["input", "node"])
def test_workflows_using_a_reference_as_a_value_raises_build_time_value(use: str, on: str) -> None:
    operation = _BUILD_TIME_USES[use]

    @workflow(name=f"dwa_btv_{use}_{on}")
    def dwa_btv(order_id: Ref[object]) -> NodeRef[object]:
        ref = order_id if on == "input" else dwa_one(order_id)
        operation(ref)
        return dwa_one(order_id)

    with pytest.raises(BuildTimeValue) as raised:
        _ = dwa_btv.graph
    assert isinstance(raised.value, TypeError)
    assert isinstance(raised.value, CycloneError)
    named = (
        f"the run input of workflow 'dwa_btv_{use}_{on}'"
        if on == "input"
        else "the output of node 'dwa_one'"
    )
    assert named in str(raised.value)


def test_workflows_repr_identity_and_hashing_of_references_keep_working() -> None:
    seen: dict[str, object] = {}

    @workflow(name="dwa_ref_ok")
    def dwa_ref_ok(o: Ref[object]) -> NodeRef[object]:
        a = dwa_one(o)
        b = dwa_one(o)
        seen["repr"] = repr(a)
        seen["is"] = (a is a, a is b)
        seen["dict"] = len({a: 1, b: 2, o: 3})
        return b

    _ = dwa_ref_ok.graph
    assert isinstance(seen["repr"], str)
    assert seen["is"] == (True, False)
    assert seen["dict"] == 3


def _problems(wf: Any) -> InvalidGraph:
    with pytest.raises(InvalidGraph) as bad:
        _ = wf.graph
    return bad.value


def test_workflows_keyword_inputs_refs_in_literals_and_empty_builders_are_invalid() -> None:
    @workflow(name="dwa_kw")
    def dwa_kw(o: Ref[object]) -> NodeRef[object]:
        return dwa_pair(a=o, b=o)  # type: ignore[call-arg]

    assert "positionally" in str(_problems(dwa_kw))

    @workflow(name="dwa_lit_ref")
    def dwa_lit_ref(o: Ref[object]) -> NodeRef[object]:
        return dwa_one({"order": dwa_one(o)})

    assert "reference inside a literal" in str(_problems(dwa_lit_ref))

    @workflow(name="dwa_empty")
    def dwa_empty(o: Ref[object]) -> None:
        return None

    assert "at least one node" in str(_problems(dwa_empty))


def test_workflows_validation_reports_every_problem_at_once_and_not_at_decoration() -> None:
    @step(name="dwa_five")
    def dwa_five(a: object, b: object, c: object, d: object, e: object) -> None:
        return None

    @workflow(name="dwa_many_problems")  # decorating does not check anything
    def dwa_many_problems(o: Ref[object]) -> None:
        dwa_one(o, node_id="dup")
        dwa_one(o, node_id="dup")
        dwa_one(o, node_id="bad[0]")
        dwa_one(o, node_id="x" * 1025)
        dwa_five(o, o, o, o, o)
        wait_signal("twice")
        wait_signal("twice").named("twice_2")
        wait_n("quorum", 0)
        dwa_one(o, node_id="q_empty", queue="")
        dwa_one(o, node_id="q_long", queue="q" * 257)
        dwa_one(o, node_id="attempts", max_attempts=0)
        dwa_one(o, node_id="odf", on_dep_failure="cancel")  # type: ignore[arg-type]
        dwa_one(o, node_id="t_zero", timeout=0)
        dwa_one(o, node_id="t_huge", timeout=timedelta(days=366 * 1001))
        dwa_one(o, node_id="ret_neg", retention=timedelta(seconds=-1))

    bad = _problems(dwa_many_problems)
    expected = {
        "dup",
        "bad[0]",
        "x" * 1025,
        "dwa_five",
        "quorum",
        "q_empty",
        "q_long",
        "attempts",
        "odf",
        "t_zero",
        "t_huge",
        "ret_neg",
    }
    missing = expected - set(bad.node_ids)
    assert not missing, (missing, bad.problems)
    assert any("twice" in p for p in bad.problems), bad.problems


def test_workflows_a_child_that_recurses_into_its_own_workflow_is_invalid() -> None:
    @workflow(name="dwa_recursive")
    def dwa_recursive(o: Ref[object]) -> NodeRef[object]:
        return child(dwa_recursive, o)

    _problems(dwa_recursive)


def test_workflows_def_version_is_v1_and_32_hex_and_ignores_literals_and_docstrings() -> None:
    def build(name: str, literal: str, doc: str | None) -> Any:
        def body(o: Ref[object]) -> NodeRef[object]:
            return dwa_pair(dwa_one(o), dwa_one(literal))

        body.__doc__ = doc
        return workflow(name=name)(body)

    a = build("dwa_fp_a", "one", None).def_version
    b = build("dwa_fp_b", "two", "a docstring").def_version
    assert re.fullmatch(r"v1:[0-9a-f]{32}", a), a
    assert a == b

    @workflow(name="dwa_fp_c")
    def other(o: Ref[object]) -> NodeRef[object]:
        return dwa_pair(dwa_one(o), dwa_one(o))  # a reference instead of a literal

    assert other.def_version != a


# -- workflows.md: branching ---------------------------------------------------------------


@step(name="dwa_score")
def dwa_score(order: dict[str, str]) -> float:
    return 0.9 if order.get("country") == "??" else 0.1


@step(name="dwa_escalate")
def dwa_escalate(order: dict[str, str]) -> str:
    return "sent to review"


@step(name="dwa_ship")
def dwa_ship(order: dict[str, str]) -> str:
    return "shipped"


@step(name="dwa_record")
def dwa_record(outcomes: list[str | None]) -> list[str | None]:
    return outcomes  # the page prints ["sent to review", None] or [None, "shipped"]


@workflow(name="dwa_fulfil")
def dwa_fulfil(order: Ref[dict[str, str]]) -> NodeRef[list[str | None]]:
    risk = dwa_score(order)
    review = dwa_escalate(order, when=risk.gt(0.8))  # runs only for risky orders
    shipped = dwa_ship(order, otherwise=review)  # the else branch
    return dwa_record([review, shipped])  # None for the branch that did not run


@pytest.mark.parametrize(
    ("country", "outcomes", "skipped"),
    [("??", ["sent to review", None], "dwa_ship"), ("FR", [None, "shipped"], "dwa_escalate")],
)
def test_workflows_branching_sample_runs_one_branch_and_skips_the_other(
    start_worker: StartWorker,
    client: Client,
    country: str,
    outcomes: list[str | None],
    skipped: str,
) -> None:
    start_worker(dwa_score, dwa_escalate, dwa_ship, dwa_record)
    handle = client.submit(dwa_fulfil, {"country": country})
    assert handle.result(timeout=10) == outcomes
    run = client.get_run(handle.id)
    assert run.state is RunState.COMPLETED  # a skipped node is not a failure
    assert run.step(skipped).state is StepState.SKIPPED
    assert run.step(skipped).output is None


@workflow(name="dwa_skip_chain")
def dwa_skip_chain(value: Ref[object]) -> NodeRef[list[object]]:
    gated = dwa_one(value, when=value.eq("go"))
    below = dwa_one(gated)  # all of its dependencies skipped: skipped too
    forced = dwa_one(gated, on_skip="run", node_id="forced")  # runs anyway, with None
    return dwa_gather([below, forced])


def test_workflows_a_branch_below_a_skipped_node_is_skipped_unless_on_skip_run(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_one, dwa_gather)
    handle = client.submit(dwa_skip_chain, "stop")
    assert handle.result(timeout=10) == [None, None]
    run = client.get_run(handle.id)
    assert run.step("dwa_one").state is StepState.SKIPPED
    assert run.step("dwa_one_2").state is StepState.SKIPPED
    assert run.step("forced").state is StepState.COMPLETED


@step(name="dwa_value")
def dwa_value(value: object) -> object:
    return value


def _conditions_wf(name: str, cond: Callable[[Any], Any]) -> Any:
    def body(value: Ref[object]) -> NodeRef[object]:
        produced = dwa_value(value)
        return dwa_one("ran", when=cond(produced))

    return workflow(name=name)(body)


_CONDITIONS: list[tuple[str, object, Callable[[Any], Any], bool]] = [
    ("str-vs-int", "1", lambda r: r.eq(1), False),
    ("int-vs-bool", 1, lambda r: r.eq(True), False),
    ("ne-different-type", "1", lambda r: r.ne(1), True),
    ("missing-path-falsy", {"a": 1}, lambda r: r.at("b").falsy(), True),
    ("missing-path-eq", {"a": 1}, lambda r: r.at("b").eq(None), False),
    ("missing-path-not-eq", {"a": 1}, lambda r: ~r.at("b").eq(1), True),
    ("last-item", {"items": [1, 2, 9]}, lambda r: r.at("items", -1).gt(3), True),
    ("nested", {"risk": {"level": "high"}}, lambda r: r.at("risk", "level").eq("high"), True),
    ("strings-code-point", "b", lambda r: r.gt("a"), True),
    ("isin", "x", lambda r: r.isin(["x", "y"]), True),
    ("empty-list-falsy", [], lambda r: r.falsy(), True),
    ("empty-dict-falsy", {}, lambda r: r.falsy(), True),
    ("zero-falsy", 0, lambda r: r.truthy(), False),
    ("empty-string-falsy", "", lambda r: r.truthy(), False),
    ("null-falsy", None, lambda r: r.truthy(), False),
    ("or", 5, lambda r: r.lt(0) | r.gt(4), True),
    ("and", 5, lambda r: r.gt(0) & r.lt(4), False),
    ("float-vs-int", 2.0, lambda r: r.eq(2), True),
    ("code-point-lower-vs-upper", "a", lambda r: r.gt("B"), True),
    ("code-point-accent", "\u00e9", lambda r: r.gt("z"), True),
    ("code-point-case-first", "Z", lambda r: r.lt("a"), True),
    ("code-point-astral", "\U0001f600", lambda r: r.gt("\uffff"), True),
    ("code-point-prefix", "ab", lambda r: r.gt("a"), True),
    ("not-lt-different-type", "1", lambda r: ~r.lt(3), True),
    ("lt-different-type", "1", lambda r: r.lt(3), False),
    ("float-zero-falsy", 0.0, lambda r: r.truthy(), False),
    ("false-falsy", False, lambda r: r.falsy(), True),
    ("isin-bool-vs-int", True, lambda r: r.isin([1]), False),
    ("isin-int-vs-bool", 1, lambda r: r.isin([True]), False),
    ("index-on-dict", {"items": {"0": 5}}, lambda r: r.at("items", 0).eq(5), False),
    ("minus-one-on-empty", {"items": []}, lambda r: r.at("items", -1).falsy(), True),
    ("minus-two", {"items": [7, 8]}, lambda r: r.at("items", -2).eq(7), True),
    ("big-int", 2**53 + 1, lambda r: r.gt(2**53), True),
    ("nested-empty-list-truthy", [[]], lambda r: r.truthy(), True),
    ("string-zero-truthy", "0", lambda r: r.truthy(), True),
]


@pytest.mark.parametrize(
    ("value", "cond", "holds"),
    [c[1:] for c in _CONDITIONS],
    ids=[c[0] for c in _CONDITIONS],
)
def test_workflows_conditions_compare_as_json(
    start_worker: StartWorker,
    client: Client,
    request: pytest.FixtureRequest,
    value: object,
    cond: Callable[[Any], Any],
    holds: bool,
) -> None:
    case = request.node.callspec.id.replace("-", "_")
    wf = _conditions_wf(f"dwa_cond_{case}", cond)
    start_worker(dwa_value, dwa_one)
    handle = client.submit(wf, value)
    assert handle.result(timeout=10) == ("ran" if holds else None)


def test_workflows_condition_refusals_at_build_time() -> None:
    @workflow(name="dwa_cond_both")
    def both(v: Ref[object]) -> NodeRef[object]:
        a = dwa_one(v, when=v.eq(1))
        return dwa_one(v, when=v.eq(2), otherwise=a)

    _problems(both)

    @workflow(name="dwa_cond_otherwise_plain")
    def otherwise_plain(v: Ref[object]) -> NodeRef[object]:
        a = dwa_one(v)
        return dwa_one(v, otherwise=a)

    _problems(otherwise_plain)

    @workflow(name="dwa_cond_empty_isin")
    def empty_isin(v: Ref[object]) -> NodeRef[object]:
        return dwa_one(v, when=v.isin([]))

    _problems(empty_isin)

    @workflow(name="dwa_cond_on_action")
    def on_action(v: Ref[object]) -> None:
        done = dwa_act(v)
        dwa_act(v, when=done.truthy())

    _problems(on_action)

    @workflow(name="dwa_cond_and_true")
    def and_true(v: Ref[object]) -> NodeRef[object]:
        return dwa_one(v, when=v.eq(1) & True)  # type: ignore[operator]

    with pytest.raises((InvalidGraph, BuildTimeValue)):
        _ = and_true.graph

    @workflow(name="dwa_cond_lt_none")
    def lt_none(v: Ref[object]) -> NodeRef[object]:
        return dwa_one(v, when=v.lt(None))  # type: ignore[arg-type]

    _problems(lt_none)

    @workflow(name="dwa_condref_big_int")
    def big_int(v: Ref[object]) -> NodeRef[object]:
        return dwa_one(v, when=v.eq(2**64))

    _problems(big_int)


# -- workflows.md: the result --------------------------------------------------------------


@step(name="dwa_boom")
def dwa_boom(value: object) -> object:
    raise Permanent("boom")


@workflow(name="dwa_cut_result")
def dwa_cut_result(value: Ref[object]) -> NodeRef[object]:
    failed = dwa_boom(value)
    return dwa_one(failed, on_dep_failure="cancel_branch")


@workflow(name="dwa_skipped_result")
def dwa_skipped_result(value: Ref[object]) -> NodeRef[object]:
    return dwa_one(value, when=value.eq("never"))


@workflow(name="dwa_two_results")
def dwa_two_results(value: Ref[object]) -> NodeRef[object]:
    define_result(dwa_one(value))
    return dwa_one(value)


@workflow(name="dwa_action_result")
def dwa_action_result(value: Ref[object]) -> NodeRef[object]:
    return dwa_act(value)  # type: ignore[return-value]


def test_workflows_result_rules(start_worker: StartWorker, client: Client) -> None:
    start_worker(dwa_boom, dwa_one)
    cut = client.submit(dwa_cut_result, 1)
    with pytest.raises(NoOutput):
        cut.result(timeout=10)
    assert client.get_run(cut.id).state is RunState.COMPLETED
    assert client.submit(dwa_skipped_result, 1).result(timeout=10) is None
    _problems(dwa_two_results)
    _problems(dwa_action_result)


@workflow(name="dwa_cut_child_parent")
def dwa_cut_child_parent(value: Ref[object]) -> NodeRef[object]:
    return dwa_one(child(dwa_cut_result, value))


def test_workflows_a_child_with_a_cut_off_result_fails_the_parents_child_node(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_boom, dwa_one, dwa_cut_child_parent)
    handle = client.submit(dwa_cut_child_parent, 1)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.node == "dwa_cut_result"
    assert failed.value.error_kind == "child_failed"


# -- waits.md: signals ---------------------------------------------------------------------


@workflow(name="dwa_sentinel")
def dwa_sentinel(x: Ref[object]) -> NodeRef[None]:
    return wait_timer(timedelta(microseconds=1))


def _scanned(client: Client) -> None:
    """Return once a scanner pass that began after this call has fired timers."""
    client.submit(dwa_sentinel, 0).wait(timeout=15)


_SHIFT = [timedelta(0)]


@pytest.fixture(autouse=True)
def _no_shift() -> None:
    _SHIFT[0] = timedelta(0)


def _later(clock: Clock, client: Client, by: timedelta) -> None:
    """Move the database clock forward by ``by`` from where this test moved it so far."""
    _SHIFT[0] += by
    clock(datetime.now(UTC) + _SHIFT[0])


@workflow(name="dwa_approve")
def dwa_approve(value: Ref[object]) -> NodeRef[object]:
    ok = wait_signal("approved", timeout=HOUR)  # output: the payload
    return dwa_one(ok)


@workflow(name="dwa_late_approve")
def dwa_late_approve(value: Ref[object]) -> NodeRef[object]:
    first = dwa_gate(value)
    ok = wait_signal("approved", after=[first])
    return dwa_pair(first, ok)


GATE = threading.Event()


@step(name="dwa_gate")
def dwa_gate(value: object) -> object:
    GATE.wait(10)
    return value


@pytest.fixture(autouse=True)
def _open_gate() -> Any:
    GATE.set()
    yield
    GATE.set()


def test_waits_signal_payload_is_the_output_and_delivery_is_consumed(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_one)
    handle = client.submit(dwa_approve, 1)
    wait_until(
        lambda: client.get_run(handle.id).step("approved").state is StepState.WAITING_SIGNAL,
        what="the wait to be active",
    )
    assert client.signal(handle.id, "approved", {"by": "ana"}) is Delivery.CONSUMED
    assert handle.result(timeout=10) == {"by": "ana"}
    # a completed wait does not store a further signal
    # (the run has ended here, so check on a run whose wait completed but which goes on)
    rows = client.signals_of(handle.id)
    assert len(rows) == 1
    assert rows[0]["consumed_by"] is not None and rows[0]["consumed_at"] is not None


def test_waits_delivery_table_buffered_mailbox_full_and_not_stored(
    start_worker: StartWorker, client: Client
) -> None:
    GATE.clear()
    start_worker(dwa_gate, dwa_pair)
    handle = client.submit(dwa_late_approve, 1)
    # the wait is not active yet (pending behind the gate)
    assert client.signal(handle.id, "approved", "first") is Delivery.BUFFERED
    with pytest.raises(MailboxFull):  # capacity 1 for wait_signal
        client.signal(handle.id, "approved", "second")
    with pytest.raises(SignalNotDeliverable):  # a name no wait of the run declares
        client.signal(handle.id, "nobody-waits", 1)
    GATE.set()
    assert handle.result(timeout=10) == [1, "first"]  # the buffered one is consumed
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "approved", "after the end")


@workflow(name="dwa_wait_then_gate")
def dwa_wait_then_gate(value: Ref[object]) -> NodeRef[object]:
    ok = wait_signal("approved")
    return dwa_gate(ok)


def test_waits_a_signal_to_a_completed_wait_is_not_stored(
    start_worker: StartWorker, client: Client
) -> None:
    GATE.clear()
    start_worker(dwa_gate)
    handle = client.submit(dwa_wait_then_gate, 1)
    assert client.signal(handle.id, "approved", "a") in (Delivery.CONSUMED, Delivery.BUFFERED)
    wait_until(
        lambda: client.get_run(handle.id).step("approved").state is StepState.COMPLETED,
        what="the wait to complete",
    )
    assert client.signal(handle.id, "approved", "b") is Delivery.NOT_STORED
    GATE.set()
    assert handle.result(timeout=10) == "a"
    assert [r["payload"] for r in client.signals_of(handle.id)] == ["a"]


@workflow(name="dwa_quorum")
def dwa_quorum(value: Ref[object]) -> NodeRef[list[object]]:
    first = dwa_gate(value)
    return wait_n("vote", 3, after=[first])  # output: 3 payloads, in order


def test_waits_wait_n_buffers_up_to_n_and_outputs_in_arrival_order(
    start_worker: StartWorker, client: Client
) -> None:
    GATE.clear()
    start_worker(dwa_gate)
    handle = client.submit(dwa_quorum, 1)
    for vote in ("c", "a", "b"):
        assert client.signal(handle.id, "vote", vote) is Delivery.BUFFERED
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "vote", "d")
    GATE.set()
    assert handle.result(timeout=10) == ["c", "a", "b"]


@workflow(name="dwa_either")
def dwa_either(value: Ref[object]) -> NodeRef[dict[str, object]]:
    return wait_any(("yes", "no"))


def test_waits_wait_any_first_name_wins_and_a_set_is_refused(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_one)
    handle = client.submit(dwa_either, 1)
    assert client.signal(handle.id, "no", {"why": "x"}) in (Delivery.CONSUMED, Delivery.BUFFERED)
    assert handle.result(timeout=10) == {"name": "no", "payload": {"why": "x"}}

    @workflow(name="dwa_either_set")
    def either_set(value: Ref[object]) -> NodeRef[dict[str, object]]:
        return wait_any({"yes", "no"})  # type: ignore[arg-type]

    _problems(either_set)


@pytest.mark.parametrize(
    "name",
    ["x" * 1025, "é" * 513, "", "a\x00b"],
    ids=["1025-ascii", "1026-bytes-513-chars", "empty", "nul"],
)
def test_waits_signal_name_limits(client: Client, name: str) -> None:
    @workflow(name=f"dwa_signame_{len(name)}_{len(name.encode())}")
    def long_name(value: Ref[object]) -> NodeRef[object]:
        return wait_signal(name)

    _problems(long_name)
    handle = client.submit(dwa_approve, 1)
    with pytest.raises(InvalidArgument):
        client.signal(handle.id, name, 1)


def test_waits_a_1024_byte_signal_name_is_accepted(
    start_worker: StartWorker, client: Client
) -> None:
    name = "é" * 512  # 1,024 bytes of UTF-8

    @workflow(name="dwa_signame_ok")
    def ok_name(value: Ref[object]) -> NodeRef[object]:
        return wait_signal(name)

    handle = client.submit(ok_name, 1)
    assert client.signal(handle.id, name, "p") in (Delivery.CONSUMED, Delivery.BUFFERED)
    start_worker(dwa_one)
    assert handle.result(timeout=10) == "p"


@workflow(name="dwa_quorum_timeout")
def dwa_quorum_timeout(value: Ref[object]) -> NodeRef[object]:
    votes = wait_n("x", 2, timeout=HOUR)
    return dwa_one(votes, on_dep_failure="cancel_branch")


def test_waits_wait_n_timeout_message_and_kept_payloads(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    start_worker(dwa_quorum_timeout)
    handle = client.submit(dwa_quorum_timeout, 1)
    wait_until(
        lambda: client.get_run(handle.id).step("x").state is StepState.WAITING_SIGNAL,
        what="the wait to be active",
    )
    assert client.signal(handle.id, "x", "only-one") is Delivery.CONSUMED
    _later(clock, client, HOUR + timedelta(minutes=1))
    _scanned(client)
    run = wait_until(
        lambda: (r := client.get_run(handle.id)).is_terminal and r,
        what="the run to end",
    )
    wait = run.step("x")
    assert wait.error_kind == "signal_timeout"
    assert wait.error is not None
    assert "only 1 of 2 signals 'x' arrived within 01:00:00" in wait.error
    assert wait.output == ["only-one"]
    # the cancel_branch dependent contains it: the run completes with the branch cut off
    assert run.state is RunState.COMPLETED
    assert run.step("dwa_one").state is StepState.CANCELLED


# -- waits.md: timers, deadlines, pause, cancel --------------------------------------------


@workflow(name="dwa_timer")
def dwa_timer(value: Ref[object]) -> NodeRef[object]:
    pause = wait_timer(timedelta(minutes=10))  # completes when due
    return dwa_one(value, after=[pause])


def test_waits_timer_fires_when_due_and_not_while_paused(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    start_worker(dwa_one)
    handle = client.submit(dwa_timer, "t")
    wait_until(
        lambda: client.get_run(handle.id).step("timer").state is StepState.WAITING_TIMER,
        what="the timer to start",
    )
    client.pause(handle.id)
    _later(clock, client, timedelta(minutes=11))
    _scanned(client)
    assert client.get_run(handle.id).step("timer").state is not StepState.COMPLETED
    client.resume(handle.id)  # the timer moves forward by the length of the pause
    _scanned(client)
    assert client.get_run(handle.id).state is RunState.RUNNING
    _later(clock, client, timedelta(minutes=11))
    assert handle.result(timeout=10) == "t"


@workflow(name="dwa_deadline_wait")
def dwa_deadline_wait(value: Ref[object]) -> NodeRef[object]:
    ok = wait_signal("go")
    return dwa_one(ok)


def test_waits_deadline_is_set_from_submit_and_the_scanner_fails_the_run(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    start_worker(dwa_one)
    before = datetime.now(UTC)
    handle = client.submit(dwa_deadline_wait, 1, deadline=HOUR)
    run = client.get_run(handle.id)
    assert run.deadline_at is not None
    assert abs((run.deadline_at - before) - HOUR) < timedelta(seconds=30)
    _later(clock, client, HOUR + timedelta(minutes=1))
    _scanned(client)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "deadline"
    ended = client.get_run(handle.id)
    assert ended.state is RunState.FAILED
    assert ended.step("go").state is StepState.CANCELLED


def test_waits_a_signal_or_pause_past_the_deadline_raises_passed_deadline_and_ends_the_run(
    client: Client, clock: Clock
) -> None:
    # no worker: the scanner is late, the deadline still wins
    handle = client.submit(dwa_deadline_wait, 1, deadline=HOUR)
    paused = client.submit(dwa_deadline_wait, 2, deadline=HOUR)
    _later(clock, client, HOUR + timedelta(minutes=1))
    with pytest.raises(PassedDeadline) as raised:
        client.signal(handle.id, "go", "late")
    assert isinstance(raised.value, AlreadyTerminal)
    assert client.signals_of(handle.id) == []  # not stored
    assert client.get_run(handle.id).state is RunState.FAILED  # recorded there and then
    with pytest.raises(PassedDeadline):
        client.pause(paused.id)
    assert client.get_run(paused.id).state is RunState.FAILED
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=5)
    assert failed.value.error_kind == "deadline"


def test_waits_resume_moves_the_deadline_forward_by_the_pause(client: Client, clock: Clock) -> None:
    handle = client.submit(dwa_deadline_wait, 1, deadline=HOUR)
    first = client.get_run(handle.id).deadline_at
    assert first is not None
    client.pause(handle.id)
    paused = client.get_run(handle.id)
    assert paused.state is RunState.PAUSED and paused.paused_at is not None
    assert paused.step("dwa_one").state is StepState.PAUSED  # pending: paused
    _later(clock, client, timedelta(minutes=30))
    client.resume(handle.id)
    resumed = client.get_run(handle.id)
    assert resumed.paused_at is None
    assert resumed.deadline_at is not None
    moved = resumed.deadline_at - first
    assert timedelta(minutes=29) < moved < timedelta(minutes=31), moved
    # a signal after the original deadline, but before the moved one, is still delivered
    _later(clock, client, timedelta(minutes=45))
    assert client.signal(handle.id, "go", "in time") in (Delivery.CONSUMED, Delivery.BUFFERED)


@workflow(name="dwa_deadline_child_inner")
def dwa_deadline_child_inner(value: Ref[object]) -> NodeRef[dict[str, object]]:
    ok = wait_signal("inner")
    return dwa_ctx_probe(ok)


@workflow(name="dwa_deadline_parent")
def dwa_deadline_parent(value: Ref[object]) -> NodeRef[object]:
    return child(dwa_deadline_child_inner, value)


def _child_id(client: Client, run_id: int) -> int:
    rows = wait_until(lambda: client.children_of(run_id), what="the child run")
    return int(rows[0]["id"])


def test_waits_a_child_run_has_no_deadline_of_its_own(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_ctx_probe, dwa_deadline_parent)
    handle = client.submit(dwa_deadline_parent, 1, deadline=HOUR)
    kid = _child_id(client, handle.id)
    assert client.get_run(kid).deadline_at is None
    client.signal(kid, "inner", "x")
    seen = handle.result(timeout=10)
    assert isinstance(seen, dict)
    assert seen["deadline"] is None  # its handlers see ctx.deadline as None


def test_waits_a_signal_to_a_child_below_a_passed_deadline_raises_passed_deadline(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    start_worker(dwa_deadline_parent)
    handle = client.submit(dwa_deadline_parent, 1, deadline=HOUR)
    kid = _child_id(client, handle.id)
    start_worker  # noqa: B018 - the workers keep running; the scanner may be late or not
    _later(clock, client, HOUR + timedelta(minutes=1))
    with pytest.raises(AlreadyTerminal) as raised:
        client.signal(kid, "inner", "late")
    # either the scanner got there first (the child is cancelled: AlreadyTerminal) or the
    # call found the deadline passed (PassedDeadline); in both, nothing is stored
    assert client.signals_of(kid) == []
    assert client.get_run(kid).state is RunState.CANCELLED
    assert client.get_run(handle.id).state is RunState.FAILED
    del raised


def test_waits_cancel_reaches_descendants_and_an_ended_run_cannot_be_cancelled(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_deadline_parent)
    handle = client.submit(dwa_deadline_parent, 1)
    kid = _child_id(client, handle.id)
    client.cancel(handle.id)
    assert client.get_run(handle.id).state is RunState.CANCELLED
    assert client.get_run(kid).state is RunState.CANCELLED
    assert all(s.state.is_terminal for s in client.get_run(kid).steps)
    with pytest.raises(AlreadyTerminal):
        client.cancel(handle.id)


def test_waits_a_run_that_ends_while_paused_keeps_paused_at(
    start_worker: StartWorker, client: Client
) -> None:
    handle = client.submit(dwa_deadline_wait, 1)
    client.pause(handle.id)
    client.cancel(handle.id)
    run = client.get_run(handle.id)
    assert run.state is RunState.CANCELLED
    assert run.paused_at is not None


@step(name="dwa_slow")
def dwa_slow(value: object, ctx: StepContext) -> object:
    _count("slow-start")
    GATE.wait(10)
    return value


@workflow(name="dwa_pause_chain")
def dwa_pause_chain(value: Ref[object]) -> NodeRef[object]:
    return dwa_one(dwa_slow(value))


def test_waits_pause_lets_running_steps_finish_and_holds_what_becomes_ready(
    start_worker: StartWorker, client: Client
) -> None:
    GATE.clear()
    start_worker(dwa_slow, dwa_one)
    handle = client.submit(dwa_pause_chain, "v")
    wait_until(lambda: CALLS["slow-start"] == 1, what="the slow step to start")
    client.pause(handle.id)
    GATE.set()
    wait_until(
        lambda: client.get_run(handle.id).step("dwa_slow").state is StepState.COMPLETED,
        what="the running step to finish",
    )
    run = wait_until(
        lambda: (r := client.get_run(handle.id)).step("dwa_one").state is StepState.PAUSED and r,
        what="the newly ready step to be paused",
    )
    assert run.state is RunState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=10) == "v"


# -- fan-out-and-children.md: for_each -----------------------------------------------------

RUNNING_NOW = [0, 0]  # current, peak


@step(name="dwa_ship_line")
def dwa_ship_line(line: object, ctx: StepContext) -> dict[str, object]:
    with _lock:
        RUNNING_NOW[0] += 1
        RUNNING_NOW[1] = max(RUNNING_NOW[1], RUNNING_NOW[0])
    try:
        GATE.wait(0.05)
        return {"line": line, "index": ctx.item_index}
    finally:
        with _lock:
            RUNNING_NOW[0] -= 1


@step(name="dwa_lines")
def dwa_lines(value: object) -> object:
    return value


@workflow(name="dwa_shipping")
def dwa_shipping(value: Ref[object]) -> NodeRef[list[dict[str, object]]]:
    lines = dwa_lines(value)
    return for_each(dwa_ship_line, over=lines, max_parallel=2, max_bytes=1_000_000, max_items=500)


def test_fan_out_items_are_step_rows_in_input_order_within_max_parallel(
    start_worker: StartWorker, client: Client
) -> None:
    RUNNING_NOW[:] = [0, 0]
    GATE.clear()  # each item takes 50 ms, so several would overlap without the limit
    start_worker(dwa_ship_line, dwa_lines, concurrency=8)
    values = [f"l{i}" for i in range(7)]
    handle = client.submit(dwa_shipping, values)
    out = handle.result(timeout=20)
    assert out == [{"line": v, "index": i} for i, v in enumerate(values)]
    assert RUNNING_NOW[1] <= 2
    run = client.get_run(handle.id)
    items = sorted((s for s in run.steps if s.item_of is not None), key=lambda s: s.item_index or 0)
    assert [s.node for s in items] == [f"dwa_ship_line[{i}]" for i in range(7)]
    assert {s.item_of for s in items} == {"dwa_ship_line"}
    assert [s.item_index for s in items] == list(range(7))


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ({"not": "a list"}, "invalid_input"),
        ("x", "invalid_input"),
        (list(range(501)), "item_limit"),
    ],
    ids=["dict", "string", "over-max-items"],
)
def test_fan_out_bad_input_fails_the_node_before_any_item_runs(
    start_worker: StartWorker, client: Client, value: object, kind: str
) -> None:
    RUNNING_NOW[:] = [0, 0]
    start_worker(dwa_ship_line, dwa_lines)
    handle = client.submit(dwa_shipping, value)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.node == "dwa_ship_line"
    assert failed.value.error_kind == kind
    run = client.get_run(handle.id)
    assert [s for s in run.steps if s.item_of is not None] == []  # no handler ran
    assert RUNNING_NOW[1] == 0


def test_fan_out_an_empty_list_completes_at_once_with_an_empty_list(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_ship_line, dwa_lines)
    assert client.submit(dwa_shipping, []).result(timeout=10) == []


@step(name="dwa_big")
def dwa_big(value: object) -> str:
    return "é" * 300  # 600 bytes of UTF-8, 302 bytes with quotes... as compact JSON


@workflow(name="dwa_too_much")
def dwa_too_much(value: Ref[object]) -> NodeRef[list[str]]:
    return for_each(dwa_big, over=dwa_lines(value), max_bytes=1_000)


def test_fan_out_collected_output_over_max_bytes_counts_utf8_bytes(
    start_worker: StartWorker, client: Client
) -> None:
    # two items: ["é"*300, "é"*300] is 300 characters... 1,205 bytes of compact UTF-8 JSON,
    # 605 characters: over a 1,000-byte limit only when counted in bytes
    start_worker(dwa_big, dwa_lines)
    handle = client.submit(dwa_too_much, [1, 2])
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "output_limit"
    assert failed.value.node == "dwa_big"


@action(name="dwa_item_action")
def dwa_item_action(value: object) -> None:
    _count("item-action")


@workflow(name="dwa_action_fan")
def dwa_action_fan(value: Ref[object]) -> NodeRef[object]:
    done = for_each(dwa_item_action, over=dwa_lines(value))
    return dwa_one(done)


def test_fan_out_of_an_action_completes_with_no_output(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_item_action, dwa_lines, dwa_one)
    handle = client.submit(dwa_action_fan, [1, 2, 3])
    assert handle.result(timeout=10) is None
    assert CALLS["item-action"] == 3
    assert client.get_run(handle.id).step("dwa_item_action").output is None


@step(name="dwa_item_fails", max_attempts=1)
def dwa_item_fails(value: object) -> object:
    if value == "bad":
        raise RuntimeError("bad item")
    return value


@workflow(name="dwa_item_failure")
def dwa_item_failure(value: Ref[object]) -> NodeRef[object]:
    fanned = for_each(dwa_item_fails, over=dwa_lines(value))
    return dwa_one(fanned)


def test_fan_out_an_item_that_exhausts_its_attempts_fails_the_fan_out_node(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_item_fails, dwa_lines, dwa_one)
    handle = client.submit(dwa_item_failure, ["ok", "bad", "ok"])
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    run = client.get_run(handle.id)
    assert run.step("dwa_item_fails").state is StepState.DISCARDED
    assert run.step("dwa_item_fails[1]").state is StepState.DISCARDED
    assert failed.value.node in ("dwa_item_fails", "dwa_item_fails[1]")


# -- fan-out-and-children.md: child --------------------------------------------------------


@workflow(name="dwa_invoice_wf")
def dwa_invoice_wf(order: Ref[object]) -> NodeRef[object]:
    return dwa_item_fails(order)


@workflow(name="dwa_invoice_parent")
def dwa_invoice_parent(order: Ref[object]) -> NodeRef[object]:
    invoice = child(dwa_invoice_wf, order)
    return dwa_one(invoice)


def test_child_completes_with_the_childs_result_and_records_its_parent(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_invoice_parent, dwa_item_fails, dwa_one)
    handle = client.submit(dwa_invoice_parent, {"o": 1})
    assert handle.result(timeout=10) == {"o": 1}
    (row,) = client.children_of(handle.id)
    kid = client.get_run(int(row["id"]))
    assert (kid.parent_run_id, kid.parent_node_id) == (handle.id, "dwa_invoice_wf")
    assert kid.state is RunState.COMPLETED


def test_child_failure_fails_the_node_with_child_failed(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_invoice_parent, dwa_item_fails, dwa_one)
    handle = client.submit(dwa_invoice_parent, "bad")
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.node == "dwa_invoice_wf"
    assert failed.value.error_kind == "child_failed"


@workflow(name="dwa_wait_child")
def dwa_wait_child(value: Ref[object]) -> NodeRef[object]:
    return wait_signal("kid")


@workflow(name="dwa_wait_parent")
def dwa_wait_parent(value: Ref[object]) -> NodeRef[object]:
    kid = child(dwa_wait_child, value)
    dwa_one(kid, on_dep_failure="cancel_branch")
    return wait_signal("sib")


def test_child_cancel_reaches_down_never_up(start_worker: StartWorker, client: Client) -> None:
    start_worker(dwa_wait_parent, dwa_one)
    handle = client.submit(dwa_wait_parent, 1)
    kid = _child_id(client, handle.id)
    client.cancel(kid)
    run = wait_until(
        lambda: (r := client.get_run(handle.id)).step("dwa_wait_child").state.is_terminal and r,
        what="the child node to fail",
    )
    assert run.step("dwa_wait_child").error_kind == "child_failed"
    assert run.state is RunState.RUNNING  # only that node failed
    assert run.step("dwa_one").state is StepState.CANCELLED  # the dependent contains it
    client.signal(handle.id, "sib", "s")
    assert handle.result(timeout=10) == "s"
    assert client.get_run(handle.id).state is RunState.COMPLETED


def test_child_pause_reaches_down_and_resume_resumes_the_ones_paused_with_it(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_wait_parent, dwa_one)
    handle = client.submit(dwa_wait_parent, 1)
    kid = _child_id(client, handle.id)
    client.pause(handle.id)
    assert client.get_run(kid).state is RunState.PAUSED
    client.resume(handle.id)
    assert client.get_run(kid).state is RunState.RUNNING
    # a child you paused on its own stays paused through the parent's pause and resume
    client.pause(kid)
    client.pause(handle.id)
    client.resume(handle.id)
    assert client.get_run(kid).state is RunState.PAUSED


# -- fan-out-and-children.md: for_each over a workflow -------------------------------------


@workflow(name="dwa_deploy_region")
def dwa_deploy_region(region: Ref[object]) -> NodeRef[object]:
    return dwa_item_fails(region)


@workflow(name="dwa_deploy_all")
def dwa_deploy_all(regions: Ref[object]) -> NodeRef[object]:
    deployed = for_each(dwa_deploy_region, over=dwa_lines(regions), max_parallel=4)
    return dwa_one(deployed)


def test_fan_out_over_a_workflow_gives_child_results_in_item_order(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_deploy_all, dwa_item_fails, dwa_lines, dwa_one)
    regions = [f"r{i}" for i in range(6)]
    handle = client.submit(dwa_deploy_all, regions)
    assert handle.result(timeout=20) == regions
    children = client.children_of(handle.id)
    assert len(children) == 6
    run = client.get_run(handle.id)
    items = {s.node for s in run.steps if s.item_of == "dwa_deploy_region"}
    assert items == {f"dwa_deploy_region[{i}]" for i in range(6)}


def test_fan_out_over_a_workflow_refuses_step_options() -> None:
    @workflow(name="dwa_deploy_opts")
    def opts(regions: Ref[object]) -> NodeRef[object]:
        return for_each(dwa_deploy_region, over=regions, queue="other")  # type: ignore[call-overload]

    with pytest.raises((InvalidGraph, TypeError)):
        _ = opts.graph


def test_fan_out_over_a_workflow_retry_reruns_failed_children_in_place(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_deploy_all, dwa_item_fails, dwa_lines, dwa_one)
    handle = client.submit(dwa_deploy_all, ["r0", "bad", "r2"])
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    before = {int(r["id"]) for r in client.children_of(handle.id)}
    client.retry(handle.id, "dwa_deploy_region")
    with pytest.raises(RunFailed):  # "bad" fails again, in the same child run
        handle.result(timeout=20)
    after = {int(r["id"]) for r in client.children_of(handle.id)}
    assert before == after  # one child run per item, ever


# -- waits.md: the deadline wins -----------------------------------------------------------


@workflow(name="dwa_timer_vs_deadline")
def dwa_timer_vs_deadline(value: Ref[object]) -> NodeRef[object]:
    pause = wait_timer(timedelta(minutes=30))
    return dwa_one(value, after=[pause])


def test_waits_when_workers_were_down_across_both_the_deadline_wins_over_an_earlier_timer(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    handle = client.submit(dwa_timer_vs_deadline, 1, deadline=HOUR)  # no worker yet
    _later(clock, client, 2 * HOUR)
    start_worker(dwa_one)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "deadline"
    run = client.get_run(handle.id)
    assert run.step("timer").state is not StepState.COMPLETED  # the timer did not fire
    assert run.step("dwa_one").state is StepState.CANCELLED


@workflow(name="dwa_signal_timeout_vs_deadline")
def dwa_signal_timeout_vs_deadline(value: Ref[object]) -> NodeRef[object]:
    ok = wait_signal("go", timeout=timedelta(minutes=30))
    return dwa_one(ok)


def test_waits_a_signal_timeout_due_in_a_run_past_its_deadline_reports_the_deadline(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    handle = client.submit(dwa_signal_timeout_vs_deadline, 1, deadline=HOUR)
    _later(clock, client, 2 * HOUR)
    start_worker(dwa_one)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "deadline"
    assert client.get_run(handle.id).step("go").error_kind != "signal_timeout"


def test_waits_no_step_of_a_run_past_its_deadline_is_claimed(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    handle = client.submit(dwa_echo_wf, 1, deadline=HOUR)
    _later(clock, client, 2 * HOUR)
    start_worker(dwa_echo, scanners=False)  # no scanner: only the claim can see it
    other = client.submit(dwa_echo_wf, 2)
    assert other.result(timeout=10) == 2  # the worker claims work...
    run = client.get_run(handle.id)
    assert run.step("dwa_echo").state is not StepState.COMPLETED  # ...but not this step
    assert run.step("dwa_echo").started_at is None


@step(name="dwa_gated_echo", max_attempts=1)
def dwa_gated_echo(value: object) -> object:
    _count("gated-start")
    GATE.wait(10)
    _count("gated-end")
    return value


@workflow(name="dwa_gated_wf")
def dwa_gated_wf(value: Ref[object]) -> NodeRef[object]:
    return dwa_gated_echo(value)


def test_waits_a_step_completing_after_the_deadline_fails_the_run_and_its_result_is_fenced(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    GATE.clear()
    start_worker(dwa_gated_echo, scanners=False)  # the scanner is late
    handle = client.submit(dwa_gated_wf, "late", deadline=HOUR)
    wait_until(lambda: CALLS["gated-start"] == 1, what="the step to start")
    _later(clock, client, 2 * HOUR)
    GATE.set()
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "deadline"
    step_row = client.get_run(handle.id).step("dwa_gated_echo")
    assert step_row.output is None
    assert step_row.state is not StepState.COMPLETED


def test_waits_retry_of_a_run_past_its_deadline_is_refused(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    start_worker(dwa_echo)
    handle = client.submit(dwa_deadline_wait, 1, deadline=HOUR)
    _later(clock, client, 2 * HOUR)
    with pytest.raises(RunFailed):
        handle.result(timeout=10)
    with pytest.raises(CycloneError):
        client.retry(handle.id, "go")
    assert client.get_run(handle.id).state is RunState.FAILED


def test_waits_a_fork_starts_without_a_deadline(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    start_worker(dwa_one)
    handle = client.submit(dwa_deadline_wait, 1, deadline=HOUR)
    _later(clock, client, 2 * HOUR)
    with pytest.raises(RunFailed):
        handle.result(timeout=10)
    forked = client.fork(handle.id, "go")
    assert client.get_run(forked.id).deadline_at is None
    client.signal(forked.id, "go", "again")
    assert forked.result(timeout=10) == "again"


@workflow(name="dwa_timer_after_gate")
def dwa_timer_after_gate(value: Ref[object]) -> NodeRef[object]:
    first = dwa_gated_echo(value)
    pause = wait_timer(timedelta(minutes=10))
    return dwa_one(first, after=[pause])


def test_waits_a_timer_waits_from_its_activation_not_from_submit(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    GATE.clear()
    start_worker(dwa_gated_echo, dwa_one)

    @workflow(name="dwa_timer_after_gate_2")
    def timer_after(value: Ref[object]) -> NodeRef[object]:
        first = dwa_gated_echo(value)
        pause = wait_timer(timedelta(minutes=10), after=[first])
        return dwa_one(first, after=[pause])

    handle = client.submit(timer_after, "v")
    wait_until(lambda: CALLS["gated-start"] == 1, what="the first step to start")
    _later(clock, client, timedelta(minutes=20))  # before the timer is active
    GATE.set()
    wait_until(
        lambda: client.get_run(handle.id).step("timer").state is StepState.WAITING_TIMER,
        what="the timer to start",
    )
    _scanned(client)
    assert client.get_run(handle.id).step("timer").state is StepState.WAITING_TIMER
    _later(clock, client, timedelta(minutes=11))
    assert handle.result(timeout=10) == "v"


# -- workflows.md: timeout= ----------------------------------------------------------------


@step(name="dwa_times_out", max_attempts=1, timeout=0.5)  # "timedelta or seconds"
def dwa_times_out(value: object, ctx: StepContext) -> object:
    _count("timeout-start")
    GATE.wait(10)
    _count("timeout-end")
    return value


@workflow(name="dwa_timeout_wf")
def dwa_timeout_wf(value: Ref[object]) -> NodeRef[object]:
    return dwa_times_out(value)


def test_workflows_step_timeout_fails_with_error_kind_timeout_and_fences_the_late_result(
    start_worker: StartWorker, client: Client
) -> None:
    GATE.clear()
    start_worker(dwa_times_out)
    handle = client.submit(dwa_timeout_wf, "v")
    wait_until(lambda: CALLS["timeout-start"] == 1, what="the step to start")
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)  # the worker enforces it, in real time
    GATE.set()
    assert failed.value.error_kind == "timeout"
    assert failed.value.node == "dwa_times_out"
    wait_until(lambda: CALLS["timeout-end"] == 1, what="the handler to return late")
    _scanned(client)
    late = client.get_run(handle.id).step("dwa_times_out")
    assert late.output is None
    assert late.state is StepState.DISCARDED


@step(name="dwa_cancellable")
def dwa_cancellable(value: object, ctx: StepContext) -> object:
    _count("cancellable-start")
    for _ in range(200):
        ctx.heartbeat()
        if ctx.cancelled:
            _count("saw-cancel")
            return "finished anyway"
        GATE.wait(0.02)
    return value


@workflow(name="dwa_cancellable_wf")
def dwa_cancellable_wf(value: Ref[object]) -> NodeRef[object]:
    return dwa_cancellable(value)


def test_waits_cancel_is_seen_at_the_next_heartbeat_and_the_late_completion_is_fenced(
    start_worker: StartWorker, client: Client
) -> None:
    GATE.clear()
    start_worker(dwa_cancellable)
    handle = client.submit(dwa_cancellable_wf, "v")
    wait_until(lambda: CALLS["cancellable-start"] == 1, what="the step to start")
    client.cancel(handle.id)
    wait_until(lambda: CALLS["saw-cancel"] == 1, what="the handler to see ctx.cancelled")
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=5)
    assert failed.value.state == "cancelled"
    run = client.get_run(handle.id)
    assert run.state is RunState.CANCELLED
    assert run.step("dwa_cancellable").state is StepState.CANCELLED
    assert run.step("dwa_cancellable").output is None


# -- workflows.md: the typing sample, run ----------------------------------------------------


@step(name="dwa_t_fetch")
def dwa_t_fetch(order_id: str) -> dict[str, int]:
    return {"total": len(order_id)}


@step(name="dwa_t_charge")
def dwa_t_charge(order: dict[str, int], ctx: StepContext) -> int:
    return order["total"]


@workflow(name="dwa_checkout")
def dwa_checkout(order_id: Ref[str]) -> NodeRef[int]:
    order = dwa_t_fetch(order_id)  # NodeRef[dict[str, int]]
    return dwa_t_charge(order, queue="payments")  # NodeRef[int]; the worker passes ctx


def test_workflows_typing_sample_runs_with_its_queue(
    start_worker: StartWorker, client: Client
) -> None:
    assert dwa_t_fetch("o-1") == {"total": 3}  # outside a builder: the function ran
    start_worker(dwa_t_fetch, dwa_t_charge, queues=["default", "payments"])
    handle = client.submit(dwa_checkout, "o-1")
    assert handle.result(timeout=10) == 3
    assert client.get_run(handle.id).step("dwa_t_charge").queue == "payments"


# -- waits.md: more of the mailbox ---------------------------------------------------------


@workflow(name="dwa_either_late")
def dwa_either_late(value: Ref[object]) -> NodeRef[dict[str, object]]:
    first = dwa_gate(value)
    return wait_any(["yes", "no"], after=[first])


def test_waits_wait_any_buffers_one_signal_whatever_its_name(
    start_worker: StartWorker, client: Client
) -> None:
    GATE.clear()
    start_worker(dwa_gate)
    handle = client.submit(dwa_either_late, 1)
    assert client.signal(handle.id, "no", "n") is Delivery.BUFFERED
    with pytest.raises(MailboxFull):  # the capacity is 1 for wait_any
        client.signal(handle.id, "yes", "y")
    GATE.set()
    assert handle.result(timeout=10) == {"name": "no", "payload": "n"}


@workflow(name="dwa_either_timeout")
def dwa_either_timeout(value: Ref[object]) -> NodeRef[dict[str, object]]:
    return wait_any(["yes", "no"], timeout=HOUR)


def test_waits_wait_any_timeout_fails_with_signal_timeout(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    start_worker(dwa_one)
    handle = client.submit(dwa_either_timeout, 1)
    _later(clock, client, 2 * HOUR)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "signal_timeout"
    assert failed.value.node == "any_yes_no"


def test_waits_wait_n_needs_an_integer_n_from_1_and_a_name_awaited_twice_is_refused() -> None:
    def wait_n_of(i: int, n: object) -> Any:
        def body(value: Ref[object]) -> NodeRef[list[object]]:
            return wait_n("x", n)  # type: ignore[arg-type]

        return workflow(name=f"dwa_bad_n_{i}")(body)

    for i, n in enumerate([0, -1, True, 2.0, "2"]):
        _problems(wait_n_of(i, n))
    with pytest.raises(TypeError):
        wait_n("x")  # type: ignore[call-arg]

    @workflow(name="dwa_twice_across")
    def twice_across(value: Ref[object]) -> None:
        wait_signal("yes")
        wait_any(["yes", "no"])

    _problems(twice_across)

    @workflow(name="dwa_twice_in_any")
    def twice_in_any(value: Ref[object]) -> None:
        wait_any(["yes", "yes"])

    _problems(twice_in_any)

    @workflow(name="dwa_zero_timer")
    def zero_timer(value: Ref[object]) -> None:
        wait_timer(timedelta(0))

    _problems(zero_timer)


@pytest.mark.parametrize("name", [5, None, b"approved"], ids=["int", "none", "bytes"])
def test_waits_signal_refuses_a_name_that_is_not_a_string(client: Client, name: object) -> None:
    handle = client.submit(dwa_approve, 1)
    with pytest.raises(InvalidArgument):
        client.signal(handle.id, name, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "payload", [math.nan, math.inf, "a\x00b", {1: "x"}, {"k": {1, 2}}], ids=str
)
def test_waits_signal_refuses_a_payload_that_is_not_json(client: Client, payload: object) -> None:
    handle = client.submit(dwa_approve, 1)
    with pytest.raises(InvalidArgument):
        client.signal(handle.id, "approved", payload)  # type: ignore[arg-type]
    assert client.signals_of(handle.id) == []


# -- workflows.md: conditions decide at submit; when= on waits, child and for_each -----------


def test_workflows_a_condition_on_the_run_input_decides_a_root_node_at_submit(
    client: Client,
) -> None:
    handle = client.submit(dwa_skipped_result, 1)  # no worker at all
    run = client.get_run(handle.id)
    assert run.step("dwa_one").state is StepState.SKIPPED
    assert run.state is RunState.COMPLETED
    assert handle.result(timeout=5) is None


@workflow(name="dwa_cond_kinds")
def dwa_cond_kinds(value: Ref[object]) -> NodeRef[list[object]]:
    go = value.eq("go")
    waited = wait_signal("maybe", when=go)
    kid = child(dwa_invoice_wf, value, when=go)
    fanned = for_each(dwa_one, over=dwa_lines([1, 2]), when=go)
    timed = wait_timer(HOUR, when=go)
    return dwa_gather([waited, kid, fanned, timed], on_skip="run")


def test_workflows_when_works_on_waits_child_and_for_each(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_cond_kinds, dwa_one, dwa_lines, dwa_gather, dwa_item_fails)
    handle = client.submit(dwa_cond_kinds, "stop")
    assert handle.result(timeout=10) == [None, None, None, None]
    run = client.get_run(handle.id)
    for node in ("maybe", "dwa_invoice_wf", "dwa_one", "timer"):
        assert run.step(node).state is StepState.SKIPPED, node
    assert client.children_of(handle.id) == []  # no child run was created
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "maybe", 1)


# -- quickstart and README: the environment and the layout ---------------------------------


def test_quickstart_embedded_database_yields_the_configured_url(
    cyclone_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cyclone_dsl import embedded_database

    monkeypatch.setenv("CYCLONE_DATABASE_URL", cyclone_dsn)
    with embedded_database() as dsn:
        assert dsn == cyclone_dsn


def test_readme_there_are_19_schema_migrations_shipped_in_the_package() -> None:
    from cyclone_dsl.migrate import load_migrations

    assert [m.version for m in load_migrations()] == list(range(1, 20))


def test_readme_lists_every_cli_command() -> None:
    from pathlib import Path

    from cyclone_dsl.cli import bulk, commands  # noqa: F401 - register the commands
    from cyclone_dsl.cli.main import cli

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "the command line (" in x)
    block = readme[readme.index(line) : readme.index("`demo`, `ui`)") + 20]
    listed = set(re.findall(r"`([a-z-]+)`", block))
    assert set(cli.commands) - listed == set()


def test_workflows_orders_example_gives_the_documented_shape(
    start_worker: StartWorker, client: Client
) -> None:
    from examples import orders as ex

    start_worker(ex.orders)
    handle = client.submit(ex.orders, "o-17")
    client.signal(handle.id, "approved", {"by": "ana"})
    assert handle.result(timeout=30) == {
        "charged": 1 * 10 + 2 * 20 + 3 * 30,
        "approved_by": "ana",
        "shipments": ["sku-0 shipped", "sku-1 shipped", "sku-2 shipped"],
    }
    run = client.get_run(handle.id)
    assert run.step("ex_notify").output is None  # an action: not kept
    assert run.step("ex_notify").state is StepState.COMPLETED


# -- fan-out-and-children.md: cancel and pause reach down ----------------------------------


@workflow(name="dwa_grandparent")
def dwa_grandparent(value: Ref[object]) -> NodeRef[object]:
    return child(dwa_wait_parent, value)


def test_child_pause_reaches_every_depth(start_worker: StartWorker, client: Client) -> None:
    start_worker(dwa_grandparent, dwa_wait_parent, dwa_one)
    top = client.submit(dwa_grandparent, 1)
    mid = _child_id(client, top.id)
    low = _child_id(client, mid)
    client.pause(top.id)
    assert [client.get_run(r).state for r in (top.id, mid, low)] == [RunState.PAUSED] * 3
    client.resume(top.id)
    assert [client.get_run(r).state for r in (top.id, mid, low)] == [RunState.RUNNING] * 3
    client.cancel(top.id)
    assert [client.get_run(r).state for r in (top.id, mid, low)] == [RunState.CANCELLED] * 3


@workflow(name="dwa_failing_parent")
def dwa_failing_parent(value: Ref[object]) -> NodeRef[object]:
    kid = child(dwa_wait_child, value)
    dwa_boom(value, after=[wait_signal("fail-now")])
    return kid


def test_child_failing_a_parent_cancels_its_children(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_failing_parent, dwa_boom)
    handle = client.submit(dwa_failing_parent, 1)
    kid = _child_id(client, handle.id)
    client.signal(handle.id, "fail-now", None)
    with pytest.raises(RunFailed):
        handle.result(timeout=10)
    wait_until(
        lambda: client.get_run(kid).state is RunState.CANCELLED, what="the child run cancelled"
    )


@workflow(name="dwa_region_wait")
def dwa_region_wait(region: Ref[object]) -> NodeRef[object]:
    return wait_signal("deployed")


@workflow(name="dwa_regions_wait")
def dwa_regions_wait(regions: Ref[object]) -> NodeRef[object]:
    return for_each(dwa_region_wait, over=dwa_lines(regions), max_parallel=2)


def test_fan_out_over_a_workflow_failure_cancels_the_open_children_and_starts_no_more(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_regions_wait, dwa_lines)
    handle = client.submit(dwa_regions_wait, ["a", "b", "c", "d"])
    rows = wait_until(
        lambda: len(r := client.children_of(handle.id)) == 2 and r,
        what="two open child runs (max_parallel=2)",
    )
    first, second = sorted(int(r["id"]) for r in rows)
    client.cancel(first)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.node == "dwa_region_wait"  # the fan-out node fails
    run = client.get_run(handle.id)
    assert run.step("dwa_region_wait[0]").error_kind == "child_failed"  # through its item
    assert client.get_run(second).state is RunState.CANCELLED
    assert len(client.children_of(handle.id)) == 2  # no further item started


def test_fan_out_max_items_guard_is_checked_again_on_operator_retry(
    start_worker: StartWorker, client: Client
) -> None:
    RUNNING_NOW[:] = [0, 0]
    start_worker(dwa_ship_line, dwa_lines)
    handle = client.submit(dwa_shipping, list(range(501)))
    with pytest.raises(RunFailed):
        handle.result(timeout=10)
    client.retry(handle.id, "dwa_ship_line")
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "item_limit"
    assert RUNNING_NOW[1] == 0


@workflow(name="dwa_timeout_resume")
def dwa_timeout_resume(value: Ref[object]) -> NodeRef[object]:
    return wait_signal("go", timeout=HOUR)


def test_waits_resume_moves_a_signal_timeout_forward_by_the_pause(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    start_worker(dwa_one)
    handle = client.submit(dwa_timeout_resume, 1)
    client.pause(handle.id)
    _later(clock, client, 2 * HOUR)
    client.resume(handle.id)  # due again one hour from now
    _scanned(client)
    assert client.get_run(handle.id).step("go").state is StepState.WAITING_SIGNAL
    assert client.signal(handle.id, "go", "in time") is Delivery.CONSUMED
    assert handle.result(timeout=10) == "in time"


# -- waits.md vs workflows.md: a signal name is not a node id ------------------------------


def test_waits_a_bracketed_signal_name_needs_a_named_wait() -> None:
    """waits.md: a wait's node id is its signal name unless named; ids refuse brackets."""
    page = (Path(__file__).resolve().parents[2] / "docs/concepts/waits.md").read_text()
    assert 'wait_signal("order[1]").named("order_1")' in page

    @workflow(name="dwa_bracket_signal")
    def bracket(value: Ref[object]) -> NodeRef[object]:
        return wait_signal("order[1]")

    with pytest.raises(InvalidGraph, match=r"node ids may not contain"):
        assert bracket.graph.nodes


def test_waits_a_bracketed_signal_name_works_once_the_node_is_named(
    start_worker: StartWorker, client: Client
) -> None:
    @workflow(name="dwa_bracket_named")
    def bracket(value: Ref[object]) -> NodeRef[object]:
        return dwa_one(wait_signal("order[1]").named("order_1"))

    start_worker(dwa_one)
    handle = client.submit(bracket, 1)
    client.signal(handle.id, "order[1]", "p")
    assert handle.result(timeout=10) == "p"


# -- waits.md: the delivery table, more states ---------------------------------------------


@workflow(name="dwa_skipped_wait")
def dwa_skipped_wait(value: Ref[object]) -> NodeRef[object]:
    maybe = wait_signal("maybe", when=value.eq("wait"))
    return wait_signal("other", after=[maybe], on_skip="run")


def test_waits_a_signal_to_a_wait_its_condition_skipped_is_not_stored(client: Client) -> None:
    handle = client.submit(dwa_skipped_wait, "skip")
    assert client.get_run(handle.id).step("maybe").state is StepState.SKIPPED
    assert client.signal(handle.id, "maybe", 1) is Delivery.NOT_STORED
    assert client.signals_of(handle.id) == []


@workflow(name="dwa_paused_signal")
def dwa_paused_signal(value: Ref[object]) -> NodeRef[object]:
    ok = wait_signal("go")
    return dwa_one(ok)


def test_waits_a_signal_to_a_waiting_wait_of_a_paused_run_is_consumed_and_nothing_downstream_starts(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_one)
    handle = client.submit(dwa_paused_signal, 1)
    client.pause(handle.id)
    assert client.signal(handle.id, "go", "p") is Delivery.CONSUMED
    _scanned(client)
    run = client.get_run(handle.id)
    assert run.step("go").state is StepState.COMPLETED
    assert run.step("dwa_one").state is StepState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=10) == "p"


@step(name="dwa_fails_once")
def dwa_fails_once(value: object, ctx: StepContext) -> object:
    _count(f"fails-once:{ctx.attempt}")
    if ctx.attempt == 1:
        raise RuntimeError("once")
    return value


@workflow(name="dwa_backoff")
def dwa_backoff(value: Ref[object]) -> NodeRef[object]:
    return dwa_fails_once(value)


def test_waits_resume_keeps_a_retry_backoffs_start_time(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_fails_once)
    handle = client.submit(dwa_backoff, "v")
    wait_until(lambda: CALLS["fails-once:1"] == 1, what="the first attempt")
    client.pause(handle.id)
    wait_until(
        lambda: client.get_run(handle.id).step("dwa_fails_once").attempt == 1,
        what="the failure recorded",
    )
    before = client.get_run(handle.id).step("dwa_fails_once")
    client.resume(handle.id)
    after = client.get_run(handle.id).step("dwa_fails_once")
    assert after.scheduled_at == before.scheduled_at
    assert handle.result(timeout=10) == "v"


# -- workflows.md: retention defaults to the worker's 7 days -------------------------------


def test_workflows_retention_defaults_to_seven_days(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    from cyclone_dsl import RunNotFound

    start_worker(dwa_echo)
    handle = client.submit(dwa_echo_wf, 1)
    assert handle.result(timeout=10) == 1
    _later(clock, client, timedelta(days=6, hours=23))
    _scanned(client)
    assert client.get_run(handle.id).state is RunState.COMPLETED
    _later(clock, client, timedelta(hours=2))
    _scanned(client)
    _scanned(client)
    with pytest.raises(RunNotFound):
        client.get_run(handle.id)


# -- waits.md: a child's step ending after the parent's deadline ends the parent -----------


@workflow(name="dwa_gated_child")
def dwa_gated_child(value: Ref[object]) -> NodeRef[object]:
    return dwa_gated_echo(value)


@workflow(name="dwa_gated_parent")
def dwa_gated_parent(value: Ref[object]) -> NodeRef[object]:
    return child(dwa_gated_child, value)


def test_waits_a_child_step_ending_after_the_parents_deadline_ends_the_parent(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    GATE.clear()
    start_worker(dwa_gated_parent, dwa_gated_echo, scanners=False)
    handle = client.submit(dwa_gated_parent, "v", deadline=HOUR)
    wait_until(lambda: CALLS["gated-start"] == 1, what="the child's step to start")
    kid = _child_id(client, handle.id)
    _later(clock, client, 2 * HOUR)
    GATE.set()
    wait_until(lambda: CALLS["gated-end"] == 1, what="the child's step to return")
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "deadline"
    assert client.get_run(kid).state is RunState.CANCELLED


# -- handlers: ctx as a keyword-only parameter; for_each over a literal --------------------


@step(name="dwa_kw_ctx")
def dwa_kw_ctx(value: object, *, ctx: StepContext) -> list[object]:
    return [value, ctx.node, ctx.item_index]


@workflow(name="dwa_kw_ctx_wf")
def dwa_kw_ctx_wf(value: Ref[object]) -> NodeRef[list[object]]:
    return for_each(dwa_kw_ctx, over=["a", "b"])


def test_workflows_ctx_as_keyword_only_and_for_each_over_a_literal_list(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_kw_ctx)
    handle = client.submit(dwa_kw_ctx_wf, None)
    assert handle.result(timeout=10) == [["a", "dwa_kw_ctx[0]", 0], ["b", "dwa_kw_ctx[1]", 1]]


def test_waits_wait_n_payloads_accumulate_in_the_output_until_the_quorum(
    start_worker: StartWorker, client: Client
) -> None:
    @workflow(name="dwa_quorum_now")
    def quorum_now(value: Ref[object]) -> NodeRef[list[object]]:
        return wait_n("vote", 3)

    handle = client.submit(quorum_now, 1)
    assert client.signal(handle.id, "vote", "a") is Delivery.CONSUMED
    assert client.signal(handle.id, "vote", "b") is Delivery.CONSUMED
    waiting = client.get_run(handle.id).step("vote")
    assert waiting.state is StepState.WAITING_SIGNAL
    assert waiting.output == ["a", "b"]
    assert client.signal(handle.id, "vote", "c") is Delivery.CONSUMED
    assert handle.result(timeout=5) == ["a", "b", "c"]


@workflow(name="dwa_no_result_parent")
def dwa_no_result_parent(value: Ref[object]) -> NodeRef[object]:
    kid = child(dwa_act_wf, value)
    many = for_each(dwa_act_wf, over=dwa_lines([1, 2]))
    return dwa_pair(kid, many)


def test_child_and_fan_out_of_a_workflow_without_result_give_no_output(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_no_result_parent, dwa_act, dwa_lines, dwa_pair)
    handle = client.submit(dwa_no_result_parent, 1)
    assert handle.result(timeout=10) == [None, None]
    assert CALLS["act"] == 3


@workflow(name="dwa_regions_guarded")
def dwa_regions_guarded(regions: Ref[object]) -> NodeRef[object]:
    return for_each(dwa_deploy_region, over=dwa_lines(regions), max_items=2)


@workflow(name="dwa_regions_bytes")
def dwa_regions_bytes(regions: Ref[object]) -> NodeRef[object]:
    return for_each(dwa_deploy_region, over=dwa_lines(regions), max_bytes=10)


def test_fan_out_over_a_workflow_is_guarded_by_max_items_and_max_bytes(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwa_regions_guarded, dwa_regions_bytes, dwa_item_fails, dwa_lines)
    guarded = client.submit(dwa_regions_guarded, ["a", "b", "c"])
    with pytest.raises(RunFailed) as failed:
        guarded.result(timeout=10)
    assert failed.value.error_kind == "item_limit"
    assert client.children_of(guarded.id) == []  # before any item is created
    too_big = client.submit(dwa_regions_bytes, ["aaaaaa", "bbbbbb"])
    with pytest.raises(RunFailed) as failed:
        too_big.result(timeout=10)
    assert failed.value.error_kind == "output_limit"
