"""Audit of conditional graphs and run results: ``when=``, ``otherwise=``, ``on_skip=``,
skips propagating through joins, fan-outs, child runs and waits, ``define_result`` and
``RunHandle.result()``, under operator retry and replay, cancel, pause and resume, and
signals feeding a condition; and bad conditions, which must be refused with a typed error.

Conditions on the run input are judged at submit, so many tests read the run's steps right
after ``submit`` without any worker. Handlers count their executions in ``CALLS``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    Delivery,
    InvalidGraph,
    InvalidTransition,
    NoOutput,
    Permanent,
    RunFailed,
    RunState,
    StepContext,
    StepState,
    Worker,
    action,
    child,
    define_result,
    for_each,
    step,
    wait_any,
    wait_n,
    wait_signal,
    workflow,
)
from cyclone_dsl.errors import BuildTimeValue
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]

CALLS: Counter[str] = Counter()
VALUES: dict[str, Any] = {}
FAILING: set[str] = set()
gate = threading.Event()
_lock = threading.Lock()


@pytest.fixture(autouse=True)
def _reset() -> None:
    with _lock:
        CALLS.clear()
    VALUES.clear()
    FAILING.clear()
    gate.set()


def _count(ctx: StepContext) -> None:
    with _lock:
        CALLS[ctx.node] += 1


def states(client: Client, run_id: int) -> dict[str, StepState]:
    return {s.node: s.state for s in client.get_run(run_id).steps}


# -- handlers --------------------------------------------------------------------------


@step(name="cna_val")
def cna_val(x: object, *, ctx: StepContext) -> object:
    _count(ctx)
    return x


@step(name="cna_get")
def cna_get(key: str, *, ctx: StepContext) -> object:
    """VALUES[key], which a test sets (and changes before a replay)."""
    _count(ctx)
    return VALUES.get(key)


@step(name="cna_gated")
def cna_gated(x: object, *, ctx: StepContext) -> object:
    """Returns ``x`` once ``gate`` is set (a test clears it to hold the step running)."""
    _count(ctx)
    gate.wait(10)
    return x


@step(name="cna_pair")
def cna_pair(a: object, b: object, *, ctx: StepContext) -> list[object]:
    _count(ctx)
    return [a, b]


@step(name="cna_fail", max_attempts=1)
def cna_fail(x: object, *, ctx: StepContext) -> object:
    _count(ctx)
    if ctx.node in FAILING:
        raise Permanent(f"{ctx.node} is set to fail")
    return x


@step(name="cna_list")
def cna_list(n: int, *, ctx: StepContext) -> list[int]:
    _count(ctx)
    return list(range(n))


@step(name="cna_label")
def cna_label(x: object, *, ctx: StepContext) -> str:
    _count(ctx)
    return str(x)


@action(name="cna_notify")
def cna_notify(x: object, *, ctx: StepContext) -> bool:
    """An action: it returns True, but an action's output is not kept."""
    _count(ctx)
    return True


HANDLERS = [cna_val, cna_get, cna_gated, cna_pair, cna_fail, cna_list, cna_label, cna_notify]


# -- workflows -------------------------------------------------------------------------


@workflow(name="cna_inner")
def cna_inner(o):  # type: ignore[no-untyped-def]
    """Its only node runs when the input says go: else the child run is all skipped."""
    return cna_val.named("inner")(o, when=o.at("go").eq(True))


@workflow(name="cna_echo")
def cna_echo(o):  # type: ignore[no-untyped-def]
    return cna_val.named("echo")(o)


@workflow(name="cna_on_child")
def cna_on_child(o):  # type: ignore[no-untyped-def]
    sub = child(cna_inner, o)
    yes = cna_val.named("yes")(o, when=sub.truthy())
    no = cna_val.named("no")(o, otherwise=yes)
    return cna_pair(yes, no)


@workflow(name="cna_split")
def cna_split(o):  # type: ignore[no-untyped-def]
    v = cna_gated(o)
    big = cna_val.named("big")(v, when=v.gt(5))
    small = cna_val.named("small")(v, otherwise=big)
    return cna_pair(big, small)


@workflow(name="cna_all_skip_after")
def cna_all_skip_after(o):  # type: ignore[no-untyped-def]
    v = cna_gated(o)
    cna_val.named("a")(v, when=v.gt(100))
    cna_val.named("b")(v, when=v.lt(-100))


