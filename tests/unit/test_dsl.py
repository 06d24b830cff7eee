"""The decorator DSL: each construct, and each validation message (no database)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from cyclone_dsl import (
    InvalidGraph,
    Registry,
    action,
    child,
    define_result,
    for_each,
    schedule,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.dsl.step import StepDef
from cyclone_dsl.errors import InvalidArgument, RegistryConflict, ScheduleError, UnknownWorkflow
from cyclone_dsl.graph.compile import compile_run
from cyclone_dsl.graph.model import ArgKind, Binding
from tests.unit import flows


def test_a_step_called_outside_a_builder_runs_the_function() -> None:
    assert flows.fetch("o-1") == {"id": "o-1"}
    assert flows.notify(3) is None


def test_async_steps_are_recorded_as_async() -> None:
    @step(name="u_async")
    async def fetch_async(x: int) -> int:
        return x + 1

    assert fetch_async.is_async
    assert asyncio.run(fetch_async(1)) == 2  # type: ignore[arg-type]
    assert not flows.fetch.is_async


def test_the_flagship_graph_has_every_binding() -> None:
    graph = flows.orders.graph
    ids = [n.id for n in graph.nodes]
    assert ids == [
        "u_fetch",
        "approved",
        "u_charge",
        "u_lines",
        "u_ship",
        "u_summarize",
        "u_notify",
    ]
    assert graph.node("u_fetch").binding is Binding.STATIC
    assert graph.node("u_fetch").args[0].kind is ArgKind.INPUT
    assert graph.node("u_charge").binding is Binding.TUPLE
    assert graph.node("u_summarize").binding is Binding.ARRAY
    assert graph.node("u_notify").control_deps == ("u_summarize",)
    assert graph.node("u_ship").fan_out is not None
    assert graph.node("u_ship").fan_out.max_parallel == 8
    assert graph.node("u_fetch").options.queue == "io"
    assert graph.result == "u_summarize"


def test_compile_produces_the_rows_of_one_run() -> None:
    compiled = compile_run(flows.orders.graph, "o-7")
    steps = {s.node: s for s in compiled.steps}
    assert steps["u_fetch"].state == "available"
    assert steps["u_fetch"].input == '"o-7"'
    assert steps["approved"].state == "pending"
    assert steps["approved"].signal_name == "approved"
    assert steps["approved"].wait_for == timedelta(hours=1)
    assert steps["u_charge"].input is None
    assert steps["u_ship"].input_from == "u_lines"
    assert steps["u_ship"].fan_out_parallel == 8
    assert steps["u_ship"].fan_out_max_bytes == 0
    assert compiled.has_fan_out
    assert compiled.result_node == "u_summarize"
    deps = {(d.node, d.dep_node, d.dep_type) for d in compiled.deps}
    assert ("u_notify", "u_summarize", "control") in deps
    assert ("u_notify", "u_charge", "data") in deps
    inputs = {(i.node, i.slot, i.dep_node, i.assembly_mode) for i in compiled.inputs}
    assert ("u_charge", 0, "u_fetch", "tuple") in inputs
    assert ("u_charge", 1, "approved", "tuple") in inputs
    assert ("u_summarize", 1, "u_ship", "array") in inputs


def test_child_waits_and_timer_compile() -> None:
    compiled = compile_run(flows.parent.graph, 1)
    steps = {s.node: s for s in compiled.steps}
    assert steps["votes"].wait_count == 3
    assert steps["any_yes_no"].signal_names == ("yes", "no")
    assert steps["any_yes_no"].signal_name is None
    assert steps["timer"].kind == "@timer"
    assert steps["timer"].wait_for == timedelta(seconds=30)
    assert steps["u_orders"].kind == "@child"
    assert steps["u_orders"].child_workflow == "u_orders"
    assert steps["u_orders"].child_needs_result is True
    assert compiled.result_node == "u_orders"


def test_default_ids_are_made_unique_and_named_wins() -> None:
    @workflow(name="u_ids")
    def ids(x):  # type: ignore[no-untyped-def]
        a = flows.ship(x)
        b = flows.ship(a)
        flows.ship(b).named("last")
        return flows.ship.named("u_ship_2")(b)

    assert [n.id for n in ids.graph.nodes] == ["u_ship", "u_ship_3", "last", "u_ship_2"]


def test_define_result_marks_the_result() -> None:
    @workflow(name="u_define")
    def defined(x):  # type: ignore[no-untyped-def]
        a = flows.ship(x)
        define_result(a)
        flows.ship(a)

    assert defined.graph.result == "u_ship"


def test_per_node_options_override_decorator_options() -> None:
    @workflow(name="u_opts")
    def opts(x):  # type: ignore[no-untyped-def]
        return flows.fetch(x, queue="other", max_attempts=9, timeout=5)

    node = opts.graph.node("u_fetch")
    assert node.options.queue == "other"
    assert node.options.max_attempts == 9
    assert node.options.timeout == timedelta(seconds=5)


def invalid(builder: object) -> InvalidGraph:
    with pytest.raises(InvalidGraph) as caught:
        _ = builder.graph  # type: ignore[attr-defined]
    return caught.value


def test_every_problem_is_reported_with_its_node() -> None:
    @workflow(name="u_bad")
    def bad(x):  # type: ignore[no-untyped-def]
        a = flows.ship(x, queue="")
        b = flows.ship(a, max_attempts=0)
        flows.ship(b, on_dep_failure="ignore")
        wait_signal("s")
        wait_signal("s")
        flows.summarize(a, a, a, a, a)

    error = invalid(bad)
    text = str(error)
    assert "queue must be a non-empty string" in text
    assert "max_attempts must be an integer of at least 1" in text
    assert "on_dep_failure must be 'fail_run' or 'cancel_branch'" in text
    assert "signal 's' is awaited by 2 waits" in text
    assert "at most 4 arguments" in text
    assert {"u_ship", "u_ship_2", "u_ship_3", "s_2", "u_summarize"} <= set(error.node_ids)


def test_references_from_another_workflow_are_refused() -> None:
    leaked: list[object] = []

    @workflow(name="u_leak_a")
    def first(x):  # type: ignore[no-untyped-def]
        ref = flows.ship(x)
        leaked.append(ref)
        return ref

    @workflow(name="u_leak_b")
    def second(x):  # type: ignore[no-untyped-def]
        return flows.ship(leaked[0])

    _ = first.graph
    assert "belongs to workflow 'u_leak_a'" in str(invalid(second))


def test_child_recursion_is_refused() -> None:
    @workflow(name="u_rec_a")
    def rec_a(x):  # type: ignore[no-untyped-def]
        return child(rec_b, x)

    @workflow(name="u_rec_b")
    def rec_b(x):  # type: ignore[no-untyped-def]
        return child(rec_a, x)

    assert "recurses" in str(invalid(rec_a))


def test_bad_wait_arguments() -> None:
    from cyclone_dsl import wait_n, wait_timer

    @workflow(name="u_bad_waits")
    def waits(x):  # type: ignore[no-untyped-def]
        wait_n("v", 0)
        wait_timer(-1)
        wait_signal("t", timeout="soon")

    text = str(invalid(waits))
    assert "wait_n needs n from 1 to" in text
    assert "timer or timeout must be a positive duration" in text


def test_a_signal_name_longer_than_client_signal_takes_is_refused() -> None:
    """The graph took a name of 1,100 bytes that client.signal refuses (over 1,024): the
    wait could never be signalled."""

    @workflow(name="u_long_signal")
    def long_signal(x):  # type: ignore[no-untyped-def]
        return wait_signal("s" * 1100)

    assert "signal names are at most 1024 bytes" in str(invalid(long_signal))


def test_counts_past_the_columns_range_are_refused() -> None:
    """A quorum, a fan-out's max_parallel or max_items past 2**31 - 1 (int columns) or its
    max_bytes past 2**63 - 1 (bigint) reached the database and came back as a raw
    NumericValueOutOfRange from submit."""
    from cyclone_dsl import wait_n

    @workflow(name="u_huge_counts")
    def huge(x):  # type: ignore[no-untyped-def]
        wait_n("v", 2**31)
        for_each(flows.ship, over=[1], max_parallel=2**31)
        for_each(flows.ship, over=[1], max_items=2**31)
        return for_each(flows.ship, over=[1], max_bytes=2**63)

    text = str(invalid(huge))
    assert f"wait_n needs n from 1 to {2**31 - 1}, not {2**31}" in text
    assert f"max_parallel must be an integer from 0 to {2**31 - 1}" in text
    assert f"max_items must be an integer from 1 to {2**31 - 1}" in text
    assert f"max_bytes must be an integer from 0 to {2**63 - 1}" in text


def test_for_each_needs_a_step() -> None:
    @workflow(name="u_bad_fan")
    def fan(x):  # type: ignore[no-untyped-def]
        return for_each(len, over=x)

    assert "for_each needs a @step, @action or @workflow" in str(invalid(fan))


def test_literals_must_be_json() -> None:
    @workflow(name="u_bad_literal")
    def literal(x):  # type: ignore[no-untyped-def]
        return flows.ship(float("nan"))

    assert "not JSON" in str(invalid(literal))


def test_decorator_options_are_validated() -> None:
    with pytest.raises(InvalidArgument, match="queue name is 257 bytes"):

        @step(name="u_long_queue", queue="q" * 257)
        def long_queue() -> None: ...

    with pytest.raises(InvalidArgument, match="queue name is not valid UTF-8"):

        @step(name="u_surrogate_queue", queue="q\ud800")
        def surrogate_queue() -> None: ...

    with pytest.raises(InvalidArgument, match="max_reclaims"):

        @action(name="u_bad_reclaims", max_reclaims=-1)
        def bad_reclaims() -> None: ...

    # Past the int column: every scanner pass over an expired lease of that kind failed.
    with pytest.raises(
        InvalidArgument, match=f"max_reclaims must be an integer from 0 to {2**31 - 1}"
    ):

        @action(name="u_huge_reclaims", max_reclaims=2**31)
        def huge_reclaims() -> None: ...


def test_builders_take_one_parameter_or_none() -> None:
    with pytest.raises(InvalidArgument, match="one parameter"):

        @workflow(name="u_two")
        def two(a, b):  # type: ignore[no-untyped-def]
            return flows.ship(a)


def test_registry_conflicts_and_lookup() -> None:
    registry = Registry.from_objects([flows])
    assert registry.workflow("u_orders") is flows.orders
    assert registry.kind("u_ship") is flows.ship
    assert "u_orders" in registry.workflows
    assert set(dict(registry.handlers())) >= {"u_fetch", "u_ship", "u_notify"}

    same_function_again = flows.ship.with_options(queue="x")
    registry.register(same_function_again)  # a configured copy of the same handler is fine
    assert registry.kind("u_ship") is flows.ship
    impostor = StepDef(lambda y: y, "u_ship", True, flows.ship.options)
    with pytest.raises(RegistryConflict, match="u_ship"):
        registry.register(impostor)
    with pytest.raises(UnknownWorkflow):
        registry.workflow("nope")


def test_schedule_metadata_is_validated_and_stored() -> None:
    @schedule("*/5 * * * *", id="every5", location="Europe/Paris")
    @workflow(name="u_scheduled")
    def scheduled():  # type: ignore[no-untyped-def]
        return flows.ship(1)

    assert scheduled.schedules[0].id == "every5"
    with pytest.raises(ScheduleError, match="cron"):
        schedule("not a cron")
    with pytest.raises(ScheduleError, match="time zone"):
        schedule("* * * * *", location="Mars/Base")


def test_wait_any_refuses_one_name_given_as_a_string() -> None:
    """A string is iterable: wait_any("go") waited for a signal "g" or a signal "o"."""
    from cyclone_dsl import wait_any

    @workflow(name="u_any_string")
    def waits(x):  # type: ignore[no-untyped-def]
        return wait_any("go")

    assert "wait_any takes a list of signal names" in str(invalid(waits))


@step(name="u_fe_item")
def fe_item(x: object) -> object:
    return x


@pytest.mark.parametrize("over", ["abc", {"a": 1}, 5], ids=repr)
def test_for_each_over_a_literal_that_is_not_a_list_is_refused(over: object) -> None:
    """It validated, and each run's fan-out failed when it started."""

    @workflow(name=f"u_fe_literal_{type(over).__name__}")
    def fans(x):  # type: ignore[no-untyped-def]
        return for_each(fe_item, over=over)

    assert "for_each over= takes a list" in str(invalid(fans))
