"""Assembles the engine's hooks: mailbox, fan-out and child-run behaviour."""

from __future__ import annotations

from cyclone_dsl.engine import children, control, fanout, signals
from cyclone_dsl.engine.transitions import ChildCompiler, Hooks


def build_hooks(compile_child: ChildCompiler | None) -> Hooks:
    """The hooks every transition of an :class:`~cyclone_dsl.engine.core.Engine` runs with.

    ``compile_child`` turns a child node's workflow name and input into rows; a
    child workflow it does not know (or every one, when it is None) is left for a
    worker that has it (see ``children.start_deferred``).
    """
    return Hooks(
        compile_child=compile_child,
        on_activated=[
            signals.consume_buffered_on_activation,
            fanout.expand_on_activation,
            children.start_on_activation,
        ],
        on_items_completed=[fanout.items_finished],
        on_items_discarded=[fanout.items_discarded],
        on_resumed=[fanout.gate_on_resume, children.wake_unstarted_on_resume],
        on_runs_ended=[children.settle_parents],
        on_nodes_cancelled=[children.cancel_with_nodes],
        retry_child=control.retry_child_run,
    )
