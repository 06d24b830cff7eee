"""A standalone job queue: unique keys (no duplicate work) and sequence keys (FIFO per key)."""

from __future__ import annotations

from cyclone_dsl import action, step

applied: list[str] = []


@step(name="jq_send_invoice")
def send_invoice(invoice_id: str) -> str:
    return f"sent {invoice_id}"


@action(name="jq_apply_event")
def apply_event(event: dict[str, object]) -> None:
    applied.append(f"{event['account']}:{event['n']}")


if __name__ == "__main__":
    from cyclone_dsl import Client, Worker, embedded_database, migrate

    with embedded_database() as dsn:
        migrate(dsn)
        with Client(dsn) as client:
            first = client.enqueue(send_invoice, "inv-7", unique_key="inv-7")
            again = client.enqueue(send_invoice, "inv-7", unique_key="inv-7")
            assert again.id == first.id
            assert not again.created
            events = [
                client.enqueue(apply_event, {"account": a, "n": n}, sequence_key=a)
                for n in range(5)
                for a in ("acct-1", "acct-2")
            ]
            with Worker(dsn, [send_invoice, apply_event], concurrency=8):
                print(first.result(timeout=30))
                for handle in events:
                    handle.wait(timeout=30)
            for account in ("acct-1", "acct-2"):
                order = [e for e in applied if e.startswith(account)]
                print(account, order)
                assert order == [f"{account}:{n}" for n in range(5)]
