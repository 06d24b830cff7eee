"""Audit: the rows Cyclone writes, against the schema reference.

``check_invariants(dsn)`` reads cyclone_runs, cyclone_steps, cyclone_deps,
cyclone_step_inputs, cyclone_signals, the views and the extension tables with plain SQL,
in one REPEATABLE READ snapshot (every transition commits atomically:
docs/guarantees.md "Atomic transitions"), and asserts every invariant the canonical
schema reference (shared/spec/000_d78c004f99eb4be2.txt, cited as ``spec:LINE``) and the
docs (``schema.md``, ``runs-and-steps.md``, ``waits.md``, ``fan-out-and-children.md``,
``workflows.md``) state or clearly imply. The workloads below drive the public API with
real workers and call it after each run settles and, from a thread, while runs are in
flight (only invariants that hold at every commit are in it).

Tests marked ``xfail(strict=True)`` show a finding: they fail today and pass once fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg.rows import dict_row

from cyclone_dsl import (
    Client,
    RunFailed,
    RunState,
    StepContext,
    Worker,
    action,
    child,
    for_each,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.testing import set_clock_shift
from tests.waiting import wait_until

# -- the invariants ---------------------------------------------------------------------------

RUN_STATES = {"running", "paused", "completed", "failed", "cancelled"}  # spec:24
TERMINAL_RUNS = {"completed", "failed", "cancelled"}
STEP_STATES = {  # spec:46
    "pending",
    "available",
    "running",
    "waiting_signal",
    "waiting_timer",
    "waiting_child",
    "paused",
    "completed",
    "discarded",
    "cancelled",
}
TERMINAL_STEPS = {"completed", "discarded", "cancelled"}  # runs-and-steps.md:174-176
ACTIVE_STEPS = STEP_STATES - TERMINAL_STEPS
#: The outcomes of a failed execution in the attempt history (schema.md:112, ext 2).
FAILED_OUTCOMES = {"failed", "retried", "timeout"}
ATTEMPT_OUTCOMES = {
    "failed",
    "retried",
    "timeout",
    "reclaimed",
    "released",
    "replayed",
    "cancelled",
}


def _rows(cur: psycopg.Cursor[dict[str, Any]], sql: str) -> list[dict[str, Any]]:
    cur.execute(sql)  # type: ignore[arg-type]
    return cur.fetchall()


def check_invariants(
    dsn: str,
    *,
    actions: frozenset[str] | None = None,
    max_reclaims: int = 3,
) -> None:
    """Assert every invariant of the stored rows; ``actions``: the kinds registered as
    ``@action`` (their output is not kept); ``max_reclaims``: the workers' default."""
    actions = ACTION_KINDS if actions is None else actions
    problems: list[str] = []

    def bad(cond: bool, what: str) -> None:
        if not cond:
            problems.append(what)

    with psycopg.connect(dsn, row_factory=dict_row, autocommit=False) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        with conn.cursor() as cur:
            now = _rows(cur, "SELECT now() AS now")[0]["now"]
            runs = {r["id"]: r for r in _rows(cur, "SELECT * FROM cyclone_runs")}
            steps = _rows(cur, "SELECT * FROM cyclone_steps ORDER BY id")
            deps = _rows(cur, "SELECT * FROM cyclone_deps")
            inputs = _rows(cur, "SELECT * FROM cyclone_step_inputs")
            signals = _rows(cur, "SELECT * FROM cyclone_signals ORDER BY id")
            v_runs = {r["id"]: r for r in _rows(cur, "SELECT * FROM cyclone_v_runs")}
            v_steps = {r["id"]: r for r in _rows(cur, "SELECT * FROM cyclone_v_steps")}
            v_kinds = _rows(cur, "SELECT * FROM cyclone_v_kinds")
            v_queues = _rows(cur, "SELECT * FROM cyclone_v_queues")
            attempts = _rows(cur, "SELECT * FROM cyclone_ext_attempts ORDER BY id")
            forks = _rows(cur, "SELECT * FROM cyclone_ext_forks")
            limits = _rows(cur, "SELECT * FROM cyclone_ext_fan_out_limits")
            events = _rows(cur, "SELECT * FROM cyclone_ext_events")
            seqs = _rows(cur, "SELECT * FROM cyclone_ext_event_seqs")
            counts = _rows(cur, "SELECT * FROM cyclone_ext_event_counts")
            gates = _rows(cur, "SELECT * FROM cyclone_ext_gates")
        conn.rollback()

    by_run: dict[int, dict[str, dict[str, Any]]] = {}
    by_id: dict[int, dict[str, Any]] = {}
    for s in steps:
        by_run.setdefault(s["run_id"], {})[s["node"]] = s
        by_id[s["id"]] = s
    deps_of: dict[tuple[int, str], list[dict[str, Any]]] = {}
    dependents: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for d in deps:
        deps_of.setdefault((d["run_id"], d["node"]), []).append(d)
        dependents.setdefault((d["run_id"], d["dep_node"]), []).append(d)
    children: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in runs.values():
        children.setdefault((r["parent_run_id"], r["parent_node_id"]), []).append(r)

    # ---- cyclone_runs -------------------------------------------------------------------
    for rid, r in runs.items():
        tag = f"run {rid} ({r['workflow']}, {r['state']})"
        rsteps = by_run.get(rid, {})
        bad(r["state"] in RUN_STATES, f"{tag}: unknown state")  # spec:24
        # spec:26 finished_at is the terminal timestamp; runs-and-steps.md:350 a reopened
        # run is "running, no finished_at".
        if r["state"] in TERMINAL_RUNS:
            bad(r["finished_at"] is not None, f"{tag}: terminal without finished_at")
        else:
            bad(r["finished_at"] is None, f"{tag}: not terminal but has finished_at")
        # spec:31 paused_at is set while the run is paused; resume clears it.
        if r["state"] == "paused":
            bad(r["paused_at"] is not None, f"{tag}: paused without paused_at")
        if r["state"] == "running":
            bad(r["paused_at"] is None, f"{tag}: running with paused_at {r['paused_at']}")
        bad(r["updated_at"] >= r["created_at"], f"{tag}: updated_at before created_at")
        if r["finished_at"] is not None:
            bad(r["finished_at"] >= r["created_at"], f"{tag}: finished before created")
        # runs-and-steps.md:179-181 a run is running (or paused) until every step is
        # terminal; waits.md "Cancel": every non-terminal step cancelled; "Deadlines":
        # the scanner cancels what is left.
        if r["state"] in TERMINAL_RUNS:
            left = sorted(
                f"{n}={s['state']}" for n, s in rsteps.items() if s["state"] in ACTIVE_STEPS
            )
            bad(not left, f"{tag}: terminal run has non-terminal steps {left}")
        # waits.md "Pause and resume": a paused run's available and pending steps are
        # paused, newly ready ones too; resume makes them ready (or pending) again.
        if r["state"] == "paused":
            avail = sorted(n for n, s in rsteps.items() if s["state"] == "available")
            bad(not avail, f"{tag}: paused run has available steps {avail}")
        if r["state"] == "running":
            held = sorted(n for n, s in rsteps.items() if s["state"] == "paused")
            bad(not held, f"{tag}: running (not paused) run has paused steps {held}")
        # runs-and-steps.md:179-181 + workflows.md "The result": a completed run's steps
        # all completed, except a failure contained by cancel_branch (runs-and-steps.md
        # "retrying failed work": a discarded node whose dependents are all cancel_branch).
        if r["state"] == "completed":
            for n, s in rsteps.items():
                if s["state"] == "discarded":
                    outs = dependents.get((rid, n), [])
                    contained = all(
                        rsteps[d["node"]]["on_dep_failure"] == "cancel_branch" for d in outs
                    )
                    bad(
                        bool(outs) and contained and s["item_of"] is None,
                        f"{tag}: completed run with an uncontained discarded step {n}",
                    )
        # spec:28 result_node names the node whose output is the run result.
        if r["result_node"] is not None:
            res = rsteps.get(r["result_node"])
            bad(res is not None, f"{tag}: result_node {r['result_node']} is not a step")
            if res is not None and r["state"] == "completed":
                # workflows.md "The result": completed, or cancelled when a contained
                # failure cut it off.
                bad(
                    res["state"] in ("completed", "cancelled"),
                    f"{tag}: result node {r['result_node']} is {res['state']}",
                )
        # spec:30 has_fan_out: the run has a fan-out node (fan_out_parallel set, spec:67).
        has = any(s["fan_out_parallel"] is not None for s in rsteps.values())
        bad(r["has_fan_out"] == has, f"{tag}: has_fan_out={r['has_fan_out']} but fan-out={has}")
        # spec:32 parent link: both columns or neither.
        bad(
            (r["parent_run_id"] is None) == (r["parent_node_id"] is None),
            f"{tag}: half a parent link",
        )
        if r["parent_run_id"] is not None:
            # waits.md "Deadlines": a child run has no deadline of its own.
            bad(r["deadline_at"] is None, f"{tag}: child run with a deadline_at")
            parent = runs.get(r["parent_run_id"])
            if parent is None:
                # spec:32/38: a purge can delete the parent first, only of an ended run.
                bad(r["state"] in TERMINAL_RUNS, f"{tag}: live child run of a purged parent")
            else:
                node = by_run.get(parent["id"], {}).get(r["parent_node_id"])
                bad(node is not None, f"{tag}: parent node {r['parent_node_id']} missing")
                if node is not None:
                    # spec:70 a child node's kind is @child, child_workflow its workflow.
                    bad(node["kind"] == "@child", f"{tag}: parent node kind {node['kind']}")
                    bad(
                        node["child_workflow"] == r["workflow"],
                        f"{tag}: parent node starts {node['child_workflow']}",
                    )
                # fan-out-and-children.md: cancel/failure of a parent reaches down.
                if parent["state"] in ("failed", "cancelled"):
                    bad(r["state"] in TERMINAL_RUNS, f"{tag}: open child of an ended parent")
                if parent["state"] == "completed":
                    bad(r["state"] in TERMINAL_RUNS, f"{tag}: open child of a completed parent")
                # fan-out-and-children.md "Pause reaches down too".
                if parent["state"] == "paused" and r["state"] == "running":
                    problems.append(f"{tag}: running child of paused parent {parent['id']}")

    # ---- cyclone_steps ------------------------------------------------------------------
    for s in steps:
        rid, n = s["run_id"], s["node"]
        run = runs.get(rid)
        tag = f"run {rid} step {n} ({s['kind']}, {s['state']})"
        bad(run is not None, f"{tag}: no run")  # spec:44 FK
        bad(s["state"] in STEP_STATES, f"{tag}: unknown state")  # spec:46
        # spec:51 attempt counts failed executions; runs-and-steps.md "Retries": retried
        # while attempt < max_attempts, else discarded. Migration 13: max_attempts >= 1.
        bad(s["max_attempts"] >= 1, f"{tag}: max_attempts {s['max_attempts']}")
        bad(
            0 <= s["attempt"] <= s["max_attempts"],
            f"{tag}: attempt {s['attempt']} of {s['max_attempts']}",
        )
        if s["state"] in ("available", "running", "paused", "pending"):
            bad(s["attempt"] < s["max_attempts"], f"{tag}: no attempt left but still active")
        # spec:66 reclaims bounded by max_reclaims; runs-and-steps.md "Reclaim": past it the
        # step is discarded with reclaim_limit (the reclaim that hit the bound counted).
        cap = max_reclaims + (1 if s["error_kind"] == "reclaim_limit" else 0)
        bad(0 <= s["reclaims"] <= cap, f"{tag}: reclaims {s['reclaims']}")
        # spec:63-65, runs-and-steps.md "Claims and leases", schema.md:11-17: a running step
        # holds a lease (owner, expiry, generation >= 1); every lease's end clears expiry.
        if s["state"] == "running":
            bad(s["lease_owner"] is not None, f"{tag}: running without lease_owner")
            bad(s["lease_expiry"] is not None, f"{tag}: running without lease_expiry")
            bad(s["lease_generation"] >= 1, f"{tag}: running at generation 0")
            bad(s["started_at"] is not None, f"{tag}: running without started_at")
        else:
            bad(s["lease_expiry"] is None, f"{tag}: holds lease_expiry {s['lease_expiry']}")
        if s["state"] in ("available", "pending", "paused", "waiting_signal", "waiting_timer"):
            # schema.md:11-14 only a completed step keeps lease_owner (its completer).
            bad(s["lease_owner"] is None, f"{tag}: lease_owner {s['lease_owner']}")
        # spec:75 completed_at: the completion timestamp.
        if s["state"] == "completed":
            bad(s["completed_at"] is not None, f"{tag}: completed without completed_at")
        if s["state"] in ACTIVE_STEPS:
            bad(s["completed_at"] is None, f"{tag}: active with completed_at")
        # spec:72 error/error_kind: the last failure and its classification.
        if s["state"] == "discarded":
            bad(s["error_kind"] is not None, f"{tag}: discarded without error_kind")
        # spec:49 queue capped at 256 bytes.
        bad(len(s["queue"].encode()) <= 256, f"{tag}: queue over 256 bytes")
        # spec:55-58, 70-71: wait/child columns match the kind.
        if s["state"] == "waiting_signal":
            bad(s["kind"] == "@signal", f"{tag}: waiting_signal of a non-signal")
        if s["state"] == "waiting_timer":
            bad(s["kind"] == "@timer", f"{tag}: waiting_timer of a non-timer")
        if s["state"] == "waiting_child":
            bad(s["kind"] == "@child", f"{tag}: waiting_child of a non-child")
        if s["kind"] == "@signal":
            bad(
                (s["signal_name"] is not None) != (s["signal_names"] is not None),
                f"{tag}: signal_name {s['signal_name']} / signal_names {s['signal_names']}",
            )
        is_child = s["kind"] == "@child"
        bad(
            (s["child_workflow"] is not None) == is_child,
            f"{tag}: child_workflow {s['child_workflow']}",
        )
        bad(
            (s["child_needs_result"] is not None) == is_child,
            f"{tag}: child_needs_result {s['child_needs_result']}",
        )
        # spec:69,77 item tasks: both columns, node = fan-out node + [index], the fan-out
        # node a step of the same run with fan_out_parallel set (spec:67).
        bad(
            (s["item_of"] is None) == (s["item_index"] is None),
            f"{tag}: item_of {s['item_of']} item_index {s['item_index']}",
        )
        if s["item_of"] is not None:
            bad(s["item_index"] >= 0, f"{tag}: negative item_index")
            bad(n == f"{s['item_of']}[{s['item_index']}]", f"{tag}: item node id")
            fan = by_run.get(rid, {}).get(s["item_of"])
            bad(
                fan is not None and fan["fan_out_parallel"] is not None,
                f"{tag}: item of {s['item_of']}, not a fan-out node of its run",
            )
            if fan is not None:
                bad(fan["kind"] == s["kind"], f"{tag}: item kind differs from {fan['kind']}")
                # fan-out-and-children.md: the fan-out node completes when every item
                # completed; a failure fails it and cancels what is open.
                if fan["state"] == "completed":
                    bad(s["state"] == "completed", f"{tag}: item of a completed fan-out")
                if fan["state"] in TERMINAL_STEPS:
                    bad(s["state"] in TERMINAL_STEPS, f"{tag}: open item of ended fan-out")
        if s["fan_out_parallel"] is not None:
            bad(s["fan_out_parallel"] >= 0, f"{tag}: fan_out_parallel < 0")
            bad(s["item_of"] is None, f"{tag}: a fan-out item that is a fan-out")
        # spec:68 fan_out_max_bytes set on the fan-out node of a step only.
        if s["fan_out_max_bytes"] is not None:
            bad(s["fan_out_parallel"] is not None, f"{tag}: max_bytes off a fan-out")
        if s["fan_out_parallel"] is not None and s["kind"] in actions:
            bad(s["fan_out_max_bytes"] is None, f"{tag}: action fan-out with max_bytes")
        # A wait/timer/child is never claimed (runs-and-steps.md states diagram).
        if s["kind"].startswith("@"):
            bad(
                s["state"] not in ("available", "running"),
                f"{tag}: a {s['kind']} node in a handler state",
            )

        # ---- dependencies (spec:82-95, runs-and-steps.md states) ----
        ups = deps_of.get((rid, n), [])
        for d in ups:
            up = by_run.get(rid, {}).get(d["dep_node"])
            bad(up is not None, f"{tag}: dep on {d['dep_node']}, not a step of run {rid}")
            # pending --> available: all dependencies completed; so every state past
            # pending (but a cancelled/discarded end) has all its upstreams completed.
            if up is not None and s["state"] in (
                "available",
                "running",
                "waiting_signal",
                "waiting_timer",
                "waiting_child",
                "completed",
            ):
                bad(
                    up["state"] == "completed",
                    f"{tag}: past pending while upstream {d['dep_node']} is {up['state']}",
                )
        # guarantees.md "Atomic transitions": a completion commits with its activations,
        # so a pending node whose upstreams all completed is not left in a running run.
        if (
            run is not None
            and run["state"] == "running"
            and s["state"] == "pending"
            and s["item_of"] is None
            and s["fan_out_parallel"] is None
            and not s["kind"].startswith("@")
        ):
            ready = all(by_run[rid].get(d["dep_node"], {}).get("state") == "completed" for d in ups)
            bad(not ready, f"{tag}: pending although every upstream completed")
        if s["input_from"] is not None:
            bad(
                any(d["dep_node"] == s["input_from"] for d in ups),
                f"{tag}: input_from {s['input_from']} without a dep edge",
            )

        # ---- outputs (workflows.md "Steps and actions", fan-out-and-children.md) ----
        if s["state"] == "completed" and s["error_kind"] != "skipped":
            out = s["output"]
            kept: bool | None
            if s["kind"] in actions:
                kept = False  # @action: not kept (stored as NULL)
            elif s["kind"] == "@timer":
                kept = None  # no handler, NodeRef[None]: either representation
            elif s["kind"] == "@child":
                kept = bool(s["child_needs_result"])
            else:
                kept = True  # @step (a fan-out of a step collects a list), @signal
            if kept is True:
                bad(out is not None, f"{tag}: completed without the output its kind keeps")
            elif kept is False:
                bad(out is None, f"{tag}: completed with output {out!r}, its kind keeps none")
            if s["fan_out_parallel"] is not None and out is not None:
                items = sorted(
                    (i for i in by_run[rid].values() if i["item_of"] == n),
                    key=lambda i: i["item_index"],
                )
                bad(
                    isinstance(out, list) and out == [i["output"] for i in items],
                    f"{tag}: fan-out output {out!r} is not its items' outputs in order",
                )
                bad(
                    [i["item_index"] for i in items] == list(range(len(items))),
                    f"{tag}: item indexes {[i['item_index'] for i in items]}",
                )
            if s["kind"] == "@signal" and s["wait_count"] is not None:
                # waits.md: wait_n's output is the list of its n payloads.
                bad(
                    isinstance(out, list) and len(out) == s["wait_count"],
                    f"{tag}: wait_n output {out!r} for n={s['wait_count']}",
                )
            if s["kind"] == "@signal" and s["signal_names"] is not None:
                bad(
                    isinstance(out, dict) and out.get("name") in s["signal_names"],
                    f"{tag}: wait_any output {out!r}",
                )
        # fan-out-and-children.md: at most max_parallel items available or running (child
        # runs open) at a time.
        if s["fan_out_parallel"]:
            open_states = ("waiting_child",) if s["kind"] == "@child" else ("available", "running")
            live = [
                i for i in by_run[rid].values() if i["item_of"] == n and i["state"] in open_states
            ]
            bad(
                len(live) <= s["fan_out_parallel"],
                f"{tag}: {len(live)} items open, max_parallel {s['fan_out_parallel']}",
            )

        # ---- child runs (spec:32,38,70-71, fan-out-and-children.md "child") ----
        if is_child:
            kids = children.get((rid, n), [])
            bad(len(kids) <= 1, f"{tag}: {len(kids)} child runs")
            if s["state"] == "waiting_child":
                bad(len(kids) == 1, f"{tag}: waiting for a child, {len(kids)} child runs")
                if kids and run is not None and run["state"] == "running":
                    bad(
                        kids[0]["state"] in ("running", "paused"),
                        f"{tag}: waiting for child run {kids[0]['id']} in {kids[0]['state']}",
                    )
            if kids and s["state"] == "completed":
                kid = kids[0]
                bad(kid["state"] == "completed", f"{tag}: completed, child {kid['state']}")
                if s["child_needs_result"] and kid["result_node"] is not None:
                    res = by_run.get(kid["id"], {}).get(kid["result_node"])
                    if res is not None:
                        bad(
                            s["output"] == res["output"],
                            f"{tag}: output {s['output']!r} is not the child's result",
                        )
            if kids and s["state"] == "discarded" and s["error_kind"] == "child_failed":
                bad(
                    kids[0]["state"] in ("failed", "cancelled", "completed"),
                    f"{tag}: child_failed with child run {kids[0]['state']}",
                )
            if kids and s["state"] in ("pending", "available", "paused"):
                problems.append(f"{tag}: not started, yet child run {kids[0]['id']} exists")

    # ---- deps and inputs (spec:79-97) ----
    for d in deps:
        rs = by_run.get(d["run_id"], {})
        tag = f"dep {d['run_id']}:{d['node']}<-{d['dep_node']}"
        bad(d["node"] in rs, f"{tag}: dependent not a step of its run")
        bad(d["dep_node"] in rs, f"{tag}: upstream not a step of its run")
        bad(d["node"] != d["dep_node"], f"{tag}: self edge")
        bad(d["dep_type"] in ("control", "data"), f"{tag}: dep_type {d['dep_type']}")
    edge = {(d["run_id"], d["node"], d["dep_node"]) for d in deps}
    slots: dict[tuple[int, str], list[int]] = {}
    for i in inputs:
        rs = by_run.get(i["run_id"], {})
        tag = f"input {i['run_id']}:{i['node']}#{i['slot']}<-{i['dep_node']}"
        bad(i["node"] in rs and i["dep_node"] in rs, f"{tag}: not steps of the same run")
        bad(i["assembly_mode"] in ("tuple", "array"), f"{tag}: mode {i['assembly_mode']}")
        # spec:85 data edges are also recorded in cyclone_deps.
        bad((i["run_id"], i["node"], i["dep_node"]) in edge, f"{tag}: no dep edge")
        slots.setdefault((i["run_id"], i["node"]), []).append(i["slot"])
    for key, got in slots.items():
        bad(sorted(got) == list(range(len(got))), f"inputs of {key}: slots {sorted(got)}")

    # ---- signals (spec:99-116, waits.md) ----
    unconsumed: dict[tuple[int, str], int] = {}
    for g in signals:
        tag = f"signal {g['id']} run {g['run_id']} {g['name']!r}"
        bad(g["run_id"] in runs, f"{tag}: no run")
        bad(
            (g["consumed_by"] is None) == (g["consumed_at"] is None),
            f"{tag}: consumed_by {g['consumed_by']} consumed_at {g['consumed_at']}",
        )
        if g["consumed_by"] is None:
            unconsumed[(g["run_id"], g["name"])] = unconsumed.get((g["run_id"], g["name"]), 0) + 1
        else:
            w = by_run.get(g["run_id"], {}).get(g["consumed_by"])
            bad(w is not None and w["kind"] == "@signal", f"{tag}: consumed by a non-wait")
            if w is not None:
                names = w["signal_names"] or [w["signal_name"]]
                bad(g["name"] in names, f"{tag}: consumed by a wait for {names}")
    waits = [s for s in steps if s["kind"] == "@signal"]
    for (rid, name), count in unconsumed.items():
        ws = [
            w
            for w in waits
            if w["run_id"] == rid and name in (w["signal_names"] or [w["signal_name"]])
        ]
        tag = f"run {rid} signal {name!r}"
        bad(bool(ws), f"{tag}: buffered for no wait of the run")
        for w in ws:
            # spec:116 mailbox bound: 1 for wait_signal/wait_any, N for wait_n.
            bad(count <= (w["wait_count"] or 1), f"{tag}: {count} buffered")
            # waits.md: a waiting wait consumes a signal now, buffered ones on activation;
            # after completion a delivery is not stored.
            bad(
                w["state"] not in ("waiting_signal", "completed"),
                f"{tag}: {count} unconsumed while the wait is {w['state']}",
            )

    # ---- views (spec:143-148) ----
    for rid, r in runs.items():
        v = v_runs.get(rid)
        tag = f"cyclone_v_runs {rid}"
        bad(v is not None, f"{tag}: missing")
        if v is None:
            continue
        rs = list(by_run.get(rid, {}).values())
        want = {
            "steps_total": len(rs),
            "steps_completed": sum(s["state"] == "completed" for s in rs),
            "steps_discarded": sum(s["state"] == "discarded" for s in rs),
            "steps_running": sum(s["state"] == "running" for s in rs),
            "steps_waiting_signal": sum(s["state"] == "waiting_signal" for s in rs),
            "steps_waiting_timer": sum(s["state"] == "waiting_timer" for s in rs),
        }
        for col, val in want.items():
            bad(v[col] == val, f"{tag}: {col} {v[col]} != {val}")
        for col in ("state", "workflow", "finished_at", "parent_run_id", "parent_node_id"):
            bad(v[col] == r[col], f"{tag}: {col} {v[col]!r} != {r[col]!r}")
    bad(set(v_runs) == set(runs), "cyclone_v_runs lists other runs")
    for s in steps:
        v = v_steps.get(s["id"])
        tag = f"cyclone_v_steps {s['id']}"
        bad(v is not None, f"{tag}: missing")
        if v is None:
            continue
        expired = s["state"] == "running" and s["lease_expiry"] < now
        bad(bool(v["lease_expired"]) == expired, f"{tag}: lease_expired {v['lease_expired']}")
        for col in ("state", "attempt", "reclaims", "item_of", "item_index", "lease_owner"):
            bad(v[col] == s[col], f"{tag}: {col} {v[col]!r} != {s[col]!r}")
    live = [s for s in steps if s["state"] in ACTIVE_STEPS]
    kinds: dict[tuple[str, str], int] = {}
    for s in live:
        kinds[(s["kind"], s["state"])] = kinds.get((s["kind"], s["state"]), 0) + 1
    got_kinds = {(k["kind"], k["state"]): k["count"] for k in v_kinds}
    bad(got_kinds == kinds, f"cyclone_v_kinds {got_kinds} != {kinds}")
    queues: dict[str, list[int]] = {}
    for s in live:
        q = queues.setdefault(s["queue"], [0, 0, 0])
        q[0 if s["state"] == "available" else 1 if s["state"] == "running" else 2] += 1
    got_queues = {q["queue"]: [q["available"], q["running"], q["waiting"]] for q in v_queues}
    bad(got_queues == queues, f"cyclone_v_queues {got_queues} != {queues}")

    # ---- extension tables (schema.md "The extension track") ----
    failures: dict[int, int] = {}
    reclaimed: dict[int, int] = {}
    for a in attempts:
        s = by_id.get(a["step_id"])
        tag = f"attempt {a['id']} of step {a['step_id']}"
        bad(s is not None, f"{tag}: no step")  # cascades with its step
        bad(a["outcome"] in ATTEMPT_OUTCOMES, f"{tag}: outcome {a['outcome']}")
        bad(a["attempt"] >= 1, f"{tag}: attempt {a['attempt']} (1-based)")
        if s is not None:
            bad(a["run_id"] == s["run_id"], f"{tag}: run {a['run_id']} != {s['run_id']}")
        if a["outcome"] in FAILED_OUTCOMES:
            failures[a["step_id"]] = failures.get(a["step_id"], 0) + 1
        if a["outcome"] == "reclaimed":
            reclaimed[a["step_id"]] = reclaimed.get(a["step_id"], 0) + 1
    for s in steps:
        # ext 2: one row per execution that did not complete its step; attempt counts
        # the failed ones since the last operator retry.
        bad(
            failures.get(s["id"], 0) >= s["attempt"],
            f"step {s['id']} ({s['node']}): attempt {s['attempt']} but "
            f"{failures.get(s['id'], 0)} failed executions in the history",
        )
        bad(
            reclaimed.get(s["id"], 0) >= s["reclaims"],
            f"step {s['id']} ({s['node']}): reclaims {s['reclaims']} but "
            f"{reclaimed.get(s['id'], 0)} in the history",
        )
    for f in forks:
        tag = f"fork {f['run_id']} of {f['source_run_id']} from {f['from_node']}"
        rs = by_run.get(f["run_id"], {})
        bad(f["run_id"] in runs, f"{tag}: no run")
        bad(f["from_node"] in rs, f"{tag}: from_node not a step of the fork")
        bad(f["from_node"] not in f["copied"], f"{tag}: from_node copied")
        for c in f["copied"]:
            bad(c in rs, f"{tag}: copied node {c} not a step")
        src = runs.get(f["source_run_id"])
        if src is not None and f["run_id"] in runs:
            bad(src["workflow"] == runs[f["run_id"]]["workflow"], f"{tag}: other workflow")
        # waits.md "Deadlines": a fork starts without a deadline.
        if f["run_id"] in runs:
            bad(runs[f["run_id"]]["deadline_at"] is None, f"{tag}: fork with a deadline")
    for lim in limits:
        s = by_run.get(lim["run_id"], {}).get(lim["node"])
        bad(
            s is not None and s["fan_out_parallel"] is not None,
            f"fan-out limit {lim['run_id']}:{lim['node']} not on a fan-out node",
        )
    last = {q["run_id"]: q["last_seq"] for q in seqs}
    per_step: dict[int, int] = {}
    for e in events:
        tag = f"event {e['run_id']}#{e['seq']}"
        s = by_id.get(e["step_id"])
        bad(e["run_id"] in runs, f"{tag}: no run")
        if s is not None:
            bad(s["run_id"] == e["run_id"] and s["node"] == e["node"], f"{tag}: step mismatch")
        bad(e["seq"] <= last.get(e["run_id"], -1), f"{tag}: past last_seq {last.get(e['run_id'])}")
        bad(e["attempt"] >= 1 and e["lease_generation"] >= 1, f"{tag}: attempt/generation")
        per_step[e["step_id"]] = per_step.get(e["step_id"], 0) + 1
    for c in counts:
        bad(c["step_id"] in by_id, f"event count of step {c['step_id']}: no step")
        bad(
            c["emitted"] >= per_step.get(c["step_id"], 0),
            f"event count of step {c['step_id']}: {c['emitted']} < {per_step.get(c['step_id'])}",
        )
    for g in gates:
        s = by_id.get(g["step_id"])
        bad(s is not None and s["run_id"] == g["run_id"], f"gate of step {g['step_id']}")

    assert not problems, "invariants broken:\n" + "\n".join(problems[:40])


