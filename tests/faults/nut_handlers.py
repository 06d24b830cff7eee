"""Handlers for tests/faults/test_nut_audit.py: a small subscription-billing app, deploy 1.

Worker processes import this module by name (``tests.faults.nut_handlers``). Its second
deploy, ``nut_handlers_v2.py``, is the same module as the next release of the app would
ship it: the test copies it into a directory of its own under this very module name
(handler identities are ``module:qualname``, so a second deploy keeps the module's name).

Every handler that does "work" records each execution as files in the directory named by
its input (``dir``): ``<run>~<node>~<token>~start`` when it starts and ``...~end`` when it
returns, each holding JSON (the pid, the attempt, a wall-clock time, the deploy). The
outputs of those handlers carry the execution's ``token``, so a test can tell which
execution's output was kept.
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
    child,
    define_result,
    for_each,
    step,
    wait_any,
    workflow,
)

#: Which release of the app this module is.
DEPLOY = 1
#: How long pricing one line takes: long enough for kills to find handlers running.
WORK_S = 0.2
#: How long the card charge waits for the payment provider's answer.
PAY_TIMEOUT = timedelta(seconds=3)


def _record(directory: object, ctx: StepContext, token: str, phase: str) -> None:
    body = {"pid": os.getpid(), "attempt": ctx.attempt, "t": time.time(), "deploy": DEPLOY}
    path = Path(str(directory)) / f"{ctx.run_id}~{ctx.node}~{token}~{phase}"
    path.write_text(json.dumps(body))


def _work(directory: object, ctx: StepContext, seconds: float, gate: object = None) -> str:
    token = uuid.uuid4().hex
    _record(directory, ctx, token, "start")
    if gate:  # a slow external service: answers once the file exists
        limit = time.monotonic() + 40
        while not Path(str(gate)).exists() and time.monotonic() < limit:
            if ctx.cancelled:  # the run was cancelled (or the lease is gone): give up
                _record(directory, ctx, token, "fail")
                raise RuntimeError("stopped")
            time.sleep(0.05)
    time.sleep(seconds)
    return token


@step(name="nut_line_items")
def line_items(invoice: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"dir": invoice["dir"], "gate": invoice.get("gate"), "sku": sku, "qty": qty, "unit": unit}
        for sku, qty, unit in invoice["plan"]
    ]


@step(name="nut_amount", max_attempts=3)
def amount(line: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
    token = _work(line["dir"], ctx, WORK_S, line.get("gate"))
    _record(line["dir"], ctx, token, "end")
    return {"sku": line["sku"], "amount": int(line["qty"]) * int(line["unit"]), "token": token}


@step(name="nut_total")
def total(
    invoice: dict[str, Any], amounts: list[dict[str, Any]], ctx: StepContext
) -> dict[str, Any]:
    token = _work(invoice["dir"], ctx, 0, invoice.get("total_gate"))
    _record(invoice["dir"], ctx, token, "end")
    return {
        "dir": invoice["dir"],
        "invoice": invoice["id"],
        "total": sum(int(a["amount"]) for a in amounts),
    }


@step(name="nut_record_payment")
def record_payment(
    bill: dict[str, Any], answer: dict[str, Any], ctx: StepContext
) -> dict[str, Any]:
    token = _work(bill["dir"], ctx, 0.05)
    _record(bill["dir"], ctx, token, "end")
    return {
        "outcome": "paid" if answer["name"] == "payment" else "declined",
        "ref": answer["payload"]["ref"],
        "charged": int(bill.get("due", bill["total"])) if answer["name"] == "payment" else 0,
        "token": token,
    }


@workflow(name="nut_charge")
def charge(bill: Ref[dict[str, Any]]) -> NodeRef[dict[str, Any]]:
    """Charge the card: the payment provider answers with a signal, or never."""
    answer = wait_any(["payment", "declined"], timeout=PAY_TIMEOUT)
    return record_payment(bill, answer)


@step(name="nut_summary")
def summarize(bill: dict[str, Any], charged: dict[str, Any]) -> dict[str, Any]:
    summary = {
        "invoice": bill["invoice"],
        "total": bill["total"],
        "payment": charged["outcome"],
        "ref": charged["ref"],
        "charged": charged["charged"],
        "deploy": DEPLOY,
    }
    if "tax" in bill:
        summary["tax"] = bill["tax"]
    return summary


@workflow(name="nut_bill")
def bill(invoice: Ref[dict[str, Any]]) -> None:
    amounts = for_each(amount, over=line_items(invoice), max_parallel=3)
    billed = total(invoice, amounts)
    charged = child(charge, billed)
    define_result(summarize(billed, charged))
