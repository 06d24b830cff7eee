"""Audit: a hypothesis state machine of operator and client calls interleaved with work,
through the public API only (docs/concepts/runs-and-steps.md, waits.md,
fan-out-and-children.md).

The machine holds a handful of runs of workflows that together use a chain, a join, a
``for_each`` over steps and over a child workflow (``max_parallel``), a child run,
``wait_signal`` / ``wait_n`` / ``wait_any`` with and without timeouts, ``wait_timer``,
a step that fails as often as the test says before it succeeds, and a step with a
timeout that hangs as often as the test says. Rules submit (``submit``,
``submit_many``, ``submit_once``), signal (declared and unknown names, duplicates),
pause, resume, cancel, retry (a node, a run's failed node, ``force=True``), fork, move
the database clock, run a worker for a moment (until the runs settle, or stopped at
once, mid-step, with no grace) and act on child runs directly. No worker runs between
rules, so each call is checked against the state read just before it: it succeeds, or
raises the typed error the docs name for that state, never anything else.

After every rule: no ended run has a step that is not terminal, and every completed
run (child runs and forks included) holds the result plain Python computes.
At the end: everything paused is resumed, every awaited signal sent, the clock moved
past every timer and backoff, and a worker runs until every run has ended (bounded):
no run may be left hanging.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    Delivery,
    InvalidArgument,
    InvalidTransition,
    MailboxFull,
    NodeNotFound,
    Run,
    RunFailed,
    RunState,
    SignalNotDeliverable,
    StepContext,
    StepState,
    Worker,
    child,
    for_each,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.graph.rows import KIND_CHILD, KIND_SIGNAL
from cyclone_dsl.testing import set_clock_shift

# -- handler controls (set by the machine, read by the handlers) -----------------------------

LOCK = threading.Lock()
FAILS: dict[int, int] = {}  # gsm_flaky(x) raises while FAILS[x] > 0 (counting down)
HANGS: dict[int, int] = {}  # gsm_slow(x) outlives its timeout while HANGS[x] > 0


def _take(table: dict[int, int], key: int) -> bool:
    with LOCK:
        left = table.get(key, 0)
        if left > 0:
            table[key] = left - 1
            return True
        return False


# -- steps ----------------------------------------------------------------------------------


@step(name="gsm_inc")
def inc(x: int) -> int:
    return x + 1


@step(name="gsm_add")
def add(a: int, b: int) -> int:
    return a + b


@step(name="gsm_pair")
def pair(a: object, b: object) -> list[object]:
    return [a, b]


@step(name="gsm_triple")
def triple(a: object, b: object, c: object) -> list[object]:
    return [a, b, c]


@step(name="gsm_range")
def rng(x: int) -> list[int]:
    return list(range(x % 4))


@step(name="gsm_sq")
def sq(i: int) -> int:
    return i * i


@step(name="gsm_flaky", max_attempts=2)
def flaky(x: int) -> int:
    if _take(FAILS, x):
        raise RuntimeError(f"gsm_flaky({x}) fails as told")
    return x * 10


@step(name="gsm_slow", timeout=0.3, max_attempts=2)
def slow(x: int, ctx: StepContext) -> int:
    if _take(HANGS, x):
        ctx.wait_cancelled(5)  # past its timeout: the result is never kept
    return x + 7


# -- workflows ------------------------------------------------------------------------------


@workflow(name="gsm_kid")
def kid(i):  # type: ignore[no-untyped-def]
    return inc(i)


@workflow(name="gsm_kidw")
def kidw(y):  # type: ignore[no-untyped-def]
    return pair(inc(y), wait_signal("kgo"))


@workflow(name="gsm_chain")
def chain(x):  # type: ignore[no-untyped-def]
    return inc(inc(flaky(x)))


@workflow(name="gsm_join")
def join(x):  # type: ignore[no-untyped-def]
    return add(inc(x), slow(x))


@workflow(name="gsm_fan")
def fan(x):  # type: ignore[no-untyped-def]
    return for_each(sq, over=rng(x), max_parallel=2)


@workflow(name="gsm_fankids")
def fankids(x):  # type: ignore[no-untyped-def]
    return for_each(kid, over=rng(x), max_parallel=2)


@workflow(name="gsm_parent")
def parent(x):  # type: ignore[no-untyped-def]
    return pair(child(kidw, inc(x)), x)


@workflow(name="gsm_waits")
def waits(x):  # type: ignore[no-untyped-def]
    go = wait_signal("go")
    votes = wait_n("vote", 2, timeout=timedelta(seconds=90))
    timer = wait_timer(timedelta(seconds=30), after=[go])
    return triple(go, votes, inc(x, after=[timer]))


@workflow(name="gsm_any")
def anyw(x):  # type: ignore[no-untyped-def]
    return pair(wait_any(["yes", "no"], timeout=timedelta(seconds=90)), wait_signal("ok"))


WORKFLOWS = {w.name: w for w in (kid, kidw, chain, join, fan, fankids, parent, waits, anyw)}
HANDLERS = [inc, add, pair, triple, rng, sq, flaky, slow, *WORKFLOWS.values()]
#: Signal names each workflow declares, and the capacity of the wait for each.
SIGNALS: dict[str, dict[str, int]] = {
    "gsm_kidw": {"kgo": 1},
    "gsm_waits": {"go": 1, "vote": 2},
    "gsm_any": {"yes": 1, "no": 1, "ok": 1},
}
TIMED_WAITS = {"vote", "any_yes_no"}


def payload(name: str, run_input: object) -> list[object]:
    """The payload of signal ``name`` to a run: its run's input rides along, so a payload
    delivered to the wrong run shows in the result."""
    return [name, run_input]


def expected(workflow_name: str, x: Any) -> list[Any]:
    """Every result plain Python allows for a run of ``workflow_name`` on ``x``."""
    if workflow_name == "gsm_kid":
        return [x + 1]
    if workflow_name == "gsm_kidw":
        return [[x + 1, payload("kgo", x)]]
    if workflow_name == "gsm_chain":
        return [x * 10 + 2]
    if workflow_name == "gsm_join":
        return [(x + 1) + (x + 7)]
    if workflow_name == "gsm_fan":
        return [[i * i for i in range(x % 4)]]
    if workflow_name == "gsm_fankids":
        return [[i + 1 for i in range(x % 4)]]
    if workflow_name == "gsm_parent":
        return [[[x + 2, payload("kgo", x + 1)], x]]
    if workflow_name == "gsm_waits":
        return [[payload("go", x), [payload("vote", x)] * 2, x + 1]]
    if workflow_name == "gsm_any":
        return [
            [{"name": name, "payload": payload(name, x)}, payload("ok", x)]
            for name in ("yes", "no")
        ]
    raise AssertionError(workflow_name)


INDEX = st.integers(0, 1000)  # an index into what the database holds, taken modulo
TERMINAL_RUN = {RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED}
FAILED_STEP = {StepState.DISCARDED, StepState.CANCELLED}
SETS = {
    "flow": ["gsm_chain", "gsm_join", "gsm_fan", "gsm_fankids", "gsm_parent"],
    "waits": ["gsm_waits", "gsm_any", "gsm_parent", "gsm_chain"],
}


def unexpected(call: str, exc: BaseException, allowed: object, state: object) -> AssertionError:
    return AssertionError(
        f"{call} raised {type(exc).__name__}: {exc} (allowed: {allowed}; state before: {state})"
    )


class GsmMachine(RuleBasedStateMachine):
    dsn: str = ""
    client: Client
    workflows: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.shift = timedelta(0)
        set_clock_shift(self.shift)
        self.counter = 0
        self.top: list[int] = []  # runs the machine submitted or forked
        self.keys: dict[str, int] = {}  # submit_once key -> run id
        self.log: list[str] = []
        self.own_paused: set[int] = set()
        self.submits = 0
        self.paused_snapshot: dict[int, tuple[set[str], set[int]]] = {}

    # -- helpers -----------------------------------------------------------------------------

    def all_runs(self) -> list[Run]:
        return self.client.list_runs(limit=1000)

    def run(self, run_id: int) -> Run:
        return self.client.get_run(run_id)

    def db_now(self) -> datetime:
        return datetime.now(UTC) + self.shift

    def new_input(self) -> int:
        self.counter += 1
        return self.counter * 4 + self.counter % 4  # distinct, and x % 4 walks 1, 2, 3, 0

    def settled(self) -> bool:
        """No work a worker would do now: nothing running, nothing due."""
        now = self.db_now()
        for summary in self.all_runs():
            if summary.state in TERMINAL_RUN:
                continue
            run = self.run(summary.id)
            for s in run.steps:
                if s.state is StepState.RUNNING:
                    return False
                if run.state is RunState.PAUSED:
                    continue
                due = s.scheduled_at <= now
                if s.state is StepState.AVAILABLE and due:
                    return False
                if s.state is StepState.WAITING_TIMER and due:
                    return False
                if s.state is StepState.WAITING_SIGNAL and s.node in TIMED_WAITS and due:
                    return False
        return True

    def worker(self) -> Worker:
        return Worker(
            self.dsn,
            HANDLERS,
            concurrency=8,
            poll_interval=0.05,
            scan_interval=0.05,
            grace=0,
            lease=30.0,
        )

    def teardown(self) -> None:
        try:
            self.finish_everything()
        finally:
            set_clock_shift(timedelta(0))
            with LOCK:
                FAILS.clear()
                HANGS.clear()
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                conn.execute("TRUNCATE cyclone_runs CASCADE")

    def finish_everything(self) -> None:
        self.check_results()
        worker = self.worker().start()
        try:
            self.drive_to_end()
            self.heal()
        finally:
            worker.stop()

    def drive_to_end(self) -> None:
        """Resume what is paused, send what is awaited, move the clock past timers,
        timeouts and backoffs while the worker runs: every run must end."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            runs = self.all_runs()
            open_runs = [r for r in runs if r.state not in TERMINAL_RUN]
            if not open_runs:
                break
            anything_running = False
            for summary in open_runs:
                if summary.state is RunState.PAUSED:
                    with contextlib.suppress(InvalidTransition, AlreadyTerminal):
                        self.client.resume(summary.id)
                run = self.run(summary.id)
                anything_running |= any(s.state is StepState.RUNNING for s in run.steps)
                self.deliver_awaited(run)
            if not anything_running:
                # past every timer, timeout and backoff; no lease is held to expire
                self.shift += timedelta(minutes=10)
                set_clock_shift(self.shift)
            time.sleep(0.1)
        stuck = {
            r.id: (
                r.workflow,
                r.state.value,
                [(s.node, s.state.value) for s in self.run(r.id).steps],
            )
            for r in self.all_runs()
            if r.state not in TERMINAL_RUN
        }
        assert not stuck, f"runs never ended: {stuck}\nsteps: {self.log}"
        self.check_results()

    def heal(self) -> None:
        """Every handler succeeds from now on: an operator retry of the node that ended a
        failed or cancelled run (runs-and-steps.md, "Retrying failed work") makes it
        complete, with the right result."""
        with LOCK:
            FAILS.clear()
            HANGS.clear()
        retried: dict[int, list[str]] = {}
        for _ in range(2):
            for summary in self.all_runs():
                if summary.parent_run_id is not None:
                    continue
                if summary.state not in (RunState.FAILED, RunState.CANCELLED):
                    continue
                node: str | None = None
                try:
                    self.client.outcome(summary.id)
                except RunFailed as failed:
                    node = failed.node
                run = self.run(summary.id)
                if node is None:
                    node = next(s.node for s in run.steps if s.state in FAILED_STEP)
                try:
                    self.client.retry(summary.id, node)
                except InvalidTransition:  # the message names another node: left failed
                    continue
                retried.setdefault(summary.id, []).append(f"{node} ({run.state.value})")
            self.drive_to_end()
        not_healed = {
            run_id: (self.run(run_id).state.value, nodes)
            for run_id, nodes in retried.items()
            if self.run(run_id).state is not RunState.COMPLETED
        }
        assert not not_healed, f"retried runs that did not complete: {not_healed}\n{self.log}"

    def deliver_awaited(self, run: Run) -> None:
        for s in run.steps:
            if s.state not in (StepState.PENDING, StepState.PAUSED, StepState.WAITING_SIGNAL):
                continue
            names = s.signal_names or ([s.signal_name] if s.signal_name else [])
            if not names:
                continue
            for _ in range(s.wait_count or 1):
                try:
                    delivery = self.client.signal(run.id, names[0], payload(names[0], run.input))
                except (MailboxFull, AlreadyTerminal):
                    break
                if delivery is Delivery.NOT_STORED:
                    break

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def a_paused_run_starts_nothing(self) -> None:
        """waits.md: nothing downstream starts, timers do not fire; fan-out-and-children.md:
        no child run starts while its parent is paused. Only signals (consumed by waiting
        waits) and child runs resumed on their own can complete something."""
        for run_id, (done, kids) in list(self.paused_snapshot.items()):
            run = self.run(run_id)
            if run.state is not RunState.PAUSED:
                del self.paused_snapshot[run_id]
                continue
            for s in run.steps:
                assert s.state is not StepState.RUNNING, (run_id, s.node)
                if s.state is StepState.COMPLETED and s.node not in done:
                    assert s.kind in (KIND_SIGNAL, KIND_CHILD), (run_id, s.node, s.kind)
            now_kids = {r.id for r in self.all_runs() if r.parent_run_id == run_id}
            assert now_kids <= kids, f"run {run_id} started {now_kids - kids} while paused"

    @invariant()
    def one_child_run_per_child_node(self) -> None:
        seen: dict[tuple[int, str], int] = {}
        for r in self.all_runs():
            if r.parent_run_id is None:
                continue
            key = (r.parent_run_id, str(r.parent_node_id))
            assert key not in seen, f"child runs {seen[key]} and {r.id} for one node {key}"
            seen[key] = r.id

    @invariant()
    def ended_runs_have_ended_steps_and_right_results(self) -> None:
        self.check_results()

    def check_results(self) -> None:
        for summary in self.all_runs():
            run = self.run(summary.id)
            if run.state in TERMINAL_RUN:
                live = [(s.node, s.state.value) for s in run.steps if not s.state.is_terminal]
                assert not live, f"run {run.id} ({run.workflow}) is {run.state.value}: {live}"
            if run.state is RunState.COMPLETED:
                result = self.client.outcome(run.id)
                allowed = expected(run.workflow, run.input)
                assert result in allowed, (
                    f"run {run.id} ({run.workflow}, input {run.input!r}) completed with "
                    f"{result!r}, expected one of {allowed!r}\nsteps: {self.log}"
                )

    # -- rules: submitting ---------------------------------------------------------------

    def prepare(self, x: int, fails: int, hangs: int) -> None:
        with LOCK:
            FAILS[x] = fails
            HANGS[x] = hangs

    @initialize(first=INDEX, second=INDEX, fails=st.integers(0, 3))
    def first_runs(self, first: int, second: int, fails: int) -> None:
        self.submit(first, "submit", fails, 0, "k1")
        self.submit(second, "submit", 0, 1, "k1")

    @precondition(lambda self: self.submits < 4)  # never on what the database says
    @rule(
        which=INDEX,
        how=st.sampled_from(["submit", "submit_many", "submit_once"]),
        fails=st.integers(0, 3),
        hangs=st.integers(0, 2),
        key=st.sampled_from(["k1", "k2"]),
    )
    def submit(self, which: int, how: str, fails: int, hangs: int, key: str) -> None:
        self.submits += 1
        name = self.workflows[which % len(self.workflows)]
        wf = WORKFLOWS[name]
        x = self.new_input()
        self.prepare(x, fails, hangs)
        self.log.append(f"{how} {name}({x}) fails={fails} hangs={hangs}")
        if how == "submit":
            self.top.append(self.client.submit(wf, x).id)
        elif how == "submit_many":
            y = self.new_input()
            self.prepare(y, fails, hangs)
            handles = self.client.submit_many(wf, [x, y])
            assert len({h.id for h in handles}) == 2
            assert [self.run(h.id).input for h in handles] == [x, y]
            self.top.extend(h.id for h in handles)
        else:
            once_key = f"{name}:{key}"
            handle = self.client.submit_once(wf, x, key=once_key)
            if once_key in self.keys:
                assert not handle.created and handle.id == self.keys[once_key], (
                    "submit_once made a second run for one key"
                )
            else:
                assert handle.created
                self.keys[once_key] = handle.id
                self.top.append(handle.id)

    # -- rules: operating on runs (top-level or child) ---------------------------------------

    def pick(self, which: int) -> Run | None:
        """A run to operate on, as a prompt scanner would have left it: every operation
        applies what came due in the run first (waits.md, Scanners), so the model does
        too, through the client's engine, before it predicts the outcome."""
        runs = sorted(self.all_runs(), key=lambda r: r.id)
        if not runs:
            return None
        chosen = runs[which % len(runs)].id
        client: Any = self.client  # its engine and database: test-only access
        client._db.transaction(lambda tx: client._engine.settle_due(tx, chosen))
        return self.run(chosen)

    @rule(which=INDEX, name_ix=INDEX, wrong=st.integers(0, 5))
    def signal(self, which: int, name_ix: int, wrong: int) -> None:
        run = self.pick(which)
        if run is None:
            return
        declared = SIGNALS.get(run.workflow, {})
        names = sorted(declared)
        name = "nope" if wrong == 0 or not names else names[name_ix % len(names)]
        self.log.append(f"signal {run.id} {name} ({run.state.value})")
        wait = next(
            (s for s in run.steps if s.signal_name == name or name in (s.signal_names or [])),
            None,
        )
        allowed: set[object]
        if run.state in TERMINAL_RUN:
            allowed = {AlreadyTerminal} | ({SignalNotDeliverable} if wait is None else set())
        elif wait is None:
            allowed = {SignalNotDeliverable}
        elif wait.state is StepState.WAITING_SIGNAL and wait.node in TIMED_WAITS:
            # waits.md: a wait whose timeout passed (no scanner failed it yet) does not
            # store it, and fails there and then; a second either way of the clock is both
            # In a paused run the timeout's clock stands still: it counts from the pause.
            now = run.paused_at if run.paused_at is not None else self.db_now()
            due = wait.scheduled_at - now
            allowed = set()
            if due < timedelta(seconds=1):
                allowed.add(Delivery.NOT_STORED)
            if due > timedelta(seconds=-1):
                allowed.add(Delivery.CONSUMED)
        elif wait.state is StepState.WAITING_SIGNAL:
            allowed = {Delivery.CONSUMED}
        elif wait.state in (StepState.PENDING, StepState.PAUSED):
            wait_names = wait.signal_names or [name]
            unconsumed = [
                row
                for row in self.client.signals_of(run.id)
                if row["name"] in wait_names and row["consumed_by"] is None
            ]
            capacity = declared[name]
            allowed = {Delivery.BUFFERED} if len(unconsumed) < capacity else {MailboxFull}
        elif wait.state is StepState.COMPLETED:
            allowed = {Delivery.NOT_STORED}
        else:  # a failed wait in an open run
            allowed = {Delivery.NOT_STORED}
        state = (run.state.value, wait and (wait.node, wait.state.value))
        try:
            outcome: object = self.client.signal(run.id, name, payload(name, run.input))
        except Exception as exc:  # checked against the allowed set
            if type(exc) not in allowed:
                raise unexpected(f"signal({run.id}, {name!r})", exc, allowed, state) from exc
            return
        assert outcome in allowed, f"signal({run.id}, {name!r}) -> {outcome}, state {state}"
        if outcome is Delivery.CONSUMED and wait is not None:
            after = self.run(run.id).step(wait.node)
            if wait.wait_count:
                got = after.output if isinstance(after.output, list) else []
                assert payload(name, run.input) in got, (after.state, after.output)
            else:
                assert after.state is StepState.COMPLETED, (after.state, after.output)
        if (
            outcome is Delivery.NOT_STORED
            and wait is not None
            and wait.state is StepState.WAITING_SIGNAL
            and run.state is RunState.RUNNING
        ):
            after = self.run(run.id).step(wait.node)
            assert after.state is StepState.DISCARDED, (after.state, after.error_kind)
            assert after.error_kind == "signal_timeout", after.error_kind

    @rule(which=INDEX)
    def pause(self, which: int) -> None:
        run = self.pick(which)
        if run is None:
            return
        self.log.append(f"pause {run.id} ({run.state.value})")
        allowed = {
            RunState.RUNNING: {None},
            RunState.PAUSED: {InvalidTransition},
        }.get(run.state, {AlreadyTerminal})
        self.call(f"pause({run.id})", lambda: self.client.pause(run.id), allowed, run)
        if None in allowed:
            after = self.run(run.id)
            assert after.state is RunState.PAUSED
            self.own_paused.add(run.id)
            kids = {r.id: r for r in self.all_runs() if r.parent_run_id == run.id}
            for kid_run in kids.values():
                if kid_run.state not in TERMINAL_RUN:  # waits.md: pause reaches down
                    assert kid_run.state is RunState.PAUSED, (kid_run.id, kid_run.state)
            done = {s.node for s in after.steps if s.state is StepState.COMPLETED}
            self.paused_snapshot[run.id] = (done, set(kids))

    @rule(which=INDEX)
    def resume(self, which: int) -> None:
        run = self.pick(which)
        if run is None:
            return
        self.log.append(f"resume {run.id} ({run.state.value})")
        allowed = {
            RunState.RUNNING: {InvalidTransition},
            RunState.PAUSED: {None},
        }.get(run.state, {AlreadyTerminal})
        self.call(f"resume({run.id})", lambda: self.client.resume(run.id), allowed, run)
        if None in allowed:
            assert self.run(run.id).state is RunState.RUNNING
            self.own_paused.discard(run.id)
            for kid_run in self.all_runs():
                if kid_run.parent_run_id != run.id or kid_run.state in TERMINAL_RUN:
                    continue
                # fan-out-and-children.md: resuming resumes the child runs paused with it;
                # one paused on its own stays paused
                want = RunState.PAUSED if kid_run.id in self.own_paused else RunState.RUNNING
                assert kid_run.state is want, (kid_run.id, kid_run.state, self.own_paused)

    @rule(which=INDEX)
    def cancel(self, which: int) -> None:
        run = self.pick(which)
        if run is None:
            return
        self.log.append(f"cancel {run.id} ({run.state.value})")
        allowed = {AlreadyTerminal} if run.state in TERMINAL_RUN else {None}
        self.call(f"cancel({run.id})", lambda: self.client.cancel(run.id), allowed, run)
        if None in allowed:
            assert self.run(run.id).state is RunState.CANCELLED
            for kid_row in self.client.children_of(run.id):
                kid_run = self.run(kid_row["id"])
                assert kid_run.state in TERMINAL_RUN, (kid_run.id, kid_run.state)
            if run.parent_run_id is not None:
                # fan-out-and-children.md: cancelling a child run fails its parent node
                # (an item fails its fan-out node); the parent follows on_dep_failure
                # (fail_run here)
                up = self.run(run.parent_run_id)
                node = up.step(str(run.parent_node_id))
                assert node.state is StepState.DISCARDED, (up.id, node.node, node.state)
                assert node.error_kind == "child_failed", (up.id, node.node, node.error_kind)
                assert up.state is RunState.FAILED, (up.id, up.state)

    @rule(which=INDEX, node_ix=INDEX, force=st.booleans(), unknown=st.integers(0, 7))
    def retry(self, which: int, node_ix: int, force: bool, unknown: int) -> None:
        run = self.pick(which)
        if run is None:
            return
        failed = sorted(s.node for s in run.steps if s.state in FAILED_STEP)
        done = sorted(s.node for s in run.steps if s.state is StepState.COMPLETED)
        nodes = sorted({s.node for s in run.steps})
        preferred = done if force else failed
        if unknown == 0:
            node = "no_such_node"
        elif preferred and unknown > 1:
            node = preferred[node_ix % len(preferred)]
        else:
            node = nodes[node_ix % len(nodes)]
        self.log.append(f"retry {run.id} {node} force={force} ({run.state.value})")
        steps = {s.node: s for s in run.steps}
        target = steps.get(node)
        if target is not None and target.item_of is not None:
            target = steps[target.item_of]
        allowed: set[object]
        if target is None:
            allowed = {NodeNotFound}
            if run.state is RunState.PAUSED or (force and run.parent_run_id is not None):
                allowed.add(InvalidTransition)  # which check comes first is not documented
        elif run.state is RunState.PAUSED:
            allowed = {InvalidTransition}
        elif force and run.parent_run_id is not None:
            allowed = {InvalidTransition}  # a child run is never replayed on its own
        elif force:
            allowed = {None, InvalidTransition}
        elif target.state not in FAILED_STEP:
            allowed = {InvalidTransition}
        else:
            allowed = {None, InvalidTransition}
        self.call(
            f"retry({run.id}, {node!r}, force={force})",
            lambda: self.client.retry(run.id, node, force=force),
            allowed,
            run,
        )
        if None in allowed and target is not None:
            after = self.run(run.id)
            if after.state is RunState.RUNNING and self.last_ok:
                assert after.step(target.node).state not in FAILED_STEP, after.step(target.node)

    @rule(which=INDEX, node_ix=INDEX, unknown=st.integers(0, 7))
    def fork(self, which: int, node_ix: int, unknown: int) -> None:
        run = self.pick(which)
        if run is None or len(self.top) >= 8:
            return
        nodes = sorted(s.node for s in run.steps if s.item_of is None)
        node = "no_such_node" if unknown == 0 else nodes[node_ix % len(nodes)]
        self.log.append(f"fork {run.id} {node} ({run.state.value})")
        allowed: set[object] = {InvalidArgument} if node == "no_such_node" else {None}
        if run.parent_run_id is not None:
            allowed.add(InvalidTransition)
        before = self.run(run.id)
        try:
            handle = self.client.fork(run.id, node)
        except Exception as exc:  # checked against the allowed set
            if type(exc) not in allowed:
                raise unexpected(f"fork({run.id}, {node!r})", exc, allowed, run.state) from exc
            return
        assert None in allowed, f"fork({run.id}, {node!r}) was accepted"
        forked = self.run(handle.id)
        assert forked.workflow == run.workflow and forked.input == run.input
        assert forked.forked_from == run.id
        self.top.append(handle.id)
        after = self.run(run.id)
        assert (after.state, [(s.node, s.state) for s in after.steps]) == (
            before.state,
            [(s.node, s.state) for s in before.steps],
        ), "the fork changed its source run"

    last_ok = False

    def call(self, what: str, fn: Any, allowed: set[object], run: Run) -> None:
        self.last_ok = False
        try:
            fn()
        except Exception as exc:  # checked against the allowed set
            if type(exc) not in allowed:
                state = (run.state.value, [(s.node, s.state.value) for s in run.steps])
                raise unexpected(what, exc, allowed, state) from exc
            return
        assert None in allowed, f"{what} was accepted in state {run.state.value}"
        self.last_ok = True

    # -- rules: time and work --------------------------------------------------------------

    @rule(seconds=st.sampled_from([2, 35, 100, 600]))
    def advance_clock(self, seconds: int) -> None:
        self.log.append(f"clock +{seconds}s")
        self.shift += timedelta(seconds=seconds)
        set_clock_shift(self.shift)

    @rule(mode=st.sampled_from(["settle", "settle", "blip"]))
    def run_worker(self, mode: str) -> None:
        self.work(mode)

    @rule(seconds=st.sampled_from([2, 35, 100, 600]))
    def advance_clock_and_work(self, seconds: int) -> None:
        self.advance_clock(seconds)
        self.work("settle")

    def work(self, mode: str) -> None:
        self.log.append(f"worker {mode}")
        worker = self.worker().start()
        try:
            if mode == "blip":
                end = time.monotonic() + 0.5
                while time.monotonic() < end:
                    runs = [self.run(r.id) for r in self.all_runs()]
                    if any(s.state is StepState.RUNNING for r in runs for s in r.steps):
                        break  # stop it mid-step
                    time.sleep(0.02)
            else:
                end = time.monotonic() + 3
                time.sleep(0.05)
                while time.monotonic() < end and not self.settled():
                    time.sleep(0.05)
        finally:
            worker.stop()
        for r in self.all_runs():
            running = [s.node for s in self.run(r.id).steps if s.state is StepState.RUNNING]
            assert not running, f"worker stopped but run {r.id} has running steps {running}"


@pytest.fixture
def machine_client(cyclone_dsn: str) -> Iterator[Client]:
    with Client(cyclone_dsn) as c:
        yield c
    set_clock_shift(timedelta(0))


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
@pytest.mark.parametrize("which", sorted(SETS))
def test_operator_calls_interleaved_with_work(
    cyclone_dsn: str, machine_client: Client, which: str
) -> None:
    GsmMachine.dsn = cyclone_dsn
    GsmMachine.client = machine_client
    GsmMachine.workflows = SETS[which]
    case = GsmMachine.TestCase
    case.settings = settings(
        max_examples=int(os.environ.get("GSM_EXAMPLES", "8")),
        stateful_step_count=15,
        deadline=None,
        phases=[Phase.generate],
        print_blob=False,
    )
    case().runTest()