@workflow(name="cna_cond_child")
def cna_cond_child(key):  # type: ignore[no-untyped-def]
    v = cna_get(key)
    return child(cna_echo, "from child", when=v.gt(5))


@workflow(name="cna_chain")
def cna_chain(key):  # type: ignore[no-untyped-def]
    v = cna_get(key)
    big = cna_val.named("big")(v, when=v.gt(5))
    return cna_val.named("after_big")(big)


@workflow(name="cna_sig_skip")
def cna_sig_skip(o):  # type: ignore[no-untyped-def]
    amount = wait_signal("cna_amount", when=o.at("ask").eq(True))
    other = wait_signal("cna_other")
    return cna_pair(amount, other)


@workflow(name="cna_sig_cond")
def cna_sig_cond(o):  # type: ignore[no-untyped-def]
    got = wait_signal("cna_order")
    big = cna_val.named("big")(got, when=got.at("amount").gt(100))
    small = cna_val.named("small")(got, otherwise=big)
    return cna_pair(big, small)


@workflow(name="cna_vote")
def cna_vote(o):  # type: ignore[no-untyped-def]
    first = wait_any(["cna_yes", "cna_no"])
    votes = wait_n("cna_ballot", 2)
    approve = cna_val.named("approve")(o, when=first.at("name").eq("cna_yes"))
    unanimous = cna_val.named("unanimous")(o, when=votes.at(0).eq("y") & votes.at(1).eq("y"))
    return cna_pair(approve, unanimous)


@workflow(name="cna_fan_skipped")
def cna_fan_skipped(o):  # type: ignore[no-untyped-def]
    items = cna_list(o, when=o.gt(100))
    return for_each(cna_val, over=items, on_skip="run")


@workflow(name="cna_child_skipped_input")
def cna_child_skipped_input(o):  # type: ignore[no-untyped-def]
    value = cna_val.named("maybe")(o, when=o.gt(100))
    return child(cna_echo, value, on_skip="run")


@workflow(name="cna_contained_join")
def cna_contained_join(o):  # type: ignore[no-untyped-def]
    skipped = cna_val.named("skipped")(o, when=o.at("x").eq(1))
    failing = cna_fail.named("failing")(o)
    return cna_pair(skipped, failing, on_dep_failure="cancel_branch")


@workflow(name="cna_fan_cond")
def cna_fan_cond(n):  # type: ignore[no-untyped-def]
    doubled = for_each(cna_val, over=cna_list(n))
    many = cna_val.named("many")(n, when=doubled.at(2).eq(2))
    return cna_pair(doubled, many)


@workflow(name="cna_result_fan")
def cna_result_fan(o):  # type: ignore[no-untyped-def]
    return for_each(cna_val, over=[1, 2], when=o.at("go").eq(True))


@workflow(name="cna_result_wait")
def cna_result_wait(o):  # type: ignore[no-untyped-def]
    return wait_signal("cna_never", when=o.at("go").eq(True))


@workflow(name="cna_result_child")
def cna_result_child(o):  # type: ignore[no-untyped-def]
    define_result(child(cna_echo, o, when=o.at("go").eq(True)))


@workflow(name="cna_odd_ids")
def cna_odd_ids(o):  # type: ignore[no-untyped-def]
    info = cna_val.named('a"b\\c é😀')(o)
    return cna_val.named("odd")(o, when=info.at('k"\\😀', "\n").eq("ü"))


# -- bad conditions: refused with a typed error, never a raw one ---------------------

#: Condition values the builder takes for JSON scalars but the database cannot store.
UNSTORABLE = [("nul", "a\x00b"), ("beyond_64_bits", 2**70), ("lone_surrogate", "\ud800")]


def test_a_nul_in_a_condition_path_is_refused_with_a_typed_error(client: Client) -> None:
    @workflow(name="cna_bad_nul_key")
    def bad(o):  # type: ignore[no-untyped-def]
        return cna_val(o, when=o.at("a\x00b").eq(1))

    with pytest.raises(InvalidGraph, match=r"path key .* cannot be stored"):
        _ = bad.graph
    with pytest.raises(InvalidGraph):  # not the driver's UntranslatableCharacter at submit
        client.submit(bad, {"a": 1})
    assert client.list_runs(workflow="cna_bad_nul_key") == []