# -- handlers ---------------------------------------------------------------------------------

GATES: dict[str, threading.Event] = {}
BROKEN: set[str] = set()  # nodes (by name) that fail while listed
LOCK = threading.Lock()


def gate(name: str) -> threading.Event:
    with LOCK:
        return GATES.setdefault(name, threading.Event())


@step(name="rin_inc", max_attempts=3)
def inc(x: int) -> int:
    return x + 1


@step(name="rin_add", max_attempts=3)
def add(a: int, b: int) -> int:
    return a + b


@step(name="rin_sum", max_attempts=3)
def total(values: list[int | None]) -> int:
    return sum(v for v in values if v is not None) + 1


@step(name="rin_range")
def make_range(n: int) -> list[int]:
    return list(range(n))


@step(name="rin_flaky", max_attempts=3)
def flaky(x: int, *, ctx: StepContext) -> int:
    with LOCK:
        broken = f"{ctx.run_id}" in BROKEN or "all" in BROKEN
    if broken or x < 0 or (x % 3 == 1 and ctx.attempt == 1):
        raise RuntimeError(f"planned failure at attempt {ctx.attempt}")
    return x * 10


@step(name="rin_hold")
def hold(x: int, *, ctx: StepContext) -> int:
    ctx.emit({"held": x})
    ctx.progress(1, 2)
    gate("hold").wait(timeout=20)
    return x


