"""Audit at the edges of scale: big fan-outs, long chains, wide joins, deep child runs,
payloads at their byte limits, big quorums and mailboxes, bulk submits and pagination
over thousands of rows. Looking for hangs, wrong results, crashes and silent truncation."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    Delivery,
    EventLimitExceeded,
    InvalidArgument,
    InvalidGraph,
    InvalidPayload,
    MailboxFull,
    NodeRef,
    PayloadTooLarge,
    Ref,
    RunState,
    StepContext,
    Worker,
    WorkflowDef,
    child,
    for_each,
    step,
    wait_n,
    wait_signal,
    workflow,
)
from cyclone_dsl.payload import DEFAULT_MAX_BYTES, encoded_size

LIMIT = DEFAULT_MAX_BYTES  # 16 MiB: the documented payload byte limit
BIG = 5_000


# -- handlers -------------------------------------------------------------------------


@step(name="sla_range", max_attempts=1)
def sla_range(n: int) -> list[int]:
    return list(range(n))


@step(name="sla_double", max_attempts=1)
def sla_double(x: int) -> int:
    return x * 2


@step(name="sla_inc", max_attempts=1)
def sla_inc(x: int) -> int:
    return x + 1


@step(name="sla_total", max_attempts=1)
def sla_total(values: list[int]) -> int:
    return sum(values)


@step(name="sla_count", max_attempts=1)
def sla_count(values: list[Any]) -> int:
    return len(values)


@step(name="sla_blob", max_attempts=1)
def sla_blob(size: int) -> str:
    """A string whose compact JSON encoding is exactly ``size`` bytes."""
    return "x" * (size - 2)


@step(name="sla_kib", max_attempts=1)
def sla_kib(i: int) -> str:
    return f"{i:08d}" + "y" * 1016  # 1,024 characters, 1,026 bytes as JSON


# -- for_each at scale ----------------------------------------------------------------


@workflow(name="sla_fan_unbounded")
def sla_fan_unbounded(n: Ref[int]) -> NodeRef[list[int]]:
    collected = for_each(sla_double, over=sla_range(n))
    sla_total(collected)
    return collected


@workflow(name="sla_fan_narrow")
def sla_fan_narrow(n: Ref[int]) -> NodeRef[list[int]]:
    return for_each(sla_double, over=sla_range(n), max_parallel=3)


@workflow(name="sla_fan_root_wide")
def sla_fan_root_wide(items: Ref[list[int]]) -> NodeRef[list[int]]:
    return for_each(sla_double, over=items, max_parallel=1_000)


def test_sla_for_each_of_5000_collects_every_item_in_order_and_feeds_it_downstream(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_range, sla_double, sla_total, concurrency=16, batch_size=200)
    handle = client.submit(sla_fan_unbounded, BIG)
    assert handle.result(timeout=150) == [2 * i for i in range(BIG)]
    run = client.get_run(handle.id)
    items = [s for s in run.steps if s.item_of == "sla_double"]
    assert sorted(s.item_index or 0 for s in items) == list(range(BIG))
    assert {s.state.value for s in items} == {"completed"}
    assert run.step("sla_total").output == BIG * (BIG - 1)


def test_sla_for_each_over_a_5000_item_run_input_with_max_parallel_1000(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    items: list[Any] = list(range(BIG, 0, -1))
    handle = client.submit(sla_fan_root_wide, items)
    start_worker(sla_double, concurrency=16, batch_size=200)
    assert handle.result(timeout=150) == [2 * i for i in items]


def test_sla_for_each_with_max_parallel_3_over_200_items(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    # A window of 3 refilled about 67 times: the order and completeness of a narrow window
    # do not need more (600 took a refill round trip each, 2 s); the 5,000-item fan-outs
    # above test the scale.
    start_worker(sla_range, sla_double, concurrency=8)
    assert client.submit(sla_fan_narrow, 200).result(timeout=60) == [2 * i for i in range(200)]


@workflow(name="sla_fan_items_capped")
def sla_fan_items_capped(n: Ref[int]) -> NodeRef[list[int]]:
    return for_each(sla_double, over=sla_range(n), max_items=1_000)


@pytest.mark.parametrize("n", [0, 1_000])
def test_sla_for_each_up_to_max_items_completes_exactly(
    n: int, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_range, sla_double, concurrency=8)
    assert client.submit(sla_fan_items_capped, n).result(timeout=30) == [2 * i for i in range(n)]


def test_sla_for_each_one_over_max_items_fails_before_any_item(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_range, sla_double, concurrency=8)
    run = client.submit(sla_fan_items_capped, 1_001).wait(timeout=90)
    assert run.state is RunState.FAILED
    node = run.step("sla_double")
    assert node.error_kind == "item_limit"
    assert [s for s in run.steps if s.item_of is not None] == []


KIB_ITEMS = 300  # the boundary is exact at any size; 5,000-item fan-outs test the scale
KIB_COLLECTED = encoded_size([f"{i:08d}" + "y" * 1016 for i in range(KIB_ITEMS)])


@workflow(name="sla_fan_bytes_exact")
def sla_fan_bytes_exact(n: Ref[int]) -> NodeRef[list[str]]:
    return for_each(sla_kib, over=sla_range(n), max_bytes=KIB_COLLECTED)


@workflow(name="sla_fan_bytes_under")
def sla_fan_bytes_under(n: Ref[int]) -> NodeRef[list[str]]:
    return for_each(sla_kib, over=sla_range(n), max_bytes=KIB_COLLECTED - 1, max_parallel=500)


def test_sla_for_each_collected_output_exactly_at_max_bytes_completes(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_range, sla_kib, concurrency=8)
    result = client.submit(sla_fan_bytes_exact, KIB_ITEMS).result(timeout=30)
    assert isinstance(result, list)
    assert encoded_size(result) == KIB_COLLECTED
    assert result == [f"{i:08d}" + "y" * 1016 for i in range(KIB_ITEMS)]


def test_sla_for_each_collected_output_one_byte_over_max_bytes_fails_whole(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_range, sla_kib, concurrency=8)
    run = client.submit(sla_fan_bytes_under, KIB_ITEMS).wait(timeout=90)
    assert run.state is RunState.FAILED
    node = run.step("sla_kib")
    assert node.error_kind == "output_limit"
    assert node.output is None  # nothing truncated kept


@step(name="sla_mib", max_attempts=1)
def sla_mib(i: int) -> str:
    return f"{i:04d}" + "z" * (1024 * 1024 - 4)


@workflow(name="sla_fan_over_payload_limit")
def sla_fan_over_payload_limit(n: Ref[int]) -> NodeRef[int]:
    return sla_count(for_each(sla_mib, over=sla_range(n)))


def test_sla_for_each_collected_output_over_the_payload_limit(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_range, sla_mib, sla_count, concurrency=4)
    """max_bytes=0 is documented as "no limit": the collected output (17 MiB) may pass the
    16 MiB payload limit of one output, and must then reach its dependent whole."""
    run = client.submit(sla_fan_over_payload_limit, 17).wait(timeout=60)
    assert run.state is RunState.COMPLETED
    collected = run.step("sla_mib").output
    assert isinstance(collected, list)
    assert encoded_size(collected) > LIMIT
    shapes = [(v[:4], len(v)) for v in collected if isinstance(v, str)]
    assert shapes == [(f"{i:04d}", 1024 * 1024) for i in range(17)]
    assert run.step("sla_count").output == 17


# -- long chains, wide joins, deep children ---------------------------------------------


@workflow(name="sla_chain_300")
def sla_chain_300(x: Ref[int]) -> NodeRef[int]:
    ref = sla_inc(x)
    for _ in range(299):
        ref = sla_inc(ref)
    return ref


@step(name="sla_const", max_attempts=1)
def sla_const(i: int) -> int:
    return i


@step(name="sla_echo", max_attempts=1)
def sla_echo(values: list[int]) -> list[int]:
    return values


@workflow(name="sla_join_300")
def sla_join_300() -> NodeRef[list[int]]:
    return sla_echo([sla_const(i, node_id=f"sla_c{i}") for i in range(300)])


def test_sla_a_chain_of_300_nodes_built_by_a_loop_runs_in_order(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    assert len(sla_chain_300.graph.nodes) == 300
    start_worker(sla_inc, concurrency=4)
    handle = client.submit(sla_chain_300, 7)
    assert handle.result(timeout=150) == 307
    run = client.get_run(handle.id)
    assert [s.output for s in sorted(run.steps, key=lambda s: s.id)] == list(range(8, 308))


def test_sla_a_join_of_300_inputs_gets_them_all_in_order(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_const, sla_echo, concurrency=8, batch_size=100)
    handle = client.submit(sla_join_300)
    assert handle.result(timeout=150) == list(range(300))
    assert sorted(client.dependencies(handle.id)["sla_echo"]) == sorted(
        f"sla_c{i}" for i in range(300)
    )


def _nest(depth: int) -> list[WorkflowDef]:
    """Workflows sla_nest_0 .. sla_nest_<depth-1>: level i runs level i-1 as a child run,
    then adds one; level 0 adds one. Level i's result is its input plus i + 1."""
    levels: list[WorkflowDef] = []
    for i in range(depth):
        inner = levels[-1] if levels else None

        def body(x: Ref[int], inner: WorkflowDef | None = inner) -> NodeRef[int]:
            if inner is None:
                return sla_inc(x)
            return sla_inc(child(inner, x))

        levels.append(workflow(name=f"sla_nest_{i}")(body))
    return levels


