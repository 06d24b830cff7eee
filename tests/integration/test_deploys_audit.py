"""Audit: an old and a new deploy of one workflow share one database (docs/howto/versioning.md).

Each deploy is a Registry of its own, as in test_versions.py. A run is pinned to the
def_version it was submitted with; what the old run does next must follow the old deploy's
definition, and what no live worker can run must be visible.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    Delivery,
    InvalidTransition,
    Registry,
    RunState,
    StepState,
    Worker,
    child,
    for_each,
    step,
    wait_n,
    wait_signal,
    wait_timer,
)
from cyclone_dsl.dsl.workflow import WorkflowDef
from tests.waiting import wait_until


def deploy(*definitions: WorkflowDef) -> Registry:
    """One deploy's registry: these definitions and their child workflows."""
    registry = Registry()
    for definition in definitions:
        registry.add_workflow_tree(definition)
    return registry


def unserved_of(c: Client) -> list[tuple[str, str, str]]:
    return [(u["workflow"], u["def_version"], u["kind"]) for u in c.stats()["unserved"]]


# -- a child workflow that changed between the deploys ----------------------------------------


@step(name="da_kid_old")
def kid_old(x: int) -> int:
    return x + 1


@step(name="da_kid_new")
def kid_new(x: int) -> dict[str, int]:
    return {"new": x}


@step(name="da_use_old")
def use_old(x: int) -> str:
    return f"old {x + 0}"  # the old deploy's child returns an int


@step(name="da_use_new")
def use_new(x: dict[str, int]) -> str:
    return f"new {x['new']}"


@step(name="da_same")
def same(x: int) -> int:
    return x * 10


@step(name="da_list")
def make_list(n: int) -> list[int]:
    return list(range(n))


@step(name="da_sum_old")
def sum_old(xs: list[int]) -> int:
    return sum(x + 0 for x in xs)


@step(name="da_sum_new")
def sum_new(xs: list[dict[str, int]]) -> int:
    return sum(x["new"] for x in xs)


def _kid_v1(x):  # type: ignore[no-untyped-def]
    return kid_old(x)


def _kid_v2(x):  # type: ignore[no-untyped-def]
    return kid_new(x)


def _first(x):  # type: ignore[no-untyped-def]
    return same(x)


def _lists(n):  # type: ignore[no-untyped-def]
    return make_list(n)


KID_V1 = WorkflowDef(_kid_v1, "da_kid")
KID_V2 = WorkflowDef(_kid_v2, "da_kid")
FIRST = WorkflowDef(_first, "da_first")  # the same in both deploys
LISTS = WorkflowDef(_lists, "da_lists")  # the same in both deploys


def _sig_v1(x):  # type: ignore[no-untyped-def]
    return use_old(child(KID_V1, wait_signal("go")))


def _sig_v2(x):  # type: ignore[no-untyped-def]
    return use_new(child(KID_V2, wait_signal("go")))


def _chain_v1(x):  # type: ignore[no-untyped-def]
    return use_old(child(KID_V1, child(FIRST, x)))


def _chain_v2(x):  # type: ignore[no-untyped-def]
    return use_new(child(KID_V2, child(FIRST, x)))


def _fan_v1(n):  # type: ignore[no-untyped-def]
    return sum_old(for_each(KID_V1, over=child(LISTS, n)))


def _fan_v2(n):  # type: ignore[no-untyped-def]
    return sum_new(for_each(KID_V2, over=child(LISTS, n)))


def _timer_v1(x):  # type: ignore[no-untyped-def]
    return use_old(child(KID_V1, x, after=wait_timer(0.2)))


def _timer_v2(x):  # type: ignore[no-untyped-def]
    return use_new(child(KID_V2, x, after=wait_timer(0.2)))


SIG_V1, SIG_V2 = WorkflowDef(_sig_v1, "da_sig"), WorkflowDef(_sig_v2, "da_sig")
CHAIN_V1, CHAIN_V2 = WorkflowDef(_chain_v1, "da_chain"), WorkflowDef(_chain_v2, "da_chain")
FAN_V1, FAN_V2 = WorkflowDef(_fan_v1, "da_fan"), WorkflowDef(_fan_v2, "da_fan")
TIMER_V1, TIMER_V2 = WorkflowDef(_timer_v1, "da_timer"), WorkflowDef(_timer_v2, "da_timer")


