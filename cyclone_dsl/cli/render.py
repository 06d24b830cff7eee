"""Draws a run's nodes in the terminal: a tree by dependency, with states and timings."""

from __future__ import annotations

import click

from cyclone_dsl.client.model import Run, Step
from cyclone_dsl.states import StepState

_MARK = {
    StepState.COMPLETED: ("✔", "green"),
    StepState.RUNNING: ("▶", "cyan"),
    StepState.AVAILABLE: ("…", "white"),
    StepState.PENDING: ("·", "bright_black"),
    StepState.DISCARDED: ("✘", "red"),
    StepState.CANCELLED: ("⊘", "yellow"),
    StepState.WAITING_SIGNAL: ("✉", "magenta"),
    StepState.WAITING_TIMER: ("⏲", "magenta"),
    StepState.WAITING_CHILD: ("↳", "magenta"),
    StepState.PAUSED: ("‖", "yellow"),
}


def step_line(step: Step) -> str:
    mark, colour = _MARK[step.state]
    took = ""
    if step.started_at and step.completed_at:
        took = f" {(step.completed_at - step.started_at).total_seconds():.2f}s"
    retries = f" attempt {step.attempt_label}" if step.attempt or step.attempts else ""
    error = f" — {step.error}" if step.error and step.state != StepState.COMPLETED else ""
    if step.attempts and step.state == StepState.COMPLETED:
        error = f" ({len(step.attempts)} earlier attempt(s) failed; see --json)"
    text = f"{mark} {step.node} [{step.state}]{took}{retries}{error}"
    return click.style(text, fg=colour)


def render_run(run: Run, deps: dict[str, list[str]]) -> str:
    """The run's nodes as a tree: each node under the first upstream it depends on."""
    children: dict[str | None, list[Step]] = {}
    for step in run.steps:
        upstream = deps.get(step.node)
        parent = step.item_of or (upstream[0] if upstream else None)
        children.setdefault(parent, []).append(step)
    lines = [click.style(f"run {run.id} {run.workflow} [{run.state}]", bold=True)]

    def walk(parent: str | None, prefix: str) -> None:
        kids = children.get(parent, [])
        for index, step in enumerate(kids):
            last = index == len(kids) - 1
            joins = deps.get(step.node, [])[1:]
            also = f"  (also after {', '.join(joins)})" if joins else ""
            lines.append(f"{prefix}{'└─ ' if last else '├─ '}{step_line(step)}{also}")
            walk(step.node, prefix + ("   " if last else "│  "))

    walk(None, "")
    return "\n".join(lines)