@pytest.mark.parametrize(("label", "value"), UNSTORABLE, ids=[label for label, _ in UNSTORABLE])
def test_unstorable_condition_values_are_refused_at_submit_and_nothing_is_written(
    client: Client, label: str, value: Any
) -> None:
    name = f"cna_bad_value_{label}"

    @workflow(name=name)
    def bad(o):  # type: ignore[no-untyped-def]
        return cna_val(o, when=o.at("a").eq(value))

    with pytest.raises(InvalidGraph, match="cannot be stored"):
        client.submit(bad, {"a": 1})
    assert client.list_runs(workflow=name) == []


@pytest.mark.parametrize(("label", "value"), UNSTORABLE, ids=[label for label, _ in UNSTORABLE])
def test_unstorable_condition_values_are_refused_when_the_workflow_is_built(
    label: str, value: Any
) -> None:
    @workflow(name=f"cna_bad_build_{label}")
    def bad(o):  # type: ignore[no-untyped-def]
        return cna_val(o, when=o.at("a").eq(value))

    with pytest.raises(InvalidGraph):
        _ = bad.graph


@pytest.mark.parametrize("shape", ["and-bool", "or-ref", "invert-ref"])
def test_combining_a_condition_with_a_non_condition_is_a_typed_error(shape: str) -> None:
    @workflow(name=f"cna_bad_combine_{shape.replace('-', '_')}")
    def bad(o):  # type: ignore[no-untyped-def]
        v = cna_get(o)
        cond = {
            "and-bool": lambda: v.gt(1) & True,
            "or-ref": lambda: v.gt(1) | v,
            "invert-ref": lambda: ~v,
        }[shape]()
        return cna_val(o, when=cond)

    # a plain TypeError before: InvalidGraph with the rest of the graph's problems, or
    # BuildTimeValue for an operator on a reference itself, as `not ref` is
    expected = BuildTimeValue if shape == "invert-ref" else InvalidGraph
    with pytest.raises(expected, match="truthy"):
        _ = bad.graph


def test_a_condition_used_where_a_value_is_needed_is_a_build_time_error() -> None:
    @workflow(name="cna_bad_and")
    def bad(o):  # type: ignore[no-untyped-def]
        v = cna_get(o)
        return cna_val(o, when=v.gt(1) and v.lt(5))

    with pytest.raises(BuildTimeValue, match="combine conditions with &"):
        _ = bad.graph


def _negative_index_flow(index: int) -> Any:
    @workflow(name=f"cna_negative_index_{-index}")
    def flow(o):  # type: ignore[no-untyped-def]
        return cna_val(o, when=o.at("items", index).eq(3))

    return flow


NEGATIVE_INDEX_FLOWS = {index: _negative_index_flow(index) for index in (-1, -2, -3, -4)}


@pytest.mark.parametrize(
    ("index", "items", "runs"),
    [
        (-1, [1, 2, 3], True),
        (-1, [3, 2], False),
        (-2, [1, 3, 2], True),
        (-3, [3, 1, 2], True),
        (-4, [3, 1, 2], False),  # before the first item: the path does not exist
        (-1, [], False),
    ],
)
def test_a_negative_list_index_counts_from_the_end_as_in_python(
    client: Client, index: int, items: list[int], runs: bool
) -> None:
    """It was accepted and never matched (a negative subscript is an error in a strict
    SQL/JSON path, read as false): the node was always skipped."""
    run = client.submit(NEGATIVE_INDEX_FLOWS[index], {"items": items})
    assert (states(client, run.id)["cna_val"] is not StepState.SKIPPED) is runs


def test_a_list_index_beyond_32_bits_is_refused() -> None:
    @workflow(name="cna_bad_huge_index")
    def bad(o):  # type: ignore[no-untyped-def]
        return cna_val(o, when=o.at("items", 2**31).eq(3))

    with pytest.raises(InvalidGraph, match="list index"):
        _ = bad.graph


def test_a_condition_on_an_action_output_is_refused() -> None:
    @workflow(name="cna_bad_action_cond")
    def bad(o):  # type: ignore[no-untyped-def]
        sent = cna_notify(o)
        return cna_val(o, when=sent.truthy())

    with pytest.raises(InvalidGraph, match="an @action, whose output is not kept"):
        _ = bad.graph


def test_an_action_as_the_result_node_is_refused() -> None:
    """It built, and result() gave None though the handler returned True."""

    @workflow(name="cna_bad_action_result")
    def flow(o):  # type: ignore[no-untyped-def]
        return cna_notify(o)

    with pytest.raises(InvalidGraph, match=r"result node .* is an @action"):
        _ = flow.graph


