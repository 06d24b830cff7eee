"""Audit: races between concurrent client calls (many web processes, one Client each) and
running workers (docs/concepts/waits.md, docs/concepts/runs-and-steps.md, docs/guarantees.md,
the Client docstrings).

Every race starts its threads together at a ``threading.Barrier`` and is repeated a few
times. Tests marked ``xfail(strict=True)`` show a finding: they fail today and pass once fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import psycopg
import pytest

from cyclone_dsl import (
    AlreadyTerminal,
    AsyncClient,
    Client,
    Delivery,
    InvalidTransition,
    MailboxFull,
    Permanent,
    RunFailed,
    RunFilter,
    RunState,
    SignalNotDeliverable,
    StepContext,
    StepState,
    Worker,
    child,
    step,
    wait_any,
    wait_n,
    wait_signal,
    workflow,
)
from tests.waiting import wait_until

# -- handler controls -------------------------------------------------------------------------

GATES: dict[str, threading.Event] = {}
CALLS: Counter[tuple[int, str]] = Counter()
CALLS_LOCK = threading.Lock()
TOLD_TO_STOP: set[tuple[int, str]] = set()
_gate_names = itertools.count()


def gate(name: str) -> threading.Event:
    with CALLS_LOCK:
        return GATES.setdefault(name, threading.Event())


def called(ctx: StepContext) -> int:
    """Count one execution of (run, node); returns how many there were so far."""
    with CALLS_LOCK:
        CALLS[(ctx.run_id, ctx.node)] += 1
        return CALLS[(ctx.run_id, ctx.node)]


def calls_of(run_id: int) -> dict[str, int]:
    with CALLS_LOCK:
        return {node: n for (run, node), n in CALLS.items() if run == run_id}


def started(run_id: int, node: str) -> Callable[[], bool]:
    """A wait_until condition: the handler of ``node`` of the run has started."""
    return lambda: calls_of(run_id).get(node, 0) >= 1


def waiting(client: Client, run_id: int, node: str) -> Callable[[], bool]:
    """A wait_until condition: the wait ``node`` of the run is waiting for signals."""
    return lambda: client.get_run(run_id).step(node).state is StepState.WAITING_SIGNAL


def new_gate() -> str:
    return f"g{next(_gate_names)}"


@pytest.fixture(autouse=True)
def _fresh_gates(start_worker: Callable[..., Worker]) -> Iterator[None]:
    """Set up after start_worker, so torn down before it: blocked handlers are released
    before the workers stop."""
    CALLS.clear()
    TOLD_TO_STOP.clear()
    yield
    for event in list(GATES.values()):
        event.set()
    GATES.clear()


@contextlib.contextmanager
def clients(dsn: str, n: int) -> Iterator[list[Client]]:
    """``n`` clients, one per simulated web process."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(Client(dsn, pool_size=1)) for _ in range(n)]


