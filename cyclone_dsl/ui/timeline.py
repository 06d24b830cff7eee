"""A run's timeline (a waterfall): one row per node, one bar per attempt or wait.

What is known of a step's time, and where it comes from:

* when it could start (*ready*): its creation, or the end of its last dependency;
* each execution that did not complete it: the attempt history (worker, start, end,
  outcome, error); the one that completed it or still runs: the step row (``started_at``,
  ``completed_at``, ``lease_owner``);
* when a retry became due: ``scheduled_at``, for the step's latest execution only.

An attempt's bar runs from when it was queued (ready, or the end of the attempt before)
to when it ended: *queued* until a worker claimed it (a claim and the handler's start
are one instant, ``started_at``), then *running*. After a failed attempt that is
retried, the gap is *backoff* up to the retry's due time and *queued* after it; where
the due time was not kept (an attempt before the latest) the whole gap is backoff.
Waits (signal, timer, child) are one bar each from ready to their end. A fan-out's
items are one collapsed row with a density strip (how many items ran at each moment),
expanded by the page's script on click. :func:`build` is the model; :func:`draw`
renders it as HTML rows holding SVG.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from html import escape

import attrs

from cyclone_dsl.client.model import Run, Step
from cyclone_dsl.states import StepState
from cyclone_dsl.ui.humane import clock, duration, exact

#: Phases of a bar, in legend order, with their colours.
PHASES = {
    "queued": "#b0bec5",
    "backoff": "#ffcc80",
    "running": "#1565c0",
    "signal": "#ad1457",
    "timer": "#8e24aa",
    "child": "#00897b",
    "fanout": "#c5cae9",
    "copied": "#90a4ae",
    "skipped": "#e0e0e0",
}
#: Width of the plot (px), height of a row and of a bar in it.
WIDTH, ROW_H, BAR_H = 760, 24, 14
MIN_W = 2.0  # the narrowest segment drawn, in px
#: Item rows drawn under an expanded fan-out (the nodes table lists them all).
MAX_ITEM_ROWS = 100
#: Slices of the density strip.
DENSITY_SLICES = 80
#: Outcomes after which the next attempt waited for a retry backoff.
RETRIED = frozenset({"retried", "timeout"})
WAIT_KINDS = {"@signal": "signal", "@timer": "timer", "@child": "child"}


@attrs.frozen
class Segment:
    phase: str
    start: datetime
    end: datetime


@attrs.frozen
class Bar:
    """One attempt of a step, or one wait."""

    label: str  # "attempt 2/3", "wait for signal 'go'"
    outcome: str  # completed, retried, failed, reclaimed, running, queued, waiting...
    segments: tuple[Segment, ...]
    number: int | None = None  # the attempt's number, as the CLI shows it
    worker: str | None = None
    error: str | None = None
    error_kind: str | None = None
    note: str | None = None  # e.g. "due 10:00:03"
    traceback: str | None = None

    @property
    def start(self) -> datetime:
        return self.segments[0].start

    @property
    def end(self) -> datetime:
        return self.segments[-1].end

    @property
    def ran(self) -> Segment | None:
        """The part a worker ran, if it started."""
        return next((s for s in self.segments if s.phase == "running"), None)


@attrs.frozen
class Row:
    node: str
    kind: str
    state: str
    bars: tuple[Bar, ...]
    item_of: str | None = None
    items: tuple[Row, ...] = ()
    copied: bool = False


def _ready(step: Step, deps: Mapping[str, Sequence[str]], by_node: Mapping[str, Step]) -> datetime:
    ready = step.created_at
    for dep in deps.get(step.node, ()):
        done = by_node[dep].completed_at if dep in by_node else None
        if done is not None and done > ready:
            ready = done
    return ready


def _gap(start: datetime, end: datetime, after: str | None, due: datetime | None) -> list[Segment]:
    """The segments of the wait before an attempt, from ``start`` to ``end``."""
    if end <= start:
        return []
    if after in RETRIED:
        if due is not None and start < due < end:
            return [Segment("backoff", start, due), Segment("queued", due, end)]
        return [Segment("backoff", start, due if due is not None and due <= start else end)]
    return [Segment("queued", start, end)]


def _attempt_bars(step: Step, ready: datetime, now: datetime) -> list[Bar]:
    bars: list[Bar] = []
    label = f"/{step.max_attempts}"
    queued_from = ready
    after: str | None = None
    history = list(step.attempts)
    for a in history:
        start = a.started_at or a.ended_at
        segments = _gap(queued_from, start, after, None)
        segments.append(Segment("running", start, max(start, a.ended_at)))
        bars.append(
            Bar(
                f"attempt {a.number}{label}",
                a.outcome,
                tuple(segments),
                number=a.number,
                worker=a.worker,
                error=a.error,
                error_kind=a.error_kind,
                traceback=a.panic_stack,
            )
        )
        queued_from, after = a.ended_at, a.outcome
    recorded = {a.started_at for a in history}
    number = step.attempt + 1
    due = step.scheduled_at
    if step.started_at is not None and step.started_at not in recorded:
        # The execution the step row holds: it completed, still runs, or was cancelled.
        start = step.started_at
        end = step.completed_at or now
        segments = _gap(queued_from, start, after, due)
        segments.append(Segment("running", start, max(start, end)))
        outcome = "running" if step.state is StepState.RUNNING else step.state.value
        bars.append(
            Bar(
                f"attempt {number}{label}",
                outcome,
                tuple(segments),
                number=number,
                worker=step.lease_owner,
                error=step.error if step.state is not StepState.COMPLETED else None,
                error_kind=step.error_kind if step.state is not StepState.COMPLETED else None,
                traceback=step.panic_stack if step.state is not StepState.COMPLETED else None,
            )
        )
    elif step.state in (StepState.AVAILABLE, StepState.PAUSED) and queued_from < now:
        # The next attempt: in its backoff, or due and waiting for a worker.
        segments = _gap(queued_from, now, after, due)
        outcome = "backoff" if due > now else "queued"
        if segments:
            bars.append(
                Bar(
                    f"attempt {number}{label}",
                    outcome,
                    tuple(segments),
                    number=number,
                    note=f"due {clock(due)}",
                )
            )
    return bars


def attempts(step: Step, now: datetime) -> list[Bar]:
    """Every attempt of a task step, in order: its attempt history, then the attempt the
    step row holds (completed, running or cancelled) or the next one it waits for."""
    if step.kind in WAIT_KINDS or step.copied or step.state is StepState.SKIPPED:
        return []
    return _attempt_bars(step, step.created_at, now)


def _wait_bar(step: Step, ready: datetime, now: datetime, child: int | None) -> list[Bar]:
    phase = WAIT_KINDS[step.kind]
    if step.state is StepState.PENDING:
        return []
    end = step.completed_at or now
    if phase == "signal":
        names = step.signal_names or ([step.signal_name] if step.signal_name else [])
        label = "wait for signal " + " or ".join(repr(n) for n in names)
        if step.wait_count:
            label += f" (x{step.wait_count})"
    elif phase == "timer":
        label = f"wait for the timer (due {clock(step.scheduled_at)})"
    else:
        label = "wait for child run" + (f" {child}" if child is not None else "")
    outcome = "waiting" if not step.state.is_terminal else step.state.value
    return [
        Bar(
            label,
            outcome,
            (Segment(phase, ready, max(ready, end)),),
            error=step.error,
            error_kind=step.error_kind,
        )
    ]


def _row(
    step: Step,
    deps: Mapping[str, Sequence[str]],
    by_node: Mapping[str, Step],
    now: datetime,
    children: Mapping[str, int],
    items: Sequence[Step] = (),
) -> Row:
    ready = _ready(step, deps, by_node)
    bars: list[Bar]
    if step.copied:
        bars = [Bar("copied", "copied", (Segment("copied", step.created_at, step.created_at),))]
    elif step.state is StepState.SKIPPED:
        at = step.completed_at or ready
        bars = [Bar("skipped: its condition was false", "skipped", (Segment("skipped", at, at),))]
    elif step.kind in WAIT_KINDS:
        bars = _wait_bar(step, ready, now, children.get(step.node))
    elif items:
        end = step.completed_at or now
        done = sum(1 for i in items if i.state is StepState.COMPLETED)
        bars = [
            Bar(
                f"fan-out: {done}/{len(items)} items completed",
                step.state.value,
                (Segment("fanout", ready, max(ready, end)),),
            )
        ]
    else:
        bars = _attempt_bars(step, ready, now)
    rows = tuple(_row(i, deps, by_node, now, children) for i in items[:MAX_ITEM_ROWS])
    return Row(
        step.node,
        step.kind,
        step.state.value,
        tuple(bars),
        item_of=step.item_of,
        items=rows,
        copied=step.copied,
    )


def build(
    run: Run,
    deps: Mapping[str, Sequence[str]],
    now: datetime,
    children: Mapping[str, int] | None = None,
) -> list[Row]:
    """The rows of ``run``'s timeline at ``now``, in the order of its steps; a fan-out's
    items are in its row's ``items``. ``children`` maps a child node to its child run."""
    by_node = {s.node: s for s in run.steps if s.item_of is None}
    items: dict[str, list[Step]] = {}
    for step in run.steps:
        if step.item_of is not None:
            items.setdefault(step.item_of, []).append(step)
    return [
        _row(s, deps, by_node, now, children or {}, items.get(s.node, ()))
        for s in run.steps
        if s.item_of is None
    ]