def kid_versions(c: Client, run_id: int) -> list[str]:
    """The def_version of each child run of workflow da_kid under ``run_id``."""
    return [
        c.get_run(k["id"]).def_version for k in c.children_of(run_id) if k["workflow"] == "da_kid"
    ]


def test_the_old_and_new_definitions_differ_where_the_tests_need_them_to() -> None:
    for old, new in ((SIG_V1, SIG_V2), (CHAIN_V1, CHAIN_V2), (FAN_V1, FAN_V2)):
        assert old.def_version != new.def_version
    assert KID_V1.def_version != KID_V2.def_version
    assert FIRST.def_version == WorkflowDef(_first, "da_first").def_version


def test_a_signal_from_the_new_client_starts_the_old_runs_child_with_the_old_definition(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(SIG_V1), deploy(SIG_V2)
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        handle = old_client.submit("da_sig", 0)
        start_worker(registry=old_registry, name="da-old")
        start_worker(registry=new_registry, name="da-new")
        assert new_client.signal(handle.id, "go", 5) == Delivery.CONSUMED
        versions = wait_until(lambda: kid_versions(old_client, handle.id), what="the child run")
        assert versions == [KID_V1.def_version]
        assert handle.result(timeout=10) == "old 6"


def test_a_resume_from_the_new_client_starts_the_old_runs_child_with_the_old_definition(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(SIG_V1), deploy(SIG_V2)
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        handle = old_client.submit("da_sig", 0)
        old_client.pause(handle.id)
        old_client.signal(handle.id, "go", 5)  # the child node waits for the resume
        assert old_client.children_of(handle.id) == []
        start_worker(registry=old_registry, name="da-old")
        start_worker(registry=new_registry, name="da-new")
        new_client.resume(handle.id)
        versions = wait_until(lambda: kid_versions(old_client, handle.id), what="the child run")
        assert versions == [KID_V1.def_version]
        assert handle.result(timeout=10) == "old 6"


def test_a_new_worker_settling_a_child_starts_the_old_runs_next_child_with_the_old_definition(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(CHAIN_V1), deploy(CHAIN_V2)
    with Client(cyclone_dsn, registry=old_registry) as old_client:
        handle = old_client.submit("da_chain", 2)
        (first,) = old_client.children_of(handle.id)
        start_worker(registry=new_registry, name="da-new")  # serves da_first, the same in both
        assert old_client.result(first["id"], timeout=10) == 20
        start_worker(registry=old_registry, name="da-old")
        versions = wait_until(lambda: kid_versions(old_client, handle.id), what="the 2nd child")
        assert versions == [KID_V1.def_version]
        assert handle.result(timeout=10) == "old 21"


def test_a_new_worker_fanning_out_an_old_run_starts_its_items_with_the_old_definition(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(FAN_V1), deploy(FAN_V2)
    with Client(cyclone_dsn, registry=old_registry) as old_client:
        handle = old_client.submit("da_fan", 2)
        (lists,) = old_client.children_of(handle.id)
        start_worker(registry=new_registry, name="da-new")  # serves da_lists, the same in both
        assert old_client.result(lists["id"], timeout=10) == [0, 1]
        start_worker(registry=old_registry, name="da-old")

        def both_items() -> list[str]:
            found = kid_versions(old_client, handle.id)
            return found if len(found) == 2 else []

        versions = wait_until(both_items, what="the item child runs")
        assert versions == [KID_V1.def_version] * 2
        assert handle.result(timeout=10) == 3


def test_a_new_workers_timer_scan_starts_the_old_runs_child_with_the_old_definition(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(TIMER_V1), deploy(TIMER_V2)
    with Client(cyclone_dsn, registry=old_registry) as old_client:
        handle = old_client.submit("da_timer", 3)
        start_worker(registry=new_registry, name="da-new")  # its scanner fires the timer

        def timer_done() -> bool:
            return handle.get().step("timer").state == StepState.COMPLETED

        wait_until(timer_done, timeout=10, what="the timer fired")
        start_worker(registry=old_registry, name="da-old")
        versions = wait_until(lambda: kid_versions(old_client, handle.id), what="the child run")
        assert versions == [KID_V1.def_version]
        assert handle.result(timeout=10) == "old 4"


# -- a child that only the old deploy defines, left for a worker that has it ------------------


def _gone_kid(x):  # type: ignore[no-untyped-def]
    return kid_old(x)


GONE_KID = WorkflowDef(_gone_kid, "da_gone_kid")  # the new deploy dropped it


def _defer_v1(x):  # type: ignore[no-untyped-def]
    return child(GONE_KID, wait_signal("go"))


def _defer_v2(x):  # type: ignore[no-untyped-def]
    return kid_new(wait_signal("go"))


DEFER_V1, DEFER_V2 = WorkflowDef(_defer_v1, "da_defer"), WorkflowDef(_defer_v2, "da_defer")


def test_a_child_the_new_deploy_does_not_define_is_started_by_an_old_worker(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(DEFER_V1), deploy(DEFER_V2)
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        handle = old_client.submit("da_defer", 0)
        start_worker(registry=new_registry, name="da-new")
        assert new_client.signal(handle.id, "go", 4) == Delivery.CONSUMED
        assert handle.get().step("da_gone_kid").state == StepState.WAITING_CHILD
        start_worker(registry=old_registry, name="da-old")
        assert handle.result(timeout=10) == 5


def test_a_child_waiting_for_a_worker_no_live_worker_can_be_is_shown_as_unserved(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(DEFER_V1), deploy(DEFER_V2)
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        handle = old_client.submit("da_defer", 0)
        worker = start_worker(registry=new_registry, name="da-new")
        new_client.signal(handle.id, "go", 4)
        assert handle.get().step("da_gone_kid").state == StepState.WAITING_CHILD
        shown = [
            u
            for u in new_client.stats()["unserved"]
            if u["workflow"] == "da_defer" and u["def_version"] == DEFER_V1.def_version
        ]
        reported = [r for r in worker.report_unserved() if r["workflow"] == "da_defer"]
        assert shown, "stats()['unserved'] says nothing of the old run's waiting child"
        assert reported, "the worker's unserved report says nothing of it either"


# -- signals and quorums across deploys ------------------------------------------------------


@step(name="da_votes_old")
def votes_old(xs: list[int]) -> int:
    return sum(xs)


@step(name="da_votes_new")
def votes_new(xs: list[int]) -> int:
    return max(xs)


def _quorum_v1(x):  # type: ignore[no-untyped-def]
    return votes_old(wait_n("vote", 2))


def _quorum_v2(x):  # type: ignore[no-untyped-def]
    return votes_new(wait_n("vote", 2))


QUORUM_V1 = WorkflowDef(_quorum_v1, "da_quorum")
QUORUM_V2 = WorkflowDef(_quorum_v2, "da_quorum")


def test_a_quorum_of_an_old_run_filled_by_both_clients_waits_for_an_old_worker(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(QUORUM_V1), deploy(QUORUM_V2)
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        old = old_client.submit("da_quorum", 0)
        new = new_client.submit("da_quorum", 0)
        start_worker(registry=new_registry, name="da-new")
        assert new_client.signal(old.id, "vote", 3) == Delivery.CONSUMED
        assert old_client.signal(old.id, "vote", 4) == Delivery.CONSUMED
        new_client.signal(new.id, "vote", 3)
        old_client.signal(new.id, "vote", 4)
        assert new.result(timeout=10) == 4  # the new definition: max
        # The old run's next step is left alone, and shown as unserved.
        assert (old.get().step("da_votes_old").state, old.get().step("da_votes_old").attempt) == (
            StepState.AVAILABLE,
            0,
        )
        assert unserved_of(new_client) == [("da_quorum", QUORUM_V1.def_version, "da_votes_old")]
        start_worker(registry=old_registry, name="da-old")
        assert old.result(timeout=10) == 7  # the old definition: sum
        assert unserved_of(new_client) == []


# -- submit_once, submit_many, fork and replay across deploys --------------------------------


@step(name="da_once")
def once_step(x: int) -> int:
    return x


@step(name="da_once_neg")
def once_neg(x: int) -> int:
    return -x


def _once_v1(x):  # type: ignore[no-untyped-def]
    return once_step(x)


def _once_v2(x):  # type: ignore[no-untyped-def]
    return once_neg(once_step(x))


ONCE_V1, ONCE_V2 = WorkflowDef(_once_v1, "da_once_wf"), WorkflowDef(_once_v2, "da_once_wf")


def test_submit_once_and_submit_many_from_both_deploys_keep_each_runs_definition(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(ONCE_V1), deploy(ONCE_V2)
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        first = old_client.submit_once("da_once_wf", 1, key="da-k")
        again = new_client.submit_once("da_once_wf", 2, key="da-k")
        assert (first.created, again.created, again.id) == (True, False, first.id)
        assert again.get().def_version == ONCE_V1.def_version
        olds = old_client.submit_many("da_once_wf", [1, 2])
        news = new_client.submit_many("da_once_wf", [3, 4])
        start_worker(registry=new_registry, name="da-new")
        assert [h.result(timeout=10) for h in news] == [-3, -4]
        assert {h.get().state for h in [first, *olds]} == {RunState.RUNNING}
        start_worker(registry=old_registry, name="da-old")
        assert [h.result(timeout=10) for h in [first, *olds]] == [1, 1, 2]


def test_fork_and_replay_of_an_old_run_from_the_new_deploy(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(ONCE_V1), deploy(ONCE_V2)
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        old = old_client.submit("da_once_wf", 5)
        old_worker = start_worker(registry=old_registry, name="da-old")
        assert old.result(timeout=10) == 5
        with pytest.raises(InvalidTransition, match="current_definition=True"):
            new_client.fork(old.id, "da_once")
        start_worker(registry=new_registry, name="da-new")
        forked = new_client.fork(old.id, "da_once_neg", current_definition=True)
        assert forked.get().def_version == ONCE_V2.def_version
        assert forked.result(timeout=10) == -5
        old_worker.stop()
        new_client.retry(old.id, "da_once", force=True)  # a replay keeps the old definition
        assert old.get().def_version == ONCE_V1.def_version
        wait_until(
            lambda: unserved_of(new_client) == [("da_once_wf", ONCE_V1.def_version, "da_once")],
            timeout=5,
            what="the replayed old step shown as unserved",
        )
        assert old.get().step("da_once").state == StepState.AVAILABLE
        start_worker(registry=old_registry, name="da-old-2")
        assert old.result(timeout=10) == 5


# -- a workflow limit shared by both deploys' runs --------------------------------------------


@step(name="da_lim_a")
def lim_a(x: int) -> int:
    return x + 1


@step(name="da_lim_b")
def lim_b(x: int) -> int:
    return x * 2


def _lim_v1(x):  # type: ignore[no-untyped-def]
    return lim_a(x)


def _lim_v2(x):  # type: ignore[no-untyped-def]
    return lim_b(lim_a(x))


LIM_V1 = WorkflowDef(_lim_v1, "da_lim", concurrency=Concurrency(limit=1))
LIM_V2 = WorkflowDef(_lim_v2, "da_lim", concurrency=Concurrency(limit=1))


def test_old_runs_queued_under_a_shared_limit_do_not_block_the_new_deploys_runs(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(LIM_V1), deploy(LIM_V2)
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        olds = [old_client.submit("da_lim", i) for i in range(2)]
        new = new_client.submit("da_lim", 5)
        start_worker(registry=new_registry, name="da-new")
        assert new.result(timeout=10) == 12
        assert unserved_of(new_client) == [("da_lim", LIM_V1.def_version, "da_lim_a")]
        start_worker(registry=old_registry, name="da-old")
        assert [h.result(timeout=10) for h in olds] == [1, 2]