NEST = _nest(30)


def test_sla_child_runs_nested_30_levels_deep_give_the_exact_result(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_inc, *NEST, concurrency=4)
    top = client.submit(NEST[-1], 100)
    assert top.result(timeout=60) == 130
    depth, parent = 0, top.id
    while True:
        children = client.list_runs(parent_run_id=parent)
        if not children:
            break
        assert len(children) == 1
        assert children[0].state is RunState.COMPLETED
        depth, parent = depth + 1, children[0].id
    assert depth == 29
    assert client.get_run(parent).workflow == "sla_nest_0"


@workflow(name="sla_self")
def sla_self(x: Ref[int]) -> NodeRef[int]:
    return sla_inc(child(sla_self, x))


@workflow(name="sla_mutual_a")
def sla_mutual_a(x: Ref[int]) -> NodeRef[int]:
    return sla_inc(child(sla_mutual_b, x))


@workflow(name="sla_mutual_b")
def sla_mutual_b(x: Ref[int]) -> NodeRef[int]:
    return sla_inc(child(sla_mutual_a, x))


@pytest.mark.parametrize("wf", [sla_self, sla_mutual_a], ids=["self", "mutual"])
def test_sla_a_workflow_recursing_through_child_is_refused_at_build_and_writes_nothing(
    wf: WorkflowDef, client: Client
) -> None:
    with pytest.raises(InvalidGraph):
        client.submit(wf, 1)
    assert client.list_runs() == []