def race(
    n: int, call: Callable[..., object], *, extra: Callable[..., object] | None = None
) -> list[object]:
    """Run ``call(i)`` on ``n`` threads released together (and ``extra`` on one more);
    returns each call's value or the exception it raised, by ``i``. A thread still
    running after 30 s is a hang."""
    parties = n + (1 if extra is not None else 0)
    barrier = threading.Barrier(parties)
    results: list[object] = [None] * n

    def run(i: int) -> None:
        barrier.wait(30)
        try:
            results[i] = call(i)
        except Exception as exc:  # recorded and asserted on
            results[i] = exc

    def run_extra() -> None:
        assert extra is not None
        barrier.wait(30)
        extra()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    if extra is not None:
        threads.append(threading.Thread(target=run_extra, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a racing call hung"
    return results


def kinds(results: Sequence[object]) -> Counter[str]:
    return Counter(type(r).__name__ if isinstance(r, Exception) else str(r) for r in results)


# -- steps ------------------------------------------------------------------------------------


@step(name="soa_echo")
def soa_echo(value: object, ctx: StepContext) -> object:
    called(ctx)
    return value


@step(name="soa_tail")
def soa_tail(value: object, ctx: StepContext) -> object:
    called(ctx)
    return value


@step(name="soa_hold")
def soa_hold(name: str, ctx: StepContext) -> str:
    called(ctx)
    gate(name).wait(20)
    return name


@step(name="soa_tick")
def soa_tick(value: int, ctx: StepContext) -> int:
    called(ctx)
    if ctx.wait_cancelled(0.03):  # long enough for pauses to land while it runs
        with CALLS_LOCK:
            TOLD_TO_STOP.add((ctx.run_id, ctx.node))
    return value + 1


@step(name="soa_flaky", max_attempts=1)
def soa_flaky(name: str, ctx: StepContext) -> str:
    if called(ctx) == 1:
        raise Permanent("first execution fails")
    gate(name).wait(20)
    return name


# -- workflows --------------------------------------------------------------------------------


@workflow(name="soa_once")
def soa_once(x):  # type: ignore[no-untyped-def]
    return soa_echo(x)


@workflow(name="soa_once_other")
def soa_once_other(x):  # type: ignore[no-untyped-def]
    return soa_echo(x)


@workflow(name="soa_n_cross")
def soa_n_cross(g):  # type: ignore[no-untyped-def]
    first = soa_hold(g)
    return soa_echo(wait_n("soa_n", 3, after=[first]))


@workflow(name="soa_any_cross")
def soa_any_cross(g):  # type: ignore[no-untyped-def]
    first = soa_hold(g)
    return soa_echo(wait_any(["soa_a", "soa_b"], after=[first]))


@workflow(name="soa_last")
def soa_last(g):  # type: ignore[no-untyped-def]
    return soa_hold(soa_echo(g))  # type: ignore[arg-type]


@workflow(name="soa_chain")
def soa_chain(x):  # type: ignore[no-untyped-def]
    value = x
    for _ in range(6):
        value = soa_tick(value)
    return value


@workflow(name="soa_retry")
def soa_retry(g):  # type: ignore[no-untyped-def]
    return soa_tail(soa_flaky(g))


@workflow(name="soa_forked")
def soa_forked(g):  # type: ignore[no-untyped-def]
    return soa_tail(soa_hold(soa_echo(g)))  # type: ignore[arg-type]


@workflow(name="soa_one_sig")
def soa_one_sig(g):  # type: ignore[no-untyped-def]
    first = soa_hold(g)
    return soa_echo(wait_signal("soa_one", after=[first]))


@workflow(name="soa_kid")
def soa_kid(g):  # type: ignore[no-untyped-def]
    return soa_flaky(g)


@workflow(name="soa_parent")
def soa_parent(g):  # type: ignore[no-untyped-def]
    return soa_tail(child(soa_kid, g))


@workflow(name="soa_mailbox")
def soa_mailbox(x):  # type: ignore[no-untyped-def]
    return soa_echo(wait_n("soa_many", 100))


# -- submit_once --------------------------------------------------------------------------------


def test_soa_submit_once_same_key_from_twelve_clients_makes_one_run(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """submit_once: "Race-free: concurrent callers with one key get one run"; a caller whose
    key is held gets the existing run (created=False), whatever input it passed."""
    start_worker(soa_echo)
    with clients(cyclone_dsn, 12) as many:
        for round_ in range(4):
            key = f"soa-key-{round_}"
            results = race(
                12,
                lambda i, key=key: many[i].submit_once(soa_once, {"caller": i % 2}, key=key),
            )
            assert all(not isinstance(r, Exception) for r in results), results
            handles = [r for r in results if not isinstance(r, Exception)]
            ids = {h.id for h in handles}  # type: ignore[attr-defined]
            assert len(ids) == 1, results
            created = [i for i, h in enumerate(handles) if h.created]  # type: ignore[attr-defined]
            assert len(created) == 1, results
            (run_id,) = ids
            assert client.get_run(run_id).input == {"caller": created[0] % 2}
            assert client.result(run_id, timeout=20) == {"caller": created[0] % 2}
            assert calls_of(run_id) == {"soa_echo": 1}
            # a later caller with other input still gets the same, ended run
            again = client.submit_once(soa_once, {"caller": 99}, key=key)
            assert (again.id, again.created) == (run_id, False)
        # the key belongs to one workflow: the same key on another workflow is another run
        other = client.submit_once(soa_once_other, 1, key="soa-key-0")
        assert other.created
        runs = client.list_runs(workflow="soa_once")
        assert len(runs) == 4
        assert sorted(r.submit_key or "" for r in runs) == [f"soa-key-{i}" for i in range(4)]


# -- signal floods ------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before", "crossing", "waiting"])
def test_soa_signal_flood_into_wait_n_takes_exactly_n(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker], when: str
) -> None:
    """Ten senders into wait_n(3): exactly three stored (BUFFERED or CONSUMED), the rest
    MailboxFull (before activation) or NOT_STORED (after completion); the output is exactly
    the three taken, in arrival order. 'crossing': the wait activates while they send."""
    start_worker(soa_echo, soa_hold)
    with clients(cyclone_dsn, 10) as many:
        for _ in range(3):
            g = new_gate()
            handle = client.submit(soa_n_cross, g)
            wait_until(started(handle.id, "soa_hold"), what="the hold step")
            if when == "waiting":
                gate(g).set()
                wait_until(
                    waiting(client, handle.id, "soa_n"),
                    what="the wait to activate",
                )
            results = race(
                10,
                lambda i, h=handle: many[i].signal(h.id, "soa_n", i),
                extra=gate(g).set if when == "crossing" else None,
            )
            gate(g).set()
            counts = kinds(results)
            taken = [
                i for i, r in enumerate(results) if r in (Delivery.BUFFERED, Delivery.CONSUMED)
            ]
            assert len(taken) == 3, counts
            allowed = {"buffered", "consumed", "MailboxFull", "not_stored", "AlreadyTerminal"}
            assert set(counts) <= allowed, counts
            if when == "before":
                assert counts == {"buffered": 3, "MailboxFull": 7}, counts
            if when == "waiting":
                assert counts["consumed"] == 3 and counts["buffered"] == 0, counts
                assert counts["MailboxFull"] == 0, counts
            result = handle.result(timeout=20)
            assert isinstance(result, list) and sorted(cast(list[int], result)) == taken, (
                result,
                counts,
            )
            rows = client.signals_of(handle.id)
            assert [r["payload"] for r in rows] == result
            assert all(r["consumed_by"] == "soa_n" for r in rows), rows
            assert calls_of(handle.id) == {"soa_hold": 1, "soa_echo": 1}


@pytest.mark.parametrize("when", ["before", "crossing"])
def test_soa_signal_flood_into_wait_any_takes_exactly_one(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker], when: str
) -> None:
    """wait_any has capacity 1: across both names, one signal is stored, the others are
    MailboxFull (not active yet) or NOT_STORED (completed); the output is that one."""
    start_worker(soa_echo, soa_hold)
    with clients(cyclone_dsn, 10) as many:
        for _ in range(3):
            g = new_gate()
            handle = client.submit(soa_any_cross, g)
            wait_until(started(handle.id, "soa_hold"), what="the hold step")
            names = ["soa_a", "soa_b"]
            results = race(
                10,
                lambda i, h=handle: many[i].signal(h.id, ("soa_a", "soa_b")[i % 2], i),
                extra=gate(g).set if when == "crossing" else None,
            )
            gate(g).set()
            counts = kinds(results)
            taken = [
                i for i, r in enumerate(results) if r in (Delivery.BUFFERED, Delivery.CONSUMED)
            ]
            assert len(taken) == 1, counts
            assert set(counts) <= {
                "buffered",
                "consumed",
                "MailboxFull",
                "not_stored",
                "AlreadyTerminal",
            }
            (winner,) = taken
            assert handle.result(timeout=20) == {"name": names[winner % 2], "payload": winner}
            rows = client.signals_of(handle.id)
            assert [(r["name"], r["payload"]) for r in rows] == [(names[winner % 2], winner)]


def test_soa_signals_racing_a_cancel_are_stored_iff_accepted(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A signal either lands before the cancel (CONSUMED, stored) or after it
    (AlreadyTerminal, not stored): no signal is stored that its sender was told was refused,
    and none accepted is lost."""
    start_worker(soa_echo)
    with clients(cyclone_dsn, 12) as many:
        for _ in range(4):
            handle = client.submit(soa_mailbox, 0)
            wait_until(
                waiting(client, handle.id, "soa_many"),
                what="the wait",
            )
            results = race(
                11,
                lambda i, h=handle: many[i].signal(h.id, "soa_many", i),
                extra=lambda h=handle: many[11].cancel(h.id),
            )
            counts = kinds(results)
            assert set(counts) <= {"consumed", "AlreadyTerminal"}, counts
            accepted = sorted(i for i, r in enumerate(results) if r is Delivery.CONSUMED)
            run = handle.wait(timeout=20)
            assert run.state is RunState.CANCELLED
            stored = sorted(r["payload"] for r in client.signals_of(handle.id))
            assert stored == accepted, (stored, counts)
            assert run.step("soa_many").state is StepState.CANCELLED
            # and a signal to the cancelled run is refused, and not stored
            with pytest.raises(AlreadyTerminal):
                client.signal(handle.id, "soa_many", "late")
            assert len(client.signals_of(handle.id)) == len(accepted)


def test_soa_signal_before_its_wait_and_to_ended_runs(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Before the wait is reached: BUFFERED, then MailboxFull; consumed on activation.
    To a completed or cancelled run: AlreadyTerminal; an unknown name: SignalNotDeliverable."""
    start_worker(soa_echo, soa_hold)
    g = new_gate()
    handle = client.submit(soa_one_sig, g)
    assert client.signal(handle.id, "soa_one", "early") is Delivery.BUFFERED
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "soa_one", "second")
    with pytest.raises(SignalNotDeliverable):
        client.signal(handle.id, "soa_nobody", 1)
    gate(g).set()
    assert handle.result(timeout=20) == "early"
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "soa_one", "after the end")
    assert [r["payload"] for r in client.signals_of(handle.id)] == ["early"]

    g2 = new_gate()
    cancelled = client.submit(soa_one_sig, g2)
    client.cancel(cancelled.id)
    with pytest.raises(AlreadyTerminal):
        client.signal(cancelled.id, "soa_one", "to a cancelled run")
    assert client.signals_of(cancelled.id) == []


