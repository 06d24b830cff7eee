"""SQLAlchemy 2: an order row and its workflow run in one Session transaction.

``submit_tx(session, client, workflow, input)`` writes the run on the session's
psycopg connection (dialect ``postgresql+psycopg``): the order and its run are
committed together, or, when the block raises, neither exists.
"""

from __future__ import annotations

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from cyclone_dsl import NodeRef, Ref, step, workflow


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "sa_example_orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    sku: Mapped[str] = mapped_column(String(40))
    qty: Mapped[int]


@step(name="sa_reserve")
def reserve(order: dict[str, object]) -> dict[str, object]:
    return {**order, "reserved": True}


@step(name="sa_ship")
def ship(order: dict[str, object]) -> str:
    return f"order {order['order_id']}: {order['qty']} x {order['sku']} shipped"


@workflow(name="sa_fulfil")
def fulfil(order: Ref[dict[str, object]]) -> NodeRef[str]:
    return ship(reserve(order))


class OutOfStock(Exception):
    pass


if __name__ == "__main__":
    from psycopg.conninfo import conninfo_to_dict
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import Session

    from cyclone_dsl import Client, RunNotFound, Worker, embedded_database, migrate
    from cyclone_dsl.contrib.sqlalchemy import submit_tx

    with embedded_database() as dsn:
        migrate(dsn)
        # The embedded database's DSN is a conninfo string; with a URL, this is simply
        # create_engine("postgresql+psycopg://user:password@host/db").
        engine = create_engine("postgresql+psycopg://", connect_args=conninfo_to_dict(dsn))
        Base.metadata.create_all(engine)
        with Client(dsn) as client:
            with Session(engine) as session, session.begin():
                order = Order(sku="sku-1", qty=2)
                session.add(order)
                session.flush()  # the order gets its id
                placed = submit_tx(
                    session, client, fulfil, {"order_id": order.id, "sku": "sku-1", "qty": 2}
                )
            # committed: the order and its run

            try:
                with Session(engine) as session, session.begin():
                    order = Order(sku="sku-2", qty=1000)
                    session.add(order)
                    session.flush()
                    refused = submit_tx(
                        session, client, fulfil, {"order_id": order.id, "sku": "sku-2", "qty": 1000}
                    )
                    raise OutOfStock("sku-2")
            except OutOfStock:
                pass
            # rolled back: neither the order nor its run exists
            with Session(engine) as session:
                assert session.scalars(select(Order).where(Order.sku == "sku-2")).first() is None
            try:
                client.get_run(refused.id)
                raise AssertionError("the run of a rolled-back transaction exists")
            except RunNotFound:
                print(f"run {refused.id} was rolled back with its order")

            with Worker(dsn, [fulfil]):
                print(placed.result(timeout=30))
        engine.dispose()
