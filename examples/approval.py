"""An approval with a timeout: wait_any for a decision; a timeout is contained by cancel_branch.

The reminder branch waits for a decision for a short while. If nobody
answers in time, the wait fails with ``signal_timeout``; its dependent uses
``on_dep_failure="cancel_branch"``, so only that branch is cancelled and the
escalation branch still completes the run.
"""

from __future__ import annotations

from datetime import timedelta

from cyclone_dsl import NodeRef, Ref, step, wait_any, workflow


@step(name="ap_request")
def request(expense: dict[str, object]) -> dict[str, object]:
    return {"id": expense["id"], "amount": expense["amount"], "status": "requested"}


@step(name="ap_apply")
def apply_decision(decision: dict[str, object]) -> str:
    return f"decided: {decision['name']}"


@step(name="ap_escalate")
def escalate(request: dict[str, object]) -> str:
    return f"escalated expense {request['id']} to finance"


@workflow(name="ap_approval")
def approval(expense: Ref[dict[str, object]]) -> NodeRef[str]:
    requested = request(expense)
    decision = wait_any(["approve", "reject"], timeout=timedelta(seconds=1), after=[requested])
    apply_decision(decision, on_dep_failure="cancel_branch")
    return escalate(requested)


if __name__ == "__main__":
    from cyclone_dsl import Client, Worker, embedded_database, migrate

    with embedded_database() as dsn:
        migrate(dsn)
        with Worker(dsn, [approval], scan_interval=0.2), Client(dsn) as client:
            answered = client.submit(approval, {"id": 1, "amount": 120})
            client.signal(answered.id, "approve", {"by": "ana"})
            unanswered = client.submit(approval, {"id": 2, "amount": 9000})
            print(answered.result(timeout=30), "/", answered.get().step("ap_apply").output)
            print(unanswered.result(timeout=30))
            timed_out = unanswered.get()
            assert timed_out.step("any_approve_reject").error_kind == "signal_timeout"
            assert timed_out.step("ap_apply").state == "cancelled"
            assert timed_out.state == "completed"
