"""Property: any interleaving of signals, pauses, resumes and cancels leaves a run that can end.

After a random sequence of operations, an operator who resumes the run (if
paused) and sends each awaited signal once more sees the run reach a terminal
state: nothing is ever stuck with nothing able to advance it. Runs that were
cancelled stay cancelled; the others complete.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    InvalidTransition,
    MailboxFull,
    Worker,
    step,
    wait_n,
    wait_signal,
    workflow,
)
from cyclone_dsl.states import RunState


@step(name="rc_echo")
def echo(x: object) -> object:
    return x


@step(name="rc_join")
def join(a: object, b: object) -> list[object]:
    return [a, b]


@workflow(name="rc_flow")
def flow(x):  # type: ignore[no-untyped-def]
    first = echo(x)
    approved = wait_signal("approve", after=[first])
    votes = wait_n("vote", 2)
    return join(echo(approved), votes)


OPERATIONS = st.lists(
    st.sampled_from(["approve", "vote", "pause", "resume", "cancel", "nothing"]), max_size=8
)
started: set[int] = set()


@given(operations=OPERATIONS)
@settings(max_examples=15, deadline=None)
def test_interleavings_never_strand_a_run(
    client: Client, start_worker: Callable[..., Worker], operations: list[str]
) -> None:
    if id(client) not in started:
        started.add(id(client))
        start_worker(echo, join, concurrency=4)
    handle = client.submit(flow, 1)
    cancelled = False
    for operation in operations:
        try:
            if operation in ("approve", "vote"):
                client.signal(handle.id, operation, operation)
            elif operation == "pause":
                client.pause(handle.id)
            elif operation == "resume":
                client.resume(handle.id)
            elif operation == "cancel":
                client.cancel(handle.id)
                cancelled = True
        except (AlreadyTerminal, InvalidTransition, MailboxFull):
            pass
    # The operator finishes the story: resume, then send what is still awaited.
    with contextlib.suppress(AlreadyTerminal, InvalidTransition):
        client.resume(handle.id)
    for name in ("approve", "vote", "vote"):
        with contextlib.suppress(AlreadyTerminal, MailboxFull):
            client.signal(handle.id, name, name)
    run = handle.wait(timeout=20)
    if cancelled:
        assert run.state is RunState.CANCELLED
    else:
        assert run.state is RunState.COMPLETED
        result = handle.result(timeout=1)
        assert isinstance(result, list) and result[0] == "approve"
        assert result[1] == ["vote", "vote"]
    assert all(s.state.is_terminal for s in run.steps)


def test_a_signal_flood_respects_the_quorum(client: Client) -> None:
    handle = client.submit(flow, 1)
    outcomes: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(16)

    def flood(worker: int) -> None:
        barrier.wait()
        for i in range(10):
            try:
                delivery = client.signal(handle.id, "vote", f"{worker}-{i}")
                outcome = delivery.value
            except MailboxFull:
                outcome = "full"
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=flood, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("consumed") == 2
    assert outcomes.count("not_stored") + outcomes.count("full") == 158
    votes = client.get_run(handle.id).step("vote")
    assert isinstance(votes.output, list) and len(votes.output) == 2


@pytest.mark.parametrize("racers", [8])
def test_cancel_racing_signals_ends_in_one_state(client: Client, racers: int) -> None:
    for _ in range(10):
        handle = client.submit(flow, 1)
        barrier = threading.Barrier(racers)

        def act(n: int, run_id: int = handle.id, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                if n == 0:
                    client.cancel(run_id)
                else:
                    client.signal(run_id, "vote", n)
            except (AlreadyTerminal, MailboxFull):
                pass

        threads = [threading.Thread(target=act, args=(n,)) for n in range(racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        run = client.get_run(handle.id)
        assert run.state is RunState.CANCELLED
        assert all(s.state.is_terminal for s in run.steps)