# -- payloads at the byte limit -----------------------------------------------------------


@step(name="sla_len", max_attempts=1)
def sla_len(text: str) -> int:
    return len(text.encode("utf-8"))


@workflow(name="sla_measure")
def sla_measure(text: Ref[str]) -> NodeRef[int]:
    return sla_len(text)


def _text_of_size(size: int, char: str) -> str:
    """A string whose compact JSON is exactly ``size`` bytes, mostly of ``char``."""
    width = len(char.encode("utf-8"))
    body, rest = divmod(size - 2, width)
    text = char * body + "a" * rest
    assert encoded_size(text) == size
    return text


@pytest.mark.parametrize("char", ["x", "\U0001f600"], ids=["ascii", "4-byte"])
def test_sla_a_run_input_exactly_at_the_payload_limit_is_stored_whole(
    char: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    text = _text_of_size(LIMIT, char)
    handle = client.submit(sla_measure, text)
    assert client.get_run(handle.id).input == text
    start_worker(sla_len)
    assert handle.result(timeout=150) == LIMIT - 2


@pytest.mark.parametrize("char", ["x", "\u00e9", "\U0001f600"], ids=["ascii", "2-byte", "4-byte"])
def test_sla_a_run_input_one_byte_over_the_payload_limit_is_refused_and_writes_nothing(
    char: str, client: Client
) -> None:
    text = _text_of_size(LIMIT + 1, char)
    with pytest.raises(PayloadTooLarge):
        client.submit(sla_measure, text)
    with pytest.raises(PayloadTooLarge):
        client.submit_many(sla_measure, ["small", text, "small"])
    with pytest.raises(PayloadTooLarge):
        client.enqueue(sla_len, text)
    assert client.list_runs() == []


@workflow(name="sla_blob_wf")
def sla_blob_wf(size: Ref[int]) -> NodeRef[str]:
    return sla_blob(size)


def test_sla_a_step_output_exactly_at_the_payload_limit_completes_whole(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_blob)
    result = client.submit(sla_blob_wf, LIMIT).result(timeout=60)
    assert isinstance(result, str)
    assert encoded_size(result) == LIMIT


def test_sla_a_step_output_one_byte_over_the_payload_limit_fails_with_output_limit(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_blob)
    run = client.submit(sla_blob_wf, LIMIT + 1).wait(timeout=60)
    assert run.state is RunState.FAILED
    blob = run.step("sla_blob")
    assert blob.error_kind == "output_limit"
    assert blob.output is None


@workflow(name="sla_await_payload")
def sla_await_payload() -> NodeRef[Any]:
    return wait_signal("sla_payload")


def test_sla_a_signal_payload_at_the_limit_is_delivered_whole_and_one_over_is_refused(
    client: Client,
) -> None:
    handle = client.submit(sla_await_payload)
    over = _text_of_size(LIMIT + 1, "\u00e9")
    with pytest.raises(PayloadTooLarge):
        client.signal(handle.id, "sla_payload", over)
    assert client.signals_of(handle.id) == []
    assert client.get_run(handle.id).state is RunState.RUNNING
    exact = _text_of_size(LIMIT, "\u00e9")
    assert client.signal(handle.id, "sla_payload", exact) is Delivery.CONSUMED
    assert handle.result(timeout=30) == exact


EVENT_LIMIT = 64 * 1024


@step(name="sla_emitter", max_attempts=1)
def sla_emitter(_: None, ctx: StepContext) -> str:
    ctx.emit(_text_of_size(EVENT_LIMIT, "\u00e9"))
    try:
        ctx.emit(_text_of_size(EVENT_LIMIT + 1, "\u00e9"))
    except PayloadTooLarge:
        return "refused"
    return "stored"


@workflow(name="sla_emit_wf")
def sla_emit_wf(x: Ref[None]) -> NodeRef[str]:
    return sla_emitter(x)


def test_sla_an_event_at_64_kib_is_stored_whole_and_one_byte_over_is_refused(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_emitter)
    handle = client.submit(sla_emit_wf)
    assert handle.result(timeout=30) == "refused"
    events = client.events_of(handle.id)
    assert [e.data for e in events] == [_text_of_size(EVENT_LIMIT, "\u00e9")]


@step(name="sla_pair", max_attempts=1)
def sla_pair(a: str, b: str) -> int:
    return len(a) + len(b)


@workflow(name="sla_pair_wf")
def sla_pair_wf(x: Ref[str]) -> NodeRef[int]:
    return sla_pair(x, x)


HALF_AND_A_BIT = _text_of_size(LIMIT // 2 + 16, "x")  # fits as a run input, not twice


def test_sla_submit_refuses_a_run_input_that_makes_a_step_input_too_large(
    client: Client,
) -> None:
    with pytest.raises(PayloadTooLarge, match="sla_pair"):
        client.submit(sla_pair_wf, HALF_AND_A_BIT)
    assert client.list_runs() == []


def test_sla_submit_many_refuses_a_run_input_that_makes_a_step_input_too_large(
    client: Client,
) -> None:
    with pytest.raises(PayloadTooLarge, match="sla_pair"):
        client.submit_many(sla_pair_wf, ["ok", HALF_AND_A_BIT])
    assert client.list_runs() == []


# -- big quorums and full mailboxes -----------------------------------------------------------

QUORUM = 400


@workflow(name="sla_quorum")
def sla_quorum() -> NodeRef[list[Any]]:
    votes = wait_n("sla_vote", QUORUM)
    wait_signal("sla_hold", after=[votes])  # keeps the run open after the quorum
    return votes


@workflow(name="sla_quorum_later")
def sla_quorum_later() -> NodeRef[list[Any]]:
    go = wait_signal("sla_go")
    return wait_n("sla_vote", QUORUM, after=[go])


def _flood(client: Client, run_id: int, payloads: list[int]) -> list[Delivery | str]:
    """Send one signal per payload from 8 threads; each outcome, or the error's class name."""

    def send(payload: int) -> Delivery | str:
        try:
            return client.signal(run_id, "sla_vote", payload)
        except MailboxFull:
            return "MailboxFull"

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(send, payloads))


def test_sla_wait_n_of_400_takes_400_signals_from_8_threads_exactly_once(
    cyclone_dsn: str,
) -> None:
    with Client(cyclone_dsn, pool_size=8) as client:
        handle = client.submit(sla_quorum)
        outcomes = _flood(client, handle.id, list(range(QUORUM + 40)))
        assert outcomes.count(Delivery.CONSUMED) == QUORUM
        assert outcomes.count(Delivery.NOT_STORED) == 40
        assert client.signal(handle.id, "sla_hold") is Delivery.CONSUMED
        result = handle.result(timeout=30)
        assert isinstance(result, list)
        assert len(result) == QUORUM
        assert len(set(result)) == QUORUM
        votes = [row for row in client.signals_of(handle.id) if row["name"] == "sla_vote"]
        consumed = [row for row in votes if row["consumed_at"] is not None]
        assert len(consumed) == len(votes) == QUORUM
        # arrival order: the output follows the mailbox's id order
        in_id_order = [row["payload"] for row in sorted(consumed, key=lambda row: row["id"])]
        assert result == in_id_order


def test_sla_a_mailbox_at_its_cap_of_400_refuses_the_rest_and_delivers_in_order(
    cyclone_dsn: str,
) -> None:
    with Client(cyclone_dsn, pool_size=8) as client:
        handle = client.submit(sla_quorum_later)
        outcomes = _flood(client, handle.id, list(range(QUORUM + 40)))
        assert outcomes.count(Delivery.BUFFERED) == QUORUM
        assert outcomes.count("MailboxFull") == 40
        assert len(client.signals_of(handle.id)) == QUORUM
        with pytest.raises(MailboxFull):
            client.signal(handle.id, "sla_vote", -1)
        assert client.signal(handle.id, "sla_go") is Delivery.CONSUMED
        result = handle.result(timeout=30)
        buffered = sorted(
            (row for row in client.signals_of(handle.id) if row["name"] == "sla_vote"),
            key=lambda row: row["id"],
        )
        assert result == [row["payload"] for row in buffered]
        assert len(set(result)) == QUORUM


# -- bulk submits -------------------------------------------------------------------------

BULK = 10_000
WAITING = 2_000


@step(name="sla_take", max_attempts=1)
def sla_take(value: Any) -> Any:
    return value


@workflow(name="sla_take_wf")
def sla_take_wf(value: Ref[Any]) -> NodeRef[Any]:
    ref: NodeRef[Any] = sla_take(value)
    return ref


def _bulk_inputs() -> list[Any]:
    return [{"i": i, "tag": f"\u00e9-{i}" + "p" * 1000} for i in range(BULK)]


def _bulk(client: Client, how: str, inputs: list[Any]) -> list[Any]:
    if how == "submit_many":
        return client.submit_many(sla_take_wf, inputs)
    return client.enqueue_many(sla_take, inputs)


def _all_runs(client: Client, page: int = 1_000) -> list[Any]:
    """Every run, newest first, paged with before_id."""
    rows: list[Any] = []
    before: int | None = None
    while True:
        batch = client.list_runs(limit=page, before_id=before)
        rows.extend(batch)
        if len(batch) < page:
            return rows
        before = batch[-1].id


@pytest.mark.parametrize("how", ["submit_many", "enqueue_many"])
def test_sla_10000_inputs_in_one_bulk_call_make_one_run_each_in_order(
    how: str, client: Client
) -> None:
    inputs = _bulk_inputs()
    ids = [h.id for h in _bulk(client, how, inputs)]
    assert len(ids) == len(set(ids)) == BULK
    runs = {run.id: run for run in _all_runs(client)}
    assert sorted(runs) == sorted(ids)
    assert [runs[i].input for i in ids] == inputs
    assert {run.state for run in runs.values()} == {RunState.RUNNING}


@pytest.mark.parametrize("how", ["submit_many", "enqueue_many"])
@pytest.mark.parametrize(
    "bad", [float("nan"), {1: "int key"}, "nul\x00"], ids=["nan", "int-key", "nul"]
)
def test_sla_one_bad_input_in_the_middle_of_10000_refuses_the_call_and_writes_nothing(
    how: str, bad: Any, client: Client
) -> None:
    inputs: list[Any] = list(range(BULK))
    inputs[BULK // 2] = bad
    with pytest.raises(InvalidPayload) as refused:
        _bulk(client, how, inputs)
    assert refused.value.reason
    assert client.list_runs() == []
    assert client.run_counts() == {}


@pytest.mark.parametrize("how", ["submit_many", "enqueue_many"])
def test_sla_a_bulk_calls_invalid_payload_names_the_bad_input(how: str, client: Client) -> None:
    inputs: list[Any] = [{"n": i} for i in range(BULK)]
    inputs[5_017] = {"n": float("inf")}
    with pytest.raises(InvalidPayload) as refused:
        _bulk(client, how, inputs)
    assert "5017" in str(refused.value)


# -- pagination ----------------------------------------------------------------------------

PAGED = 5_000


@workflow(name="sla_other_wf")
def sla_other_wf(value: Ref[Any]) -> NodeRef[Any]:
    ref: NodeRef[Any] = sla_take(value)
    return ref


def test_sla_list_runs_pages_over_5000_runs_each_exactly_once_while_runs_arrive(
    client: Client,
) -> None:
    first: list[int] = []
    others: list[int] = []
    for chunk in range(10):  # another workflow's runs interleaved with ours
        first += [h.id for h in client.submit_many(sla_take_wf, [chunk] * (PAGED // 10))]
        others += [h.id for h in client.submit_many(sla_other_wf, [chunk] * 70)]
    seen: list[int] = []
    before: int | None = None
    while True:
        page = client.list_runs(workflow="sla_take_wf", limit=333, before_id=before)
        seen.extend(run.id for run in page)
        assert {run.workflow for run in page} <= {"sla_take_wf"}
        # runs submitted while we page have newer ids: never on a later page
        client.submit_many(sla_take_wf, [-1, -2])
        if len(page) < 333:
            break
        before = page[-1].id
    assert seen == sorted(first, reverse=True)
    everything = [run.id for run in _all_runs(client, page=777)]
    assert everything == sorted(everything, reverse=True)
    assert len(everything) == len(set(everything))
    assert set(everything) >= set(first) | set(others)


def test_sla_list_runs_refuses_a_page_over_its_documented_maximum(client: Client) -> None:
    client.submit_many(sla_take_wf, list(range(3)))
    assert len(client.list_runs(limit=10_000)) == 3
    with pytest.raises(InvalidArgument):
        client.list_runs(limit=10_001)


EVENTS = 1_500


@step(name="sla_chatty", max_attempts=1)
def sla_chatty(n: int, ctx: StepContext) -> int:
    for i in range(n):
        ctx.progress(i + 1, n, f"item {i}")
    return n


@workflow(name="sla_chatty_wf")
def sla_chatty_wf(n: Ref[int]) -> NodeRef[int]:
    return sla_chatty(n)


def test_sla_events_of_pages_over_1500_events_each_exactly_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_chatty)
    handle = client.submit(sla_chatty_wf, EVENTS)
    followed = [e.seq for e in handle.events(timeout=60)]
    assert followed == list(range(1, EVENTS + 1))
    assert handle.result(timeout=30) == EVENTS
    seen: list[Any] = []
    after = 0
    while True:
        page = client.events_of(handle.id, after=after, limit=317)
        seen.extend(page)
        if not page:
            break
        after = page[-1].seq
    assert [e.seq for e in seen] == list(range(1, EVENTS + 1))
    assert [e.data for e in seen] == [
        {"done": i + 1, "total": EVENTS, "message": f"item {i}"} for i in range(EVENTS)
    ]
    assert not any(e.fenced for e in seen)


@step(name="sla_over_cap", max_attempts=1)
def sla_over_cap(n: int, ctx: StepContext) -> str:
    for i in range(n):
        ctx.emit(i)
    try:
        ctx.emit("one too many")
    except EventLimitExceeded as full:
        return f"refused at {full.cap}"
    return "stored"


@workflow(name="sla_over_cap_wf")
def sla_over_cap_wf(n: Ref[int]) -> NodeRef[str]:
    return sla_over_cap(n)


def test_sla_a_step_stores_exactly_its_event_cap_then_refuses(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_over_cap, max_events_per_step=300)
    handle = client.submit(sla_over_cap_wf, 300)
    assert handle.result(timeout=30) == "refused at 300"
    assert [e.data for e in client.events_of(handle.id, limit=1_000)] == list(range(300))


# -- fan-out over child runs, bulk submits of waiting runs -----------------------------------


@workflow(name="sla_kid")
def sla_kid(x: Ref[int]) -> NodeRef[int]:
    return sla_double(x)


@workflow(name="sla_kids")
def sla_kids(n: Ref[int]) -> NodeRef[list[Any]]:
    return for_each(sla_kid, over=sla_range(n), max_parallel=25)


def test_sla_for_each_over_300_child_runs_collects_their_results_in_item_order(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sla_range, sla_double, sla_kid, sla_kids, concurrency=8)
    handle = client.submit(sla_kids, 300)
    assert handle.result(timeout=150) == [2 * i for i in range(300)]
    kids = client.list_runs(parent_run_id=handle.id, limit=1_000)
    assert len(kids) == 300
    assert {kid.state for kid in kids} == {RunState.COMPLETED}


def test_sla_submit_many_of_2000_waiting_runs_activates_every_wait(client: Client) -> None:
    # 2,000, not 10,000: the activation takes two statements per waiting root
    # (signals.consume_buffered_on_activation), about 13 s for 10,000 runs in one call.
    handles = client.submit_many(sla_await_payload, [None] * WAITING)
    assert len({h.id for h in handles}) == WAITING
    middle, last = handles[WAITING // 2], handles[-1]
    assert client.signal(middle.id, "sla_payload", "m") is Delivery.CONSUMED
    assert client.signal(last.id, "sla_payload", "l") is Delivery.CONSUMED
    assert middle.result(timeout=30) == "m"
    assert last.result(timeout=30) == "l"
    assert client.run_counts() == {"running": WAITING - 2, "completed": 2}