def test_returning_another_workflows_node_is_refused() -> None:
    leaked: list[Any] = []

    @workflow(name="cna_leak_source")
    def source(o):  # type: ignore[no-untyped-def]
        ref = cna_label(o)
        leaked.append(ref)
        return ref

    @workflow(name="cna_leak_user")
    def user(o):  # type: ignore[no-untyped-def]
        cna_label(o)  # a node of this workflow with the same id as the leaked one
        cna_val(o)
        _ = source.graph
        return leaked[-1]

    # it built, with its own node of the same id as the result
    with pytest.raises(InvalidGraph, match="a node of workflow 'cna_leak_source'"):
        _ = user.graph


def test_define_result_twice_with_different_nodes_is_refused() -> None:
    @workflow(name="cna_bad_two_results")
    def bad(o):  # type: ignore[no-untyped-def]
        define_result(cna_val(o))
        define_result(cna_label(o))

    with pytest.raises(InvalidGraph, match="name one node"):  # the last one won
        _ = bad.graph


# -- semantics judged at submit (no worker) ------------------------------------------------


def test_input_conditions_follow_python_truthiness_json_types_and_code_point_order(
    client: Client,
) -> None:
    truthy = {"f0": 0.0, "s0": "0", "l0": [0], "dn": {"a": None}, "sf": "false", "e": {}}
    compared = {
        "B_lt_a": ("s", "lt", "a"),  # "B" (66) < "a" (97) by code point, not by locale
        "e_gt_z": ("acc", "gt", "z"),  # "é" (233) > "z"
        "astral_gt_bmp": ("emoji", "gt", "\uffff"),  # by code point, not UTF-16 units
        "str_vs_int": ("n", "gt", 5),  # "10" is a string: no comparison with 5
        "int_vs_bool": ("one", "eq", True),  # 1 is not true in JSON
    }

    @workflow(name="cna_input_semantics")
    def flow(o):  # type: ignore[no-untyped-def]
        refs = [cna_val.named(f"t_{k}")(o, when=o.at(k).truthy()) for k in truthy]
        for node, (key, op, value) in compared.items():
            refs.append(cna_val.named(node)(o, when=getattr(o.at(key), op)(value)))
            refs.append(cna_val.named(f"not_{node}")(o, when=~getattr(o.at(key), op)(value)))
        return cna_val.named("all")(refs)

    run = client.submit(
        flow,
        {**truthy, "s": "B", "acc": "é", "emoji": "😀", "n": "10", "one": 1},
    )
    shown = states(client, run.id)
    ran = {n for n, s in shown.items() if s is StepState.AVAILABLE}
    assert {n[2:] for n in ran if n.startswith("t_")} == {"s0", "l0", "dn", "sf"}
    assert {n for n in ran if n in compared} == {"B_lt_a", "e_gt_z", "astral_gt_bmp"}
    assert {n[4:] for n in ran if n.startswith("not_")} == {"str_vs_int", "int_vs_bool"}
    assert shown["all"] is StepState.PENDING


def test_a_run_whose_every_node_is_skipped_at_submit_completes_without_a_worker(
    client: Client,
) -> None:
    @workflow(name="cna_nothing_to_do")
    def flow(o):  # type: ignore[no-untyped-def]
        first = cna_val.named("first")(o, when=o.at("go").eq(True))
        second = cna_val.named("second")(first)
        return cna_pair(first, second)

    one = client.submit(flow, {"go": False})
    assert client.get_run(one.id).state is RunState.COMPLETED
    assert one.result(timeout=0) is None
    assert set(states(client, one.id).values()) == {StepState.SKIPPED}
    many = client.submit_many(flow, [{"go": False}, {}, None])
    assert [client.get_run(h.id).state for h in many] == [RunState.COMPLETED] * 3
    assert sum(CALLS.values()) == 0


def test_skipped_result_nodes_of_every_kind_give_none(client: Client) -> None:
    """A skipped fan-out, wait or child as the result node: the run completes at submit
    and its result is None (never NoOutput, never a hang)."""
    for flow in (cna_result_fan, cna_result_wait, cna_result_child):
        run = client.submit(flow, {"go": False})
        assert client.get_run(run.id).state is RunState.COMPLETED, flow.name
        assert run.result(timeout=0) is None
    assert client.children_of(run.id) == []


# -- skips through joins, fan-outs, children and waits ------------------------------------


