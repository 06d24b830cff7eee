"""Draws a run's nodes in the terminal: a tree by dependency, with states and timings."""

from __future__ import annotations

import json

import click

from cyclone_dsl.client.model import Run, Step, StepEvent
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


#: A fan-out with more items than this is drawn as one line of counts.
COLLAPSE_ITEMS = 10
#: Failed items of a collapsed fan-out still drawn one by one (their errors matter).
SHOWN_FAILURES = 5
#: Levels of the tree drawn indented; deeper nodes are drawn at this depth, in order.
MAX_DEPTH = 30


def printable(text: str) -> str:
    """``text`` with its control characters escaped (``\\n``, ``\\x1b``): a name stays on
    its line, and a terminal gets nothing to act on."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def step_line(step: Step, note: str = "") -> str:
    mark, colour = _MARK[step.state]
    took = ""
    if step.started_at and step.completed_at:
        took = f" {(step.completed_at - step.started_at).total_seconds():.2f}s"
    retries = f" attempt {step.attempt_label}" if step.attempt or step.attempts else ""
    error = (
        f" — {printable(step.error)}" if step.error and step.state != StepState.COMPLETED else ""
    )
    if step.attempts and step.state == StepState.COMPLETED:
        error = f" ({len(step.attempts)} earlier attempt(s) failed; see --json)"
    text = f"{mark} {printable(step.node)} [{step.state}]{took}{retries}{error}{note}"
    return click.style(text, fg=colour)


def items_line(node: str, items: list[Step]) -> str:
    """``ship_line[0..499]  480 completed, 15 running, 5 discarded``."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.state.value] = counts.get(item.state.value, 0) + 1
    indexes = [i.item_index for i in items if i.item_index is not None]
    span = f"[{min(indexes)}..{max(indexes)}]" if indexes else "[]"
    order = [state.value for state in StepState]
    parts = ", ".join(f"{counts[state]} {state}" for state in order if state in counts)
    return f"{printable(node)}{span}  {len(items)} items: {parts}"


def render_run(
    run: Run,
    deps: dict[str, list[str]],
    *,
    children: dict[str, int] | None = None,
    reasons: dict[str, str] | None = None,
) -> str:
    """The run's nodes as a tree: each node under the first upstream it depends on.

    A fan-out of more than :data:`COLLAPSE_ITEMS` items is one line of counts (and its
    failed items); a child node names its child run; a step a limit holds back says why.
    """
    children = children or {}
    reasons = reasons or {}
    below: dict[str | None, list[Step]] = {}
    items: dict[str, list[Step]] = {}
    for step in run.steps:
        if step.item_of is not None:
            items.setdefault(step.item_of, []).append(step)
            continue
        upstream = deps.get(step.node)
        below.setdefault(upstream[0] if upstream else None, []).append(step)
    lines = [click.style(f"run {run.id} {printable(run.workflow)} [{run.state}]", bold=True)]
    if run.forked_from is not None:
        lines.append(f"fork of run {run.forked_from} from node {run.fork_node!r}")

    def note(step: Step) -> str:
        if step.copied:
            return f" (copied from run {run.forked_from})"
        if step.node in children:
            return f" → child run {children[step.node]}"
        if step.node in reasons:
            return f" — {reasons[step.node]}"
        return ""

    def node_lines(step: Step, prefix: str, last: bool) -> str:
        """The step's line and its items'; returns the prefix of what hangs below it."""
        joins = deps.get(step.node, [])[1:]
        also = f"  (also after {', '.join(joins)})" if joins else ""
        lines.append(f"{prefix}{'└─ ' if last else '├─ '}{step_line(step, note(step))}{also}")
        # Past MAX_DEPTH levels the tree stops indenting: a chain of a thousand nodes is
        # a thousand lines, in order, not a staircase as wide as the square of its length.
        deeper = len(prefix) < 3 * MAX_DEPTH
        inner = prefix + ("   " if last else "│  ") if deeper else prefix
        fanned = items.get(step.node, [])
        if len(fanned) > COLLAPSE_ITEMS:
            failed = [i for i in fanned if i.state == StepState.DISCARDED][:SHOWN_FAILURES]
            lines.append(
                f"{inner}{'├─ ' if failed or below.get(step.node) else '└─ '}"
                f"{items_line(step.node, fanned)}"
            )
            for item in failed:
                lines.append(f"{inner}│    {step_line(item, note(item))}")
        else:
            for number, item in enumerate(fanned):
                end = number == len(fanned) - 1 and not below.get(step.node)
                lines.append(f"{inner}{'└─ ' if end else '├─ '}{step_line(item, note(item))}")
        return inner

    # Depth first, with a stack of its own (a chain is as deep as it is long: recursion
    # would hit Python's limit at about a thousand nodes).
    stack: list[tuple[Step, str, bool]] = []

    def push_below(parent: str | None, prefix: str) -> None:
        kids = below.get(parent, [])
        stack.extend(
            (kid, prefix, i == len(kids) - 1) for i, kid in reversed(list(enumerate(kids)))
        )

    push_below(None, "")
    while stack:
        step, prefix, last = stack.pop()
        push_below(step.node, node_lines(step, prefix, last))
    return "\n".join(lines)


def event_line(event: StepEvent) -> str:
    """``12:00:01.250 #7 resize[3] progress 30/100 (30%) thumbnails``: one line per event.

    The attempt is shown from the second on; an event of a fenced execution says so.
    """
    when = event.at.astimezone().strftime("%H:%M:%S.%f")[:-3]
    attempt = f" attempt {event.attempt}" if event.attempt > 1 else ""
    data = event.data
    if event.kind == "progress" and isinstance(data, dict):
        done, total, message = data.get("done"), data.get("total"), data.get("message")
        share = ""
        if isinstance(done, int) and isinstance(total, int) and total:
            share = f" ({100 * done // total}%)"
        body = f"progress {done}/{total}{share}" + (f" {message}" if message else "")
    else:
        body = json.dumps(data, ensure_ascii=False)
    text = printable(f"{when} #{event.seq} {event.node}{attempt} {body}")
    if event.fenced:
        return click.style(f"{text}  (fenced: its execution lost the lease)", fg="yellow")
    return text