@step(name="rin_slow", timeout=timedelta(seconds=0.3), max_attempts=2)
async def slow(x: int) -> int:
    await asyncio.sleep(30)
    return x


@action(name="rin_note")
def note(x: object) -> None:
    return None


ACTION_KINDS = frozenset({"rin_note"})


@workflow(name="rin_chain")
def chain(x):  # type: ignore[no-untyped-def]
    return inc(inc(inc(x)))


@workflow(name="rin_quiet")
def quiet(x):  # type: ignore[no-untyped-def]
    note(inc(x))


@workflow(name="rin_join")
def join(x):  # type: ignore[no-untyped-def]
    a = inc(x).named("a")
    b = inc(a).named("b")
    c = add(a, b).named("c")
    n = note(c, after=[b]).named("n")
    return total([a, b, c], after=[n]).named("t")


@workflow(name="rin_fan")
def fan(n):  # type: ignore[no-untyped-def]
    items = make_range(n)
    done = for_each(inc, over=items, max_parallel=2).named("each")
    for_each(note, over=items).named("notes")
    return total(done)


@workflow(name="rin_fan_wf")
def fan_wf(n):  # type: ignore[no-untyped-def]
    items = make_range(n)
    return for_each(chain, over=items, max_parallel=2).named("each")


@workflow(name="rin_fan_quiet")
def fan_quiet(n):  # type: ignore[no-untyped-def]
    items = make_range(n)
    each = for_each(quiet, over=items).named("each")
    return inc(n, after=[each])


