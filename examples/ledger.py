"""A transactional step: the payment row and the step's completion commit together.

The first attempt writes its row and then fails: its write is rolled back with it, so
the account is debited exactly once, by the attempt that completed.
"""

from __future__ import annotations

from cyclone_dsl import StepContext, step, workflow


@step(name="ex_debit", transactional=True, max_attempts=3)
def debit(order: dict[str, object], *, ctx: StepContext) -> int:
    conn = ctx.connection  # inside the transaction that completes this step
    conn.execute(
        "INSERT INTO payments (order_id, amount) VALUES (%s, %s)",
        (order["id"], order["amount"]),
    )
    if ctx.attempt == 1:
        raise ConnectionError("the card network timed out")  # the insert rolls back
    row = conn.execute("SELECT sum(amount) FROM payments").fetchone()
    return int(row[0])


@workflow(name="ex_ledger")
def ledger(order):  # type: ignore[no-untyped-def]
    return debit(order)


if __name__ == "__main__":
    import psycopg

    from cyclone_dsl import Client, Worker, embedded_database, migrate

    with embedded_database() as dsn:
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS payments")
            conn.execute("CREATE TABLE payments (order_id text, amount int)")
        with Worker(dsn, [ledger]), Client(dsn) as client:
            total = client.submit(ledger, {"id": "o-1", "amount": 40}).result(timeout=30)
            print("debited in total:", total)
            assert total == 40