# -- cancel racing completion ----------------------------------------------------------------------


def test_soa_cancel_racing_the_last_completion_has_one_consistent_end(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Either the completion won (run completed, every step completed, cancel raised
    AlreadyTerminal) or the cancel won (run cancelled, the last step cancelled with no
    output, its late completion fenced): never a mix."""
    start_worker(soa_echo, soa_hold)
    ends: Counter[str] = Counter()
    with clients(cyclone_dsn, 4) as many:
        for _ in range(8):
            g = new_gate()
            handle = client.submit(soa_last, g)
            wait_until(started(handle.id, "soa_hold"), what="the last step")
            results = race(3, lambda i, h=handle: many[i].cancel(h.id), extra=gate(g).set)
            run = handle.wait(timeout=20)
            last = run.step("soa_hold")
            counts = kinds(results)
            ends[run.state.value] += 1
            if run.state is RunState.COMPLETED:
                assert counts == {"AlreadyTerminal": 3}, counts
                assert [s.state for s in run.steps] == [StepState.COMPLETED] * 2
                assert last.output == g and client.result(handle.id) == g
            else:
                assert run.state is RunState.CANCELLED, run.state
                assert counts == {"None": 1, "AlreadyTerminal": 2}, counts
                assert last.state is StepState.CANCELLED and last.output is None
                with pytest.raises(RunFailed):
                    client.result(handle.id)
            assert calls_of(handle.id) == {"soa_echo": 1, "soa_hold": 1}
    assert sum(ends.values()) == 8


def test_soa_cancel_from_many_clients_is_accepted_once(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(soa_echo, soa_hold)
    with clients(cyclone_dsn, 10) as many:
        for _ in range(3):
            g = new_gate()
            handle = client.submit(soa_last, g)
            wait_until(started(handle.id, "soa_hold"), what="the last step")
            results = race(10, lambda i, h=handle: many[i].cancel(h.id))
            assert kinds(results) == {"None": 1, "AlreadyTerminal": 9}, kinds(results)
            gate(g).set()
            run = handle.wait(timeout=20)
            assert run.state is RunState.CANCELLED
            assert run.step("soa_hold").state is StepState.CANCELLED


def test_soa_cancel_many_from_several_clients_cancels_each_run_once(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """cancel_many from 6 clients at once over 10 running runs: every run cancelled, and the
    calls' `acted` add up to 10 (each run cancelled by exactly one call)."""
    start_worker(soa_echo, soa_hold)
    g = new_gate()
    handles = [client.submit(soa_last, g) for _ in range(10)]
    with clients(cyclone_dsn, 6) as many:
        results = race(
            6,
            lambda i: many[i].cancel_many(RunFilter(workflows="soa_last"), batch_size=3),
        )
    assert all(not isinstance(r, Exception) for r in results), results
    acted = sum(r.acted for r in results)  # type: ignore[attr-defined]
    assert acted == 10, results
    gate(g).set()
    for h in handles:
        assert h.wait(timeout=20).state is RunState.CANCELLED


# -- pause/resume storms ---------------------------------------------------------------------


def test_soa_pause_resume_storm_runs_each_step_once(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Eight clients pausing and resuming a six-step chain while a worker runs it: each call
    succeeds or is refused with a typed error (already paused / not paused / ended), the run
    completes with the right result, and each handler ran exactly once."""
    start_worker(soa_tick, poll_interval=0.05)
    start_worker(soa_tick, poll_interval=0.05)
    with clients(cyclone_dsn, 8) as many:
        for _ in range(3):
            handle = client.submit(soa_chain, 0)
            stop = threading.Event()

            def storm(
                i: int, handle_id: int = handle.id, stop: threading.Event = stop
            ) -> list[str]:
                seen: list[str] = []
                for n in range(40):
                    if stop.is_set():
                        break
                    try:
                        (many[i].pause if (n + i) % 2 == 0 else many[i].resume)(handle_id)
                        seen.append("ok")
                    except (InvalidTransition, AlreadyTerminal) as exc:
                        seen.append(type(exc).__name__)
                        if isinstance(exc, AlreadyTerminal):
                            break
                return seen

            results = race(8, storm)
            stop.set()
            assert all(isinstance(r, list) for r in results), results
            with contextlib.suppress(InvalidTransition, AlreadyTerminal):
                client.resume(handle.id)
            run = handle.wait(timeout=20)
            assert run.state is RunState.COMPLETED
            assert client.result(handle.id) == 6
            nodes = ["soa_tick"] + [f"soa_tick_{n}" for n in range(2, 7)]
            assert calls_of(handle.id) == dict.fromkeys(nodes, 1)
            assert all(s.attempt == 0 and s.reclaims == 0 for s in run.steps), run.steps
            # a pause lets running handlers finish: none is told to stop
            assert not {n for r, n in TOLD_TO_STOP if r == handle.id}


def test_soa_resume_many_from_several_clients_resumes_each_run_once(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(soa_tick)
    handles = [client.submit(soa_chain, i) for i in range(6)]
    for h in handles:
        with contextlib.suppress(AlreadyTerminal):
            client.pause(h.id)
    paused = [h for h in handles if h.get().state is RunState.PAUSED]
    with clients(cyclone_dsn, 5) as many:
        results = race(
            5,
            lambda i: many[i].resume_many(RunFilter(workflows="soa_chain"), batch_size=2),
        )
    assert all(not isinstance(r, Exception) for r in results), results
    assert sum(r.acted for r in results) == len(paused), results  # type: ignore[attr-defined]
    for i, h in enumerate(handles):
        assert h.result(timeout=20) == i + 6
        assert set(calls_of(h.id).values()) == {1}


# -- retry storms --------------------------------------------------------------------------------


def test_soa_retry_of_a_failed_node_from_ten_clients_runs_it_once_more(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Ten concurrent retries of one failed node: one is accepted, the others are refused
    with InvalidTransition (the node is no longer discarded); the node runs once more."""
    start_worker(soa_flaky, soa_tail)
    with clients(cyclone_dsn, 10) as many:
        for _ in range(3):
            g = new_gate()
            handle = client.submit(soa_retry, g)
            assert handle.wait(timeout=20).state is RunState.FAILED
            results = race(10, lambda i, h=handle: many[i].retry(h.id, "soa_flaky"))
            assert kinds(results) == {"None": 1, "InvalidTransition": 9}, kinds(results)
            gate(g).set()
            assert handle.result(timeout=20) == g
            assert calls_of(handle.id) == {"soa_flaky": 2, "soa_tail": 1}


def test_soa_retry_many_from_several_clients_retries_each_run_once(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(soa_flaky, soa_tail)
    g = new_gate()
    handles = [client.submit(soa_retry, g) for _ in range(6)]
    for h in handles:
        assert h.wait(timeout=20).state is RunState.FAILED
    with clients(cyclone_dsn, 6) as many:
        results = race(
            6,
            lambda i: many[i].retry_many(RunFilter(workflows="soa_retry"), batch_size=2),
        )
    assert all(not isinstance(r, Exception) for r in results), results
    assert sum(r.acted for r in results) == 6, results  # type: ignore[attr-defined]
    gate(g).set()
    for h in handles:
        assert h.result(timeout=20) == g
        assert calls_of(h.id) == {"soa_flaky": 2, "soa_tail": 1}


# -- fork of a running run ------------------------------------------------------------------


def test_soa_fork_of_a_running_run_from_eight_clients(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """ "A fork can be made of a run in any state, any number of times": eight forks of a
    run whose middle step is running make eight new runs; each copies the completed first
    step, runs the rest, and the source run is unchanged and completes."""
    start_worker(soa_echo, soa_hold, soa_tail)
    g = new_gate()
    source = client.submit(soa_forked, g)
    wait_until(started(source.id, "soa_hold"), what="the middle step")
    with clients(cyclone_dsn, 8) as many:
        results = race(8, lambda i: many[i].fork(source.id, "soa_hold"))
    assert all(not isinstance(r, Exception) for r in results), results
    forks = [r.id for r in results]  # type: ignore[attr-defined]
    assert len(set(forks)) == 8 and source.id not in forks
    gate(g).set()
    assert source.result(timeout=20) == g
    assert calls_of(source.id) == {"soa_echo": 1, "soa_hold": 1, "soa_tail": 1}
    for fork_id in forks:
        assert client.result(fork_id, timeout=20) == g
        run = client.get_run(fork_id)
        assert run.forked_from == source.id and run.fork_node == "soa_hold"
        assert run.step("soa_echo").copied and run.step("soa_echo").output == g
        assert not run.step("soa_hold").copied
        assert calls_of(fork_id) == {"soa_hold": 1, "soa_tail": 1}


def test_soa_fork_racing_the_source_step_completion_is_consistent(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A fork from the tail taken while the middle step completes either copies the middle
    step with its output, or runs it again: never a copied step without its output."""
    start_worker(soa_echo, soa_hold, soa_tail)
    seen: set[bool] = set()
    with clients(cyclone_dsn, 4) as many:
        for _ in range(6):
            g = new_gate()
            source = client.submit(soa_forked, g)
            wait_until(started(source.id, "soa_hold"), what="the middle step")
            results = race(4, lambda i, s=source: many[i].fork(s.id, "soa_tail"), extra=gate(g).set)
            assert all(not isinstance(r, Exception) for r in results), results
            for fork in results:
                fork_id: int = fork.id  # type: ignore[attr-defined]
                assert client.result(fork_id, timeout=20) == g
                run = client.get_run(fork_id)
                middle = run.step("soa_hold")
                seen.add(middle.copied)
                assert middle.state is StepState.COMPLETED and middle.output == g
                expected = {"soa_tail": 1} if middle.copied else {"soa_hold": 1, "soa_tail": 1}
                assert calls_of(fork_id) == expected
            assert source.result(timeout=20) == g
    assert seen  # at least one shape was seen


# -- more races ---------------------------------------------------------------------------------


def test_soa_pause_racing_the_last_completion_still_ends_the_run(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Pause while the last step runs: "Running steps finish", and "a run that ends while
    paused keeps its paused_at": the run ends completed either way, never stuck paused."""
    start_worker(soa_echo, soa_hold)
    with clients(cyclone_dsn, 4) as many:
        for _ in range(6):
            g = new_gate()
            handle = client.submit(soa_last, g)
            wait_until(started(handle.id, "soa_hold"), what="the last step")
            results = race(3, lambda i, h=handle: many[i].pause(h.id), extra=gate(g).set)
            counts = kinds(results)
            assert set(counts) <= {"None", "InvalidTransition", "AlreadyTerminal"}, counts
            assert counts["None"] <= 1, counts
            run = handle.wait(timeout=20)
            assert run.state is RunState.COMPLETED, (run.state, counts)
            assert client.result(handle.id) == g
            assert (run.paused_at is not None) == (counts["None"] == 1), counts


def test_soa_replay_from_ten_clients_is_accepted_once(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """retry(force=True) of a completed node from ten clients at once: one replay, the
    others refused (the node is under way again); the node and its dependent run once more."""
    start_worker(soa_echo, soa_hold, soa_tail)
    with clients(cyclone_dsn, 10) as many:
        for _ in range(3):
            g = new_gate()
            gate(g).set()
            handle = client.submit(soa_forked, g)
            assert handle.result(timeout=20) == g
            gate(g).clear()
            results = race(10, lambda i, h=handle: many[i].retry(h.id, "soa_hold", force=True))
            assert kinds(results) == {"None": 1, "InvalidTransition": 9}, kinds(results)
            gate(g).set()
            assert handle.result(timeout=20) == g
            assert calls_of(handle.id) == {"soa_echo": 1, "soa_hold": 2, "soa_tail": 2}


def test_soa_retry_and_retry_many_racing_retry_a_run_once(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(soa_flaky, soa_tail)
    with clients(cyclone_dsn, 8) as many:
        for _ in range(3):
            g = new_gate()
            handle = client.submit(soa_retry, g)
            assert handle.wait(timeout=20).state is RunState.FAILED

            def call(i: int, h: int = handle.id) -> object:
                if i % 2:
                    many[i].retry(h, "soa_flaky")
                    return None
                return many[i].retry_many(RunFilter(workflows="soa_retry")).acted

            results = race(8, call)
            counts = kinds(results)
            assert set(counts) <= {"None", "InvalidTransition", "0", "1"}, counts
            assert counts["None"] + counts["1"] == 1, counts
            gate(g).set()
            assert handle.result(timeout=20) == g
            assert calls_of(handle.id) == {"soa_flaky": 2, "soa_tail": 1}


def test_soa_signals_racing_pause_and_resume_take_exactly_n(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Senders into wait_n(3) while other clients pause and resume the run and the wait
    activates: three signals taken, the output is those three."""
    start_worker(soa_echo, soa_hold)
    start_worker(soa_echo, soa_hold)
    with clients(cyclone_dsn, 12) as many:
        for _ in range(4):
            g = new_gate()
            handle = client.submit(soa_n_cross, g)
            wait_until(started(handle.id, "soa_hold"), what="the hold")

            def call(i: int, h: int = handle.id, g: str = g) -> object:
                if i < 8:
                    return many[i].signal(h, "soa_n", i)
                if i == 8:
                    gate(g).set()
                    return "released"
                outcomes = []
                for n in range(6):
                    try:
                        (many[i].pause if (n + i) % 2 else many[i].resume)(h)
                        outcomes.append("ok")
                    except (InvalidTransition, AlreadyTerminal) as exc:
                        outcomes.append(type(exc).__name__)
                return outcomes

            results = race(12, call)
            signals = results[:8]
            counts = kinds(signals)
            taken = [
                i for i, r in enumerate(signals) if r in (Delivery.BUFFERED, Delivery.CONSUMED)
            ]
            assert len(taken) == 3, counts
            assert set(counts) <= {
                "buffered",
                "consumed",
                "MailboxFull",
                "not_stored",
                "AlreadyTerminal",
            }, counts
            with contextlib.suppress(InvalidTransition, AlreadyTerminal):
                client.resume(handle.id)
            result = handle.result(timeout=20)
            assert isinstance(result, list) and sorted(cast(list[int], result)) == taken, (
                result,
                counts,
            )
            assert calls_of(handle.id) == {"soa_hold": 1, "soa_echo": 1}


def test_soa_cancel_and_resume_racing_on_a_paused_run(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A paused run that one client resumes while others cancel ends cancelled; no step
    completes after the cancel and nothing of it stays paused or runnable."""
    start_worker(soa_tick)
    with clients(cyclone_dsn, 6) as many:
        for _ in range(4):
            handle = client.submit(soa_chain, 0)
            wait_until(started(handle.id, "soa_tick"), what="the first tick")
            client.pause(handle.id)  # six ticks of 30 ms each: still running

            def call(i: int, h: int = handle.id) -> object:
                if i % 2:
                    many[i].resume(h)
                else:
                    many[i].cancel(h)
                return None

            results = race(6, call)
            counts = kinds(results[0::2])
            assert counts == {"None": 1, "AlreadyTerminal": 2}, counts
            run = handle.wait(timeout=20)
            assert run.state is RunState.CANCELLED
            states = [s.state for s in run.steps]
            assert set(states) <= {StepState.COMPLETED, StepState.CANCELLED}, states
            # completed steps are a prefix of the chain
            assert states == sorted(states, key=lambda s: s is StepState.CANCELLED), states


def test_soa_retry_of_parent_and_child_run_racing_retries_once(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Retries of a failed child node (parent run) and of the failed node of its child run,
    from eight clients at once: one retry accepted (the parent's: the child run alone is
    refused while its parent node does not wait for it), the child's node runs once more."""
    start_worker(soa_flaky, soa_tail)
    with clients(cyclone_dsn, 8) as many:
        for _ in range(3):
            g = new_gate()
            parent = client.submit(soa_parent, g)
            assert parent.wait(timeout=20).state is RunState.FAILED
            (kid,) = client.children_of(parent.id)
            kid_id = kid.get("id", kid.get("run_id"))
            assert isinstance(kid_id, int), kid

            def call(i: int, p: int = parent.id, k: int = kid_id) -> object:
                if i % 2:
                    many[i].retry(p, "soa_kid")
                else:
                    many[i].retry(k, "soa_flaky")
                return None

            results = race(8, call)
            assert kinds(results[1::2]) == {"None": 1, "InvalidTransition": 3}, results
            assert kinds(results[0::2]) == {"InvalidTransition": 4}, results
            gate(g).set()
            assert parent.result(timeout=20) == g
            assert calls_of(kid_id) == {"soa_flaky": 2}
            assert calls_of(parent.id) == {"soa_tail": 1}


def test_soa_submit_once_waiters_behind_a_rolled_back_holder_make_one_run(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """ "A caller that rolls back does not block the key": eight callers blocked behind an
    open submit_once_tx that then rolls back end with one new run between them."""
    start_worker(soa_echo)
    with clients(cyclone_dsn, 8) as many:
        for round_ in range(3):
            key = f"soa-rb-{round_}"
            with psycopg.connect(cyclone_dsn) as conn:
                held = client.submit_once_tx(conn, soa_once, "rolled back", key=key)
                assert held.created

                def rollback(conn: psycopg.Connection[Any] = conn) -> None:
                    wait_until(lambda: _waiting_on_locks(client) >= 4, what="blocked callers")
                    conn.rollback()

                results = race(
                    8,
                    lambda i, key=key: many[i].submit_once(soa_once, i, key=key),
                    extra=rollback,
                )
            handles = [r for r in results if not isinstance(r, Exception)]
            assert len(handles) == 8, results
            assert len({h.id for h in handles}) == 1, results  # type: ignore[attr-defined]
            created = [i for i, h in enumerate(handles) if h.created]  # type: ignore[attr-defined]
            assert len(created) == 1, results
            assert handles[0].id != held.id  # type: ignore[attr-defined]
            assert client.result(handles[0].id, timeout=20) == created[0]  # type: ignore[attr-defined]


def _waiting_on_locks(client: Client) -> int:
    with psycopg.connect(client.dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


def test_soa_one_shared_client_serves_sixteen_threads(
    client: Client, start_worker: Callable[..., Worker], cyclone_dsn: str
) -> None:
    """One Client (pool_size=2) shared by sixteen threads, as a threaded web server would:
    the calls queue for its pool and all succeed."""
    start_worker(soa_echo)
    with Client(cyclone_dsn, pool_size=2) as shared:
        handle = shared.submit(soa_mailbox, 0)
        results = race(16, lambda i: shared.signal(handle.id, "soa_many", i))
        assert kinds(results) == {"consumed": 16}, kinds(results)
        keyed = race(16, lambda i: shared.submit_once(soa_once, i, key="soa-shared"))
        assert len({h.id for h in keyed}) == 1, keyed  # type: ignore[attr-defined]
        assert sum(h.created for h in keyed) == 1  # type: ignore[attr-defined]
    assert sorted(r["payload"] for r in client.signals_of(handle.id)) == list(range(16))


def test_soa_async_client_gathered_signals_and_submit_once(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Twelve signals and twelve submit_once calls gathered on one AsyncClient."""
    start_worker(soa_echo)
    handle = client.submit(soa_mailbox, 0)

    async def main() -> tuple[list[object], list[object]]:
        async with AsyncClient(cyclone_dsn) as aclient:
            sent = await asyncio.gather(
                *(aclient.signal(handle.id, "soa_many", i) for i in range(12)),
                return_exceptions=True,
            )
            keyed = await asyncio.gather(
                *(aclient.submit_once(soa_once, i, key="soa-async") for i in range(12)),
                return_exceptions=True,
            )
        return list(sent), list(keyed)

    sent, keyed = asyncio.run(main())
    assert kinds(sent) == {"consumed": 12}, sent
    assert all(not isinstance(k, Exception) for k in keyed), keyed
    assert len({k.id for k in keyed}) == 1  # type: ignore[attr-defined]
    assert sum(k.created for k in keyed) == 1  # type: ignore[attr-defined]
    assert sorted(r["payload"] for r in client.signals_of(handle.id)) == list(range(12))