@workflow(name="rin_parent")
def parent(x):  # type: ignore[no-untyped-def]
    c = child(chain, x).named("kid")
    child(quiet, x).named("quiet_kid")
    return inc(c)


@workflow(name="rin_signals")
def signals(x):  # type: ignore[no-untyped-def]
    go = wait_signal("go").named("go")
    votes = wait_n("vote", 2).named("votes")
    pick = wait_any(["yes", "no"]).named("pick")
    return total([inc(x), add(go, inc(x))], after=[votes, pick])


@workflow(name="rin_timer")
def timer(x):  # type: ignore[no-untyped-def]
    t = wait_timer(timedelta(hours=1)).named("t")
    return inc(x, after=[t])


@workflow(name="rin_retry")
def retry_wf(x):  # type: ignore[no-untyped-def]
    f = flaky(x).named("f")
    g = inc(f).named("g")
    inc(x, on_dep_failure="cancel_branch").named("side")
    return g


@workflow(name="rin_contained")
def contained(x):  # type: ignore[no-untyped-def]
    f = flaky(x).named("f")
    inc(f, on_dep_failure="cancel_branch").named("after_f")
    return inc(x).named("main")


@workflow(name="rin_timeout")
def timeout_wf(x):  # type: ignore[no-untyped-def]
    return inc(slow(x))


