"""Assembles the engine's hooks: mailbox, fan-out and child-run behaviour, and child compiling."""

from __future__ import annotations

from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.engine import children, fanout, signals
from cyclone_dsl.engine.transitions import Hooks
from cyclone_dsl.graph.compile import instantiate
from cyclone_dsl.graph.rows import CompiledRun
from cyclone_dsl.payload import JSONValue


def engine_hooks(registry: Registry, also: Registry | None = None) -> Hooks:
    """The hooks every client, worker and scanner of this process runs transitions with.

    Child workflows compile from ``registry``, else from ``also``; one neither has is
    left for a worker that has it (see ``children.start_deferred``).
    """

    def compile_child(workflow: str, run_input: JSONValue) -> CompiledRun:
        if also is not None and workflow not in registry.workflows:
            return instantiate(also.workflow(workflow).template, run_input)
        return instantiate(registry.workflow(workflow).template, run_input)

    return Hooks(
        compile_child=compile_child,
        on_activated=[
            signals.consume_buffered_on_activation,
            fanout.expand_on_activation,
            children.start_on_activation,
        ],
        on_items_completed=[fanout.items_finished],
        on_items_discarded=[fanout.items_discarded],
        on_resumed=[fanout.gate_on_resume],
        on_runs_ended=[children.settle_parents],
    )
