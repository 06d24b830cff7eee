"""Handlers for tests/faults/test_pta_audit.py (production-like workflows under kills).

Worker processes import this module by name. Every handler records each execution as
files in the directory named by its input (``dir``): ``<run>~<node>~<token>~start`` when
it starts and ``...~end`` when it returns (``...~fail`` when it raises on purpose), each
holding JSON (the pid, the attempt, a wall-clock time). Handlers that return a dict put
the execution's ``token`` in it, so a test can tell which execution's output was kept.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from cyclone_dsl import (
    NodeRef,
    Ref,
    StepContext,
    action,
    child,
    define_result,
    for_each,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)

#: How long the "work" of a handler takes: long enough for kills to find it running.
WORK_S = 0.4


def _record(directory: object, ctx: StepContext, token: str, phase: str) -> None:
    body = {"pid": os.getpid(), "attempt": ctx.attempt, "t": time.time(), "kind": ctx.kind}
    path = Path(str(directory)) / f"{ctx.run_id}~{ctx.node}~{token}~{phase}"
    path.write_text(json.dumps(body))


def _work(directory: object, ctx: StepContext, seconds: float = WORK_S) -> str:
    token = uuid.uuid4().hex
    _record(directory, ctx, token, "start")
    time.sleep(seconds)
    return token


# -- the order workflow ---------------------------------------------------------------------


@step(name="pta_fetch", max_attempts=4)
def fetch(order: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
    """Fails its first ``order["flaky"]`` attempts (a flaky upstream service)."""
    token = _work(order["dir"], ctx, 0.2)
    if ctx.attempt <= int(order["flaky"]):
        _record(order["dir"], ctx, token, "fail")
        raise ConnectionError(f"order service unavailable (attempt {ctx.attempt})")
    _record(order["dir"], ctx, token, "end")
    return {**order, "token": token}


@step(name="pta_lines")
def lines(order: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**line, "dir": order["dir"]} for line in order["lines"]]


@step(name="pta_price", max_attempts=3)
def price(line: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
    """qty * price of one line; a line marked ``flaky`` fails its first attempt."""
    token = _work(line["dir"], ctx)
    if line.get("flaky") and ctx.attempt == 1:
        _record(line["dir"], ctx, token, "fail")
        raise TimeoutError("pricing service timed out")
    _record(line["dir"], ctx, token, "end")
    return {"sku": line["sku"], "amount": int(line["qty"]) * int(line["price"]), "token": token}


@step(name="pta_boxes")
def boxes(order: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"dir": order["dir"], "box": i, "weight": w} for i, w in enumerate(order["weights"])]


@step(name="pta_pack")
def pack(box: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
    token = _work(box["dir"], ctx, 0.2)
    _record(box["dir"], ctx, token, "end")
    return {**box, "packed": True, "token": token}


@step(name="pta_label")
def label(packed: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
    token = _work(packed["dir"], ctx, 0.2)
    _record(packed["dir"], ctx, token, "end")
    return {"label": f"L{packed['box']}-{int(packed['weight']) * 2}", "token": token}


@workflow(name="pta_shipment")
def shipment(box: Ref[dict[str, Any]]) -> NodeRef[dict[str, Any]]:
    return label(pack(box))


@step(name="pta_total")
def total(
    priced: list[dict[str, Any]],
    approval: dict[str, Any],
    shipped: list[dict[str, Any]],
    ctx: StepContext,
) -> dict[str, Any]:
    directory = approval["dir"]
    token = _work(directory, ctx, 0.1)
    _record(directory, ctx, token, "end")
    return {
        "amount": sum(int(p["amount"]) for p in priced) - int(approval["discount"]),
        "skus": [p["sku"] for p in priced],
        "labels": [s["label"] for s in shipped],
        "approved_by": approval["by"],
        "token": token,
    }


@action(name="pta_notify")
def notify(summary: dict[str, Any], ctx: StepContext) -> None:
    directory = summary["dir"]
    token = _work(directory, ctx, 0.05)
    _record(directory, ctx, token, "end")


@step(name="pta_summary")
def summarize(order: dict[str, Any], billed: dict[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in billed.items() if k != "token"}
    return {"dir": order["dir"], "order": order["id"], **kept}


@workflow(name="pta_order")
def order_flow(order: Ref[dict[str, Any]]) -> None:
    fetched = fetch(order)
    priced = for_each(price, over=lines(fetched), max_parallel=3)
    shipped = for_each(shipment, over=boxes(fetched), max_parallel=2)
    approval = wait_signal("approved", timeout=timedelta(seconds=90))
    cool_off = wait_timer(timedelta(seconds=1), after=[approval])
    billed = total(priced, approval, shipped, after=[cool_off])
    summary = summarize(fetched, billed)
    notify(summary)
    define_result(summary)


# -- a minimal fan-out -----------------------------------------------------------------------


@step(name="pta_numbers")
def numbers(n: int) -> list[int]:
    return list(range(1, n + 1))


@step(name="pta_square")
def square(x: int) -> int:
    return x * x


@workflow(name="pta_squares")
def squares(n: Ref[int]) -> NodeRef[list[int]]:
    return for_each(square, over=numbers(n))


# -- the review workflow --------------------------------------------------------------------


@step(name="pta_risk")
def risk(claim: dict[str, Any], ctx: StepContext) -> float:
    token = _work(claim["dir"], ctx, 0.2)
    _record(claim["dir"], ctx, token, "end")
    return int(claim["amount"]) / 100


@step(name="pta_escalate", max_attempts=3)
def escalate(claim: dict[str, Any], ctx: StepContext) -> str:
    token = _work(claim["dir"], ctx, 0.3)
    if ctx.attempt == 1:
        _record(claim["dir"], ctx, token, "fail")
        raise RuntimeError("review desk busy")
    _record(claim["dir"], ctx, token, "end")
    return f"escalated:{claim['id']}"


@step(name="pta_tax_lines")
def tax_lines(claim: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"dir": claim["dir"], "gate": claim["gate"], "part": i, "amount": a}
        for i, a in enumerate(claim["parts"])
    ]


@step(name="pta_tax", max_reclaims=6)
def tax(part: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
    """Waits (as for a slow external service) until the file ``gate`` exists."""
    token = _work(part["dir"], ctx, 0)
    gate = Path(str(part["gate"]))
    deadline = time.monotonic() + 40
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(WORK_S)
    _record(part["dir"], ctx, token, "end")
    return {"part": part["part"], "tax": int(part["amount"]) * 20 // 100, "token": token}


@step(name="pta_invoice_total")
def invoice_total(taxes: list[dict[str, Any]]) -> int:
    return sum(int(t["tax"]) for t in taxes)


@workflow(name="pta_invoice")
def invoice(claim: Ref[dict[str, Any]]) -> NodeRef[int]:
    return invoice_total(for_each(tax, over=tax_lines(claim), max_parallel=2))


@step(name="pta_decide")
def decide(parts: list[Any]) -> dict[str, Any]:
    votes, decision, escalated, invoiced = parts
    return {
        "votes": sorted(int(v) for v in votes),
        "decision": decision["name"],
        "note": decision["payload"],
        "escalated": escalated,
        "tax": invoiced,
    }


@workflow(name="pta_review")
def review(claim: Ref[dict[str, Any]]) -> NodeRef[dict[str, Any]]:
    level = risk(claim)
    votes = wait_n("vote", 2, timeout=timedelta(seconds=90))
    decision = wait_any(["accept", "reject"])
    escalated = escalate(claim, when=level.gt(5))
    invoiced = child(invoice, claim)
    return decide([votes, decision, escalated, invoiced], node_id="pta_decide")