@workflow(name="rin_held")
def held(x):  # type: ignore[no-untyped-def]
    h = hold(x).named("h")
    kid = child(chain, x).named("kid")
    return add(inc(h), kid)


@workflow(name="rin_held_fan")
def held_fan(n):  # type: ignore[no-untyped-def]
    return for_each(hold, over=make_range(n), max_parallel=1).named("each")


@workflow(name="rin_deadline")
def deadline_wf(x):  # type: ignore[no-untyped-def]
    c = child(signals, x).named("kid")
    return add(inc(x), c)


@workflow(name="rin_held_kid")
def held_kid(x):  # type: ignore[no-untyped-def]
    return inc(hold(x).named("h"))


@workflow(name="rin_held_parent")
def held_parent(x):  # type: ignore[no-untyped-def]
    kid = child(held_kid, x).named("kid")
    return inc(kid)


@workflow(name="rin_held_kids")
def held_kids(n):  # type: ignore[no-untyped-def]
    return for_each(held_kid, over=make_range(n), max_parallel=1).named("each")


@workflow(name="rin_votes")
def votes(x):  # type: ignore[no-untyped-def]
    v = wait_n("vote", 2, timeout=timedelta(hours=1)).named("votes")
    return total(v)


@workflow(name="rin_branch")
def branch(x):  # type: ignore[no-untyped-def]
    a = inc(x).named("a")
    big = add(a, a, when=a.gt(3)).named("big")
    small = inc(a, otherwise=big).named("small")
    return total([big, small], on_skip="run").named("t")