def test_a_child_run_skipped_at_its_start_gives_none_and_the_parent_branches_on_it(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, cna_on_child, cna_inner)
    skipped = client.submit(cna_on_child, {"go": False})
    assert skipped.result(timeout=15) == [None, {"go": False}]
    (sub,) = client.children_of(skipped.id)
    assert client.get_run(sub["id"]).step("inner").state is StepState.SKIPPED
    assert states(client, skipped.id)["yes"] is StepState.SKIPPED
    ran = client.submit(cna_on_child, {"go": True})
    assert ran.result(timeout=15) == [{"go": True}, None]


def test_a_fan_out_over_a_skipped_list_with_on_skip_run_fails_clearly(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    run = client.submit(cna_fan_skipped, 1)
    with pytest.raises(RunFailed) as failed:
        run.result(timeout=15)
    assert failed.value.error_kind == "invalid_input"
    # the message names the node the list comes from (it named the fan-out as its list)
    assert "needs a JSON list from 'cna_list'" in str(failed.value)
    assert states(client, run.id)["cna_list"] is StepState.SKIPPED


def test_a_child_with_on_skip_run_gets_none_for_its_skipped_input(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, cna_child_skipped_input, cna_echo)
    run = client.submit(cna_child_skipped_input, 1)
    assert run.result(timeout=15) is None
    (sub,) = client.children_of(run.id)
    assert client.get_run(sub["id"]).input is None
    assert CALLS["echo"] == 1 and CALLS["maybe"] == 0


def test_a_join_of_a_skipped_branch_and_a_contained_failure_then_a_retry(
    client: Client, start_worker: StartWorker
) -> None:
    FAILING.add("failing")
    start_worker(*HANDLERS)
    run = client.submit(cna_contained_join, {"x": 2})
    assert run.wait(timeout=15).state is RunState.COMPLETED
    assert states(client, run.id) == {
        "skipped": StepState.SKIPPED,
        "failing": StepState.DISCARDED,
        "cna_pair": StepState.CANCELLED,
    }
    with pytest.raises(NoOutput, match="cancel_branch"):
        run.result(timeout=0)
    FAILING.clear()
    client.retry(run.id, "failing")
    assert run.result(timeout=15) == [None, {"x": 2}]
    assert states(client, run.id)["skipped"] is StepState.SKIPPED
    assert CALLS["skipped"] == 0


def test_conditions_on_a_fan_out_output(client: Client, start_worker: StartWorker) -> None:
    start_worker(*HANDLERS)
    assert client.submit(cna_fan_cond, 3).result(timeout=15) == [[0, 1, 2], 3]
    short = client.submit(cna_fan_cond, 2)
    assert short.result(timeout=15) == [[0, 1], None]
    assert states(client, short.id)["many"] is StepState.SKIPPED


def test_unicode_and_quotes_in_node_ids_and_condition_paths(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    hit = client.submit(cna_odd_ids, {'k"\\😀': {"\n": "ü"}})
    miss = client.submit(cna_odd_ids, {'k"\\😀': {"\n": "u"}})
    assert hit.result(timeout=15) == {'k"\\😀': {"\n": "ü"}}
    assert miss.result(timeout=15) is None
    assert states(client, miss.id)["odd"] is StepState.SKIPPED


# -- signals feeding conditions -----------------------------------------------------------


def test_a_signal_to_a_skipped_wait_is_not_stored_and_the_run_goes_on(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    run = client.submit(cna_sig_skip, {"ask": False})
    assert states(client, run.id)["cna_amount"] is StepState.SKIPPED
    assert client.signal(run.id, "cna_amount", 5) is Delivery.NOT_STORED
    assert client.signal(run.id, "cna_other", 1) is Delivery.CONSUMED
    assert run.result(timeout=15) == [None, 1]


def test_a_signal_payload_decides_the_branch_and_a_wrong_type_takes_the_else(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    runs = {amount: client.submit(cna_sig_cond, None) for amount in (500, 5, "500")}
    for amount, run in runs.items():
        client.signal(run.id, "cna_order", {"amount": amount})
    assert runs[500].result(timeout=15) == [{"amount": 500}, None]
    assert runs[5].result(timeout=15) == [None, {"amount": 5}]
    assert runs["500"].result(timeout=15) == [None, {"amount": "500"}]  # a string: no match


def test_conditions_on_wait_any_and_wait_n_outputs(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    run = client.submit(cna_vote, "v")
    client.signal(run.id, "cna_no", "because")
    client.signal(run.id, "cna_ballot", "y")
    client.signal(run.id, "cna_ballot", "y")
    assert run.result(timeout=15) == [None, "v"]
    assert states(client, run.id)["approve"] is StepState.SKIPPED


# -- operator retry, replay, cancel, pause -------------------------------------------------


def test_retry_refuses_a_skipped_node_and_a_replay_of_it_judges_it_again(
    client: Client, start_worker: StartWorker
) -> None:
    VALUES["k"] = 1
    start_worker(*HANDLERS)
    run = client.submit(cna_chain, "k")
    assert run.result(timeout=15) is None
    with pytest.raises(InvalidTransition, match=r"is skipped; .* judges its condition again"):
        client.retry(run.id, "big")
    VALUES["k"] = 9  # its condition reads cna_get, which is not replayed: still 1
    client.retry(run.id, "big", force=True)
    assert run.result(timeout=15) is None
    assert states(client, run.id)["big"] is StepState.SKIPPED
    assert CALLS["big"] == 0 and CALLS["cna_get"] == 1
    client.retry(run.id, "cna_get", force=True)  # now the source says 9
    assert run.result(timeout=15) == 9
    assert (CALLS["big"], CALLS["after_big"]) == (1, 1)


def test_a_replay_starts_a_child_node_its_condition_had_skipped(
    client: Client, start_worker: StartWorker
) -> None:
    VALUES["c"] = 1
    start_worker(*HANDLERS, cna_cond_child, cna_echo)
    run = client.submit(cna_cond_child, "c")
    assert run.result(timeout=15) is None
    assert client.children_of(run.id) == []
    VALUES["c"] = 9
    client.retry(run.id, "cna_get", force=True)
    assert run.result(timeout=15) == "from child"
    assert len(client.children_of(run.id)) == 1
    with pytest.raises(InvalidTransition, match="child run"):
        client.retry(run.id, "cna_get", force=True)


def test_a_cancelled_run_retried_judges_its_conditions_on_the_later_signal(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    run = client.submit(cna_sig_cond, None)
    wait_until(
        lambda: states(client, run.id)["cna_order"] is StepState.WAITING_SIGNAL,
        what="the wait to start",
    )
    client.cancel(run.id)
    with pytest.raises(RunFailed) as failed:
        run.result(timeout=0)
    assert failed.value.error_kind == "cancelled"
    client.retry(run.id, "cna_order")
    assert client.signal(run.id, "cna_order", {"amount": 1}) is Delivery.CONSUMED
    assert run.result(timeout=15) == [None, {"amount": 1}]
    assert states(client, run.id)["big"] is StepState.SKIPPED


def test_conditions_are_judged_on_resume_not_while_paused(
    client: Client, start_worker: StartWorker
) -> None:
    gate.clear()
    start_worker(*HANDLERS)
    run = client.submit(cna_split, 9)
    wait_until(
        lambda: states(client, run.id)["cna_gated"] is StepState.RUNNING, what="the step to run"
    )
    client.pause(run.id)
    gate.set()
    wait_until(
        lambda: states(client, run.id)["cna_gated"] is StepState.COMPLETED,
        what="the running step to finish while paused",
    )
    assert {states(client, run.id)[n] for n in ("big", "small", "cna_pair")} == {StepState.PAUSED}
    assert client.get_run(run.id).state is RunState.PAUSED
    client.resume(run.id)
    assert run.result(timeout=15) == [9, None]
    assert states(client, run.id)["small"] is StepState.SKIPPED
    assert CALLS["small"] == 0


def test_a_paused_run_whose_remaining_nodes_all_skip_completes_on_resume(
    client: Client, start_worker: StartWorker
) -> None:
    gate.clear()
    start_worker(*HANDLERS)
    run = client.submit(cna_all_skip_after, 1)
    wait_until(
        lambda: states(client, run.id)["cna_gated"] is StepState.RUNNING, what="the step to run"
    )
    client.pause(run.id)
    gate.set()
    wait_until(
        lambda: states(client, run.id)["cna_gated"] is StepState.COMPLETED,
        what="the running step to finish while paused",
    )
    assert client.get_run(run.id).state is RunState.PAUSED
    client.resume(run.id)  # both nodes are judged now, skipped, and the run ends here
    after = client.get_run(run.id)
    assert after.state is RunState.COMPLETED
    assert {after.step(n).state for n in ("a", "b")} == {StepState.SKIPPED}
    with pytest.raises(NoOutput):
        run.result(timeout=0)