# -- drawing -------------------------------------------------------------------------


def nice_step(span_s: float, most: int = 6) -> float:
    """A tick spacing (1, 2 or 5 times a power of ten seconds, or whole minutes or hours)
    that cuts ``span_s`` into at most ``most`` parts."""
    candidates = [m * 10.0**e for e in range(-3, 2) for m in (1, 2, 5)]
    candidates += [60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400]
    for step in candidates:
        if span_s / step <= most:
            return step
    return 86400.0 * max(1, round(span_s / 86400 / most + 0.5))


@attrs.frozen
class Scale:
    t0: datetime
    t1: datetime

    @property
    def span_s(self) -> float:
        return max((self.t1 - self.t0).total_seconds(), 0.001)

    def x(self, when: datetime) -> float:
        offset = (when - self.t0).total_seconds() / self.span_s
        return round(min(max(offset, 0.0), 1.0) * WIDTH, 1)


def _span(rows: Sequence[Row], run: Run, now: datetime) -> Scale:
    t1 = run.finished_at or now
    for row in rows:
        for bar in (*row.bars, *(b for item in row.items for b in item.bars)):
            t1 = max(t1, bar.end)
    return Scale(run.created_at, t1)


def _detail(row: Row, bar: Bar) -> str:
    lines = [f"{row.node} · {bar.label} · {bar.outcome}"]
    for segment in bar.segments:
        took = duration(segment.end - segment.start)
        lines.append(f"{segment.phase}: {exact(segment.start)} → {clock(segment.end)} ({took})")
    if bar.note:
        lines.append(bar.note)
    if bar.worker:
        lines.append(f"worker: {bar.worker}")
    if bar.error:
        lines.append(f"error ({bar.error_kind or 'error'}): {bar.error}")
    return "\n".join(lines)