@workflow(name="rin_fragile_kids")
def fragile_kids(n):  # type: ignore[no-untyped-def]
    return for_each(retry_wf, over=make_range(n), max_parallel=2).named("each")


HANDLERS = (inc, add, total, make_range, flaky, hold, slow, note)
WORKFLOWS = (
    chain,
    quiet,
    join,
    fan,
    fan_wf,
    fan_quiet,
    parent,
    signals,
    timer,
    retry_wf,
    contained,
    timeout_wf,
    held,
    held_fan,
    deadline_wf,
    held_kid,
    held_parent,
    held_kids,
    votes,
    branch,
    fragile_kids,
)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh(start_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """After start_worker, so torn down before it: held handlers are released first."""
    from cyclone_dsl.engine import backoff

    monkeypatch.setattr(backoff, "BASE_SECONDS", 0.01)
    GATES.clear()
    BROKEN.clear()
    yield
    set_clock_shift(timedelta(0))
    with LOCK:
        for event in GATES.values():
            event.set()


@pytest.fixture
def worker(start_worker: Callable[..., Worker]) -> Worker:
    return start_worker(*HANDLERS, *WORKFLOWS, concurrency=8, poll_interval=0.05, scan_interval=0.1)


class InFlight:
    """Calls check_invariants in a loop from a thread while the workload runs."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.checks = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                check_invariants(self.dsn)
            except BaseException as exc:
                self.errors.append(exc)
                return
            self.checks += 1
            self.stop.wait(0.01)

    def __enter__(self) -> InFlight:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        if self.errors:
            raise self.errors[0]


def state_of(client: Client, run_id: int) -> RunState:
    return client.get_run(run_id).state


def step_state(client: Client, run_id: int, node: str) -> str | None:
    try:
        return str(client.get_run(run_id).step(node).state)
    except KeyError:  # an item not created yet
        return None


def ended(client: Client, *run_ids: int, timeout: float = 20.0) -> None:
    for rid in run_ids:
        client.wait(rid, timeout=timeout)


# -- tests ------------------------------------------------------------------------------------


def test_check_invariants_catches_broken_rows(
    client: Client, cyclone_dsn: str, worker: Worker
) -> None:
    """The checker is not vacuous: rows written by hand that break the reference fail it."""
    run = client.submit(chain, 1)
    assert run.result(timeout=20) == 4
    check_invariants(cyclone_dsn)
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("UPDATE cyclone_runs SET finished_at = NULL WHERE id = %s", (run.id,))
    with pytest.raises(AssertionError, match="terminal without finished_at"):
        check_invariants(cyclone_dsn)
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("UPDATE cyclone_runs SET finished_at = now() WHERE id = %s", (run.id,))
        conn.execute(
            "UPDATE cyclone_steps SET lease_expiry = now() WHERE run_id = %s AND node = 'rin_inc'",
            (run.id,),
        )
    with pytest.raises(AssertionError, match="holds lease_expiry"):
        check_invariants(cyclone_dsn)


def test_chains_joins_fan_outs_and_children_settle_consistent(
    client: Client, cyclone_dsn: str, worker: Worker
) -> None:
    with InFlight(cyclone_dsn):
        handles = [
            client.submit(chain, 1),
            client.submit(join, 2),
            client.submit(fan, 5),
            client.submit(fan, 0),
            client.submit(fan_wf, 3),
            client.submit(fan_quiet, 2),
            client.submit(parent, 3),
            client.submit(quiet, 4),
        ]
        results = [h.result(timeout=20) for h in handles[:5]]
    assert results == [4, 15, 16, 1, [3, 4, 5]]
    assert handles[6].result(timeout=20) == 7
    for h in handles:
        assert h.get().state is RunState.COMPLETED
    check_invariants(cyclone_dsn)


def test_signals_and_waits(client: Client, cyclone_dsn: str, worker: Worker) -> None:
    with InFlight(cyclone_dsn):
        run = client.submit(signals, 1)
        client.signal(run.id, "vote", 1)  # buffered before the wait... it is a root: consumed
        client.signal(run.id, "yes", {"y": 1})
        client.signal(run.id, "go", 5)
        client.signal(run.id, "vote", 2)
        assert run.result(timeout=20) == (2 + 5 + 2) + 1
    check_invariants(cyclone_dsn)


def test_retries_failures_and_contained_failures(
    client: Client, cyclone_dsn: str, worker: Worker
) -> None:
    with InFlight(cyclone_dsn):
        ok = client.submit(retry_wf, 1)  # x % 3 == 1: fails once, then completes
        assert ok.result(timeout=20) == 11
        BROKEN.add("all")
        bad_run = client.submit(retry_wf, 2)
        box = client.submit(contained, 3)
        with pytest.raises(RunFailed):
            bad_run.result(timeout=20)
        box.wait(timeout=20)
    assert box.get().state is RunState.COMPLETED
    check_invariants(cyclone_dsn)
    BROKEN.clear()
    with InFlight(cyclone_dsn):
        client.retry(bad_run.id, "f")
        assert bad_run.result(timeout=20) == 21
        client.retry(box.id, "f")
        box.wait(timeout=20)
    assert box.get().step("after_f").output == 31
    check_invariants(cyclone_dsn)


def test_timeouts(client: Client, cyclone_dsn: str, worker: Worker) -> None:
    with InFlight(cyclone_dsn):
        run = client.submit(timeout_wf, 1)
        with pytest.raises(RunFailed):
            run.result(timeout=20)
    assert run.get().step("rin_slow").error_kind == "timeout"
    check_invariants(cyclone_dsn)


def test_cancel_pause_resume_while_held(client: Client, cyclone_dsn: str, worker: Worker) -> None:
    with InFlight(cyclone_dsn):
        a = client.submit(held, 1)
        b = client.submit(held, 2)
        c = client.submit(held_fan, 3)
        wait_until(lambda: step_state(client, a.id, "h") == "running", what="a holds")
        wait_until(lambda: step_state(client, c.id, "each[0]") == "running", what="c holds")
        client.cancel(a.id)
        client.pause(b.id)
        client.pause(c.id)
        check_invariants(cyclone_dsn)
        client.resume(c.id)
        check_invariants(cyclone_dsn)
        gate("hold").set()
        client.resume(b.id)
        assert b.result(timeout=20) == 2 + 1 + 5
        assert c.result(timeout=20) == [0, 1, 2]
        a.wait(timeout=20)
    assert a.get().state is RunState.CANCELLED
    check_invariants(cyclone_dsn)


def test_pausing_a_fan_out_keeps_max_parallel(
    client: Client, cyclone_dsn: str, worker: Worker
) -> None:
    """fan-out-and-children.md: at most max_parallel items available or running, also
    around a pause and a resume."""
    run = client.submit(held_fan, 4)
    wait_until(lambda: step_state(client, run.id, "each[0]") == "running", what="item 0 runs")
    client.pause(run.id)
    check_invariants(cyclone_dsn)
    client.resume(run.id)
    check_invariants(cyclone_dsn)
    gate("hold").set()
    assert run.result(timeout=20) == [0, 1, 2, 3]
    check_invariants(cyclone_dsn)


def test_timers_deadlines_and_purge(
    client: Client, cyclone_dsn: str, worker: Worker, clock: Callable[[datetime], None]
) -> None:
    t = client.submit(timer, 1)
    d = client.submit(deadline_wf, 1, deadline=timedelta(minutes=30))
    wait_until(lambda: step_state(client, d.id, "kid") == "waiting_child", what="kid")
    wait_until(lambda: step_state(client, d.id, "rin_inc") == "completed", what="inc")
    check_invariants(cyclone_dsn)
    with InFlight(cyclone_dsn):
        clock(datetime.now(UTC) + timedelta(hours=2))
        assert t.result(timeout=20) == 2
        d.wait(timeout=20)
    assert d.get().state is RunState.FAILED
    kid = client.list_runs(parent_run_id=d.id)[0]
    assert client.get_run(kid.id).state is RunState.CANCELLED
    check_invariants(cyclone_dsn)
    purged = client.purge()
    assert purged >= 2
    check_invariants(cyclone_dsn)


def test_replay_and_fork(client: Client, cyclone_dsn: str, worker: Worker) -> None:
    run = client.submit(join, 1)
    assert run.result(timeout=20) == 1 + 2 + 3 + 5 + 1 - 1
    with InFlight(cyclone_dsn):
        client.retry(run.id, "b", force=True)
        fork = client.fork(run.id, "c", input=7)
        fork2 = client.fork(run.id, "a", input=7)
        assert run.result(timeout=20) == 11
        assert fork.result(timeout=20) == 11
        assert fork2.result(timeout=20) == 8 + 9 + 17 + 1
    check_invariants(cyclone_dsn)


def test_pausing_a_fan_out_of_children_keeps_max_parallel_and_reaches_down(
    client: Client, cyclone_dsn: str, worker: Worker
) -> None:
    """fan-out-and-children.md: at most max_parallel child runs open; pause reaches down."""
    run = client.submit(held_kids, 3)
    wait_until(lambda: step_state(client, run.id, "each[0]") == "waiting_child", what="item 0")
    kid = client.list_runs(parent_run_id=run.id)[0]
    wait_until(lambda: step_state(client, kid.id, "h") == "running", what="kid holds")
    client.pause(run.id)
    assert client.get_run(kid.id).state is RunState.PAUSED
    check_invariants(cyclone_dsn)
    client.resume(run.id)
    check_invariants(cyclone_dsn)
    with InFlight(cyclone_dsn):
        gate("hold").set()
        assert run.result(timeout=20) == [1, 2, 3]
    check_invariants(cyclone_dsn)


def test_paused_parent_and_child_run_cancelled_on_its_own(
    client: Client, cyclone_dsn: str, worker: Worker
) -> None:
    a = client.submit(held_parent, 1)
    b = client.submit(held_parent, 2)
    wait_until(lambda: step_state(client, a.id, "kid") == "waiting_child", what="a's kid")
    wait_until(lambda: step_state(client, b.id, "kid") == "waiting_child", what="b's kid")
    kid_a = client.list_runs(parent_run_id=a.id)[0]
    kid_b = client.list_runs(parent_run_id=b.id)[0]
    wait_until(lambda: step_state(client, kid_a.id, "h") == "running", what="a's kid holds")
    with InFlight(cyclone_dsn):
        client.pause(a.id)
        check_invariants(cyclone_dsn)
        client.cancel(kid_b.id)  # fails b's child node, and only that
        with pytest.raises(RunFailed):
            b.result(timeout=20)
        gate("hold").set()  # a's kid's step completes while its run is paused
        wait_until(
            lambda: step_state(client, kid_a.id, "h") == "completed", what="a's kid step done"
        )
        check_invariants(cyclone_dsn)
        client.resume(a.id)
        assert a.result(timeout=20) == 3
    assert b.get().step("kid").error_kind == "child_failed"
    check_invariants(cyclone_dsn)


def test_wait_n_timeout_then_retry_starts_the_quorum_again(
    client: Client, cyclone_dsn: str, worker: Worker, clock: Callable[[datetime], None]
) -> None:
    run = client.submit(votes, 0)
    client.signal(run.id, "vote", 1)
    check_invariants(cyclone_dsn)
    clock(datetime.now(UTC) + timedelta(hours=2))
    with pytest.raises(RunFailed):
        run.result(timeout=20)
    assert run.get().step("votes").error_kind == "signal_timeout"
    check_invariants(cyclone_dsn)
    client.retry(run.id, "votes")
    check_invariants(cyclone_dsn)
    client.signal(run.id, "vote", 10)
    check_invariants(cyclone_dsn)
    client.signal(run.id, "vote", 20)
    assert run.result(timeout=20) == 31
    check_invariants(cyclone_dsn)


def test_conditions_replay_of_a_fan_out_and_bulk_operations(
    client: Client, cyclone_dsn: str, worker: Worker
) -> None:
    from cyclone_dsl import RunFilter

    with InFlight(cyclone_dsn):
        small = client.submit(branch, 1)  # a=2: big skipped, small=3
        large = client.submit(branch, 5)  # a=6: big=12, small skipped
        assert small.result(timeout=20) == 4
        assert large.result(timeout=20) == 13
        f = client.submit(fan, 3)
        assert f.result(timeout=20) == 7
        client.retry(f.id, "each", force=True)
        assert f.result(timeout=20) == 7
        with LOCK:
            BROKEN.add("all")
        fails = [client.submit(retry_wf, 3), client.submit(fragile_kids, 2)]
        for h in fails:
            with pytest.raises(RunFailed):
                h.result(timeout=20)
        check_invariants(cyclone_dsn)
        with LOCK:
            BROKEN.clear()
        result = client.retry_many(RunFilter(workflows=["rin_retry", "rin_fragile_kids"]))
        assert result.acted == 2
        assert fails[0].result(timeout=20) == 31
        assert fails[1].result(timeout=20) == [1, 11]
        gate("hold").clear()
        held_runs = [client.submit(held_fan, 2), client.submit(held_kids, 2)]
        wait_until(
            lambda: step_state(client, held_runs[1].id, "each[0]") == "waiting_child",
            what="a child run",
        )
        client.pause(held_runs[0].id)
        client.pause(held_runs[1].id)
        assert client.resume_many(RunFilter(workflows="rin_held_fan")).acted == 1
        assert client.cancel_many(RunFilter(workflows=["rin_held_fan", "rin_held_kids"])).acted == 2
        gate("hold").set()
        for h in held_runs:
            h.wait(timeout=20)
    check_invariants(cyclone_dsn)


def test_standalone_work(client: Client, cyclone_dsn: str, worker: Worker) -> None:
    with InFlight(cyclone_dsn):
        hs = [client.enqueue(inc, i, sequence_key="k") for i in range(3)]
        hs += [client.enqueue(flaky, -1, max_attempts=2), client.enqueue(note, {"x": 1})]
        hs.append(client.enqueue(inc, 9, unique_key="u"))
        hs.append(client.enqueue(inc, 9, unique_key="u"))
        for h in hs:
            h.wait(timeout=20)
    check_invariants(cyclone_dsn)


def test_deadline_passing_while_a_step_runs(
    client: Client, cyclone_dsn: str, worker: Worker, clock: Callable[[datetime], None]
) -> None:
    """waits.md "Deadlines": past it the run fails and what is left is cancelled, child
    runs included; a step that completes after it is fenced."""
    run = client.submit(held, 1, deadline=timedelta(minutes=30))
    wait_until(lambda: step_state(client, run.id, "h") == "running", what="h holds")
    wait_until(lambda: step_state(client, run.id, "kid") == "completed", what="kid done")
    with InFlight(cyclone_dsn):
        clock(datetime.now(UTC) + timedelta(hours=1))
        run.wait(timeout=20)
        gate("hold").set()
        wait_until(
            lambda: client.get_run(run.id).step("h").state != "running", what="h not running"
        )
    got = run.get()
    assert got.state is RunState.FAILED
    check_invariants(cyclone_dsn)


def test_timer_in_a_paused_run_and_a_fork_of_a_failed_fan_out(
    client: Client, cyclone_dsn: str, worker: Worker, clock: Callable[[datetime], None]
) -> None:
    t = client.submit(timer, 1)
    wait_until(lambda: step_state(client, t.id, "t") == "waiting_timer", what="timer")
    client.pause(t.id)
    clock(datetime.now(UTC) + timedelta(hours=2))
    check_invariants(cyclone_dsn)
    assert step_state(client, t.id, "t") == "waiting_timer"  # paused: does not fire
    client.resume(t.id)
    check_invariants(cyclone_dsn)
    clock(datetime.now(UTC) + timedelta(hours=5))
    assert t.result(timeout=20) == 2
    with LOCK:
        BROKEN.add("all")
    f = client.submit(fragile_kids, 3)
    with pytest.raises(RunFailed):
        f.result(timeout=20)
    check_invariants(cyclone_dsn)
    with LOCK:
        BROKEN.clear()
    with InFlight(cyclone_dsn):
        fork = client.fork(f.id, "each")
        assert fork.result(timeout=20) == [1, 11, 21]
    check_invariants(cyclone_dsn)
    assert client.purge() >= 3
    check_invariants(cyclone_dsn)


WORKLOADS = [
    "chain",
    "join",
    "fan",
    "fan_wf",
    "parent",
    "signals",
    "retry",
    "fail",
    "cancel",
    "pause",
]


@given(mix=st.lists(st.sampled_from(WORKLOADS), min_size=2, max_size=6))
@settings(max_examples=3, deadline=None)
def test_random_workload_mix(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker], mix: list[str]
) -> None:
    if not hasattr(start_worker, "_rin"):  # one worker for all the examples
        start_worker(*HANDLERS, *WORKFLOWS, concurrency=8, poll_interval=0.05, scan_interval=0.1)
        start_worker._rin = True  # type: ignore[attr-defined]
    gate("hold").set()
    expect: list[tuple[int, RunState]] = []
    with InFlight(cyclone_dsn):
        for i, kind in enumerate(mix):
            if kind == "chain":
                expect.append((client.submit(chain, i).id, RunState.COMPLETED))
            elif kind == "join":
                expect.append((client.submit(join, i).id, RunState.COMPLETED))
            elif kind == "fan":
                expect.append((client.submit(fan, i % 4).id, RunState.COMPLETED))
            elif kind == "fan_wf":
                expect.append((client.submit(fan_wf, i % 3 + 1).id, RunState.COMPLETED))
            elif kind == "parent":
                expect.append((client.submit(parent, i).id, RunState.COMPLETED))
            elif kind == "signals":
                h = client.submit(signals, i)
                for name, value in (("go", 1), ("vote", 1), ("vote", 2), ("no", 0)):
                    client.signal(h.id, name, value)
                expect.append((h.id, RunState.COMPLETED))
            elif kind == "retry":
                expect.append((client.submit(retry_wf, 3 * i + 1).id, RunState.COMPLETED))
            elif kind == "fail":
                expect.append((client.submit(retry_wf, -1 - i).id, RunState.FAILED))
            elif kind == "cancel":
                h = client.submit(held, i)
                with contextlib.suppress(Exception):
                    client.cancel(h.id)
                expect.append((h.id, RunState.CANCELLED))
            elif kind == "pause":
                h = client.submit(fan_wf, 2)
                with contextlib.suppress(Exception):
                    client.pause(h.id)
                    client.resume(h.id)
                expect.append((h.id, RunState.COMPLETED))
        for rid, _ in expect:
            client.wait(rid, timeout=20)
    for rid, want in expect:
        got = client.get_run(rid).state
        assert got is want or (want is RunState.CANCELLED and got is RunState.COMPLETED), (
            rid,
            got,
            want,
        )
    check_invariants(cyclone_dsn)