def _extent(x0: float, x1: float, floor: float) -> tuple[float, float]:
    """Where a segment is drawn (x, width): at least ``MIN_W`` wide so that it shows,
    widened to the left, so that its bar still ends where the attempt ended (the next
    attempt's bar starts there), but not left of ``floor`` (where its bar is drawn from)."""
    if x1 - x0 >= MIN_W:
        return x0, round(x1 - x0, 1)
    start = max(min(x0, x1 - MIN_W), floor, 0.0)
    return round(start, 1), round(max(x1 - start, MIN_W), 1)


def _bar(row: Row, bar: Bar, scale: Scale, index: int) -> str:
    y = (ROW_H - BAR_H) / 2
    detail = escape(_detail(row, bar))
    attrs_ = (
        f'class="bar outcome-{escape(bar.outcome)}" tabindex="0" data-index="{index}" '
        f'data-outcome="{escape(bar.outcome)}" data-start="{bar.start.isoformat()}" '
        f'data-end="{bar.end.isoformat()}" data-detail="{detail}"'
    )
    if bar.number is not None:
        attrs_ += f' data-attempt="{bar.number}"'
    if bar.worker:
        attrs_ += f' data-worker="{escape(bar.worker)}"'
    parts = [f"<g {attrs_}><title>{detail}</title>"]
    # A bar starts where its attempt started, unless it is too short to see: then it is
    # MIN_W wide, ending where the attempt ended.
    floor = min(scale.x(bar.start), scale.x(bar.end) - MIN_W)
    for segment in bar.segments:
        x0, width = _extent(scale.x(segment.start), scale.x(segment.end), floor)
        parts.append(
            f'<rect class="seg {segment.phase}" data-phase="{segment.phase}" x="{x0}" '
            f'y="{y}" width="{width}" height="{BAR_H}" '
            f'fill="{PHASES[segment.phase]}"/>'
        )
    if bar.error or bar.outcome in ("failed", "discarded", "reclaimed", "cancelled"):
        x = scale.x(bar.end)
        parts.append(
            f'<line class="end-mark" x1="{x}" y1="{y - 2}" x2="{x}" y2="{y + BAR_H + 2}" '
            'stroke="#b71c1c" stroke-width="2"/>'
        )
    parts.append("</g>")
    return "".join(parts)


def _density(items: Sequence[Row], scale: Scale) -> str:
    """How many items ran in each slice of the time axis, as shaded cells."""
    counts = [0.0] * DENSITY_SLICES
    slice_s = scale.span_s / DENSITY_SLICES
    for item in items:
        for bar in item.bars:
            for segment in bar.segments:
                if segment.phase != "running":
                    continue
                a = (segment.start - scale.t0).total_seconds() / slice_s
                b = (segment.end - scale.t0).total_seconds() / slice_s
                for i in range(max(0, int(a)), min(DENSITY_SLICES, int(b) + 1)):
                    counts[i] += max(0.0, min(b, i + 1) - max(a, i)) or 0.05
    top = max(counts) or 1.0
    width = WIDTH / DENSITY_SLICES
    cells = [
        f'<rect class="cell" x="{round(i * width, 1)}" y="{ROW_H - 5}" width="{round(width, 1)}" '
        f'height="4" fill="#1565c0" fill-opacity="{round(c / top, 2)}"/>'
        for i, c in enumerate(counts)
        if c > 0
    ]
    return f'<g class="density" data-slices="{DENSITY_SLICES}">{"".join(cells)}</g>'


def _row_html(row: Row, scale: Scale, *, hidden: bool = False) -> str:
    classes = "tl-row"
    extra = ""
    if row.item_of is not None:
        classes += " item"
        extra += f' data-item-of="{escape(row.item_of)}"'
    if row.items:
        classes += " fanout"
        extra += f' data-items="{len(row.items)}" role="button" aria-expanded="false"'
    note = ""
    if row.copied:
        note = ' <small class="tl-note">copied</small>'
    elif row.state == StepState.SKIPPED.value:
        note = ' <small class="tl-note">skipped</small>'
    toggle = '<span class="tl-toggle" aria-hidden="true">▸</span> ' if row.items else ""
    label = (
        f'<span class="tl-label">{toggle}<a href="#node-{escape(row.node)}">'
        f"{escape(row.node)}</a>{note}</span>"
    )
    bars = "".join(_bar(row, bar, scale, i) for i, bar in enumerate(row.bars))
    density = _density(row.items, scale) if row.items else ""
    svg = (
        f'<svg class="tl-bars" width="{WIDTH}" height="{ROW_H}" '
        f'viewBox="0 0 {WIDTH} {ROW_H}">{bars}{density}</svg>'
    )
    hide = " hidden" if hidden else ""
    html = (
        f'<div class="{classes}" data-node="{escape(row.node)}" '
        f'data-state="{escape(row.state)}"{extra}{hide}>{label}{svg}</div>'
    )
    children = "".join(_row_html(item, scale, hidden=True) for item in row.items)
    return html + children


def _axis(scale: Scale) -> str:
    step = nice_step(scale.span_s)
    ticks = []
    value = 0.0
    while value <= scale.span_s + 1e-9:
        x = round(value / scale.span_s * WIDTH, 1)
        anchor = "start" if x < 20 else "end" if x > WIDTH - 20 else "middle"
        label = "0" if value == 0 else f"+{duration(value)}"
        ticks.append(
            f'<g class="tick" data-value="{round(value, 3)}"><line x1="{x}" y1="20" x2="{x}" '
            f'y2="26" stroke="#555"/><text class="tick-label" x="{x}" y="15" '
            f'text-anchor="{anchor}">{label}</text></g>'
        )
        value += step
    return (
        f'<svg class="tl-axis x-axis" width="{WIDTH}" height="28" viewBox="0 0 {WIDTH} 28" '
        f'font-size="11" fill="#555"><line class="axis-line" x1="0" y1="26" x2="{WIDTH}" '
        f'y2="26" stroke="#555"/>{"".join(ticks)}</svg>'
    )


def draw(run: Run, rows: Sequence[Row], now: datetime) -> str:
    """The timeline's HTML: an axis, a legend and one row per node (items hidden)."""
    scale = _span(rows, run, now)
    legend = "".join(
        f'<span class="tl-key"><i style="background:{colour}"></i>{phase}</span>'
        for phase, colour in PHASES.items()
    )
    body = "".join(_row_html(row, scale) for row in rows)
    title = (
        f"time since the run was created ({exact(run.created_at)}); "
        f"{duration(scale.t1 - scale.t0)} shown"
    )
    return (
        f'<div class="timeline" id="timeline" data-t0="{scale.t0.isoformat()}" '
        f'data-t1="{scale.t1.isoformat()}" data-width="{WIDTH}">'
        f'<p class="tl-title axis-title">{escape(title)}</p>'
        f'<div class="tl-row tl-head"><span class="tl-label">node</span>{_axis(scale)}</div>'
        f"{body}"
        f'<p class="tl-legend">{legend}</p>'
        '<pre class="tl-detail" id="tl-detail" hidden></pre></div>'
    )
