"""Submit runs in a SQLAlchemy 2 ``Session``'s transaction (extra ``sqlalchemy``).

With the ``postgresql+psycopg`` dialect, the session's connection is a psycopg 3
connection: these helpers write the run on it, inside the session's transaction, so
the run exists if and only if the session commits, with the rows the application
wrote in the same transaction::

    with Session(engine) as session, session.begin():
        session.add(Order(id=order_id))
        submit_tx(session, client, fulfil, {"order_id": order_id})
    # committed here: the order and its run, or (on an exception) neither

Each helper takes a ``Session`` or a Core ``Connection`` (its transaction is begun if it
has none, as a query would: ``conn.commit()`` then commits the run), and the
:class:`~cyclone_dsl.Client`
that compiles the workflow and hands back the :class:`~cyclone_dsl.RunHandle`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from cyclone_dsl.client.handle import RunHandle
from cyclone_dsl.client.sync import Client
from cyclone_dsl.contrib import missing_extra
from cyclone_dsl.contrib._connections import psycopg_connection
from cyclone_dsl.db.callers import Connection as PsycopgConnection
from cyclone_dsl.payload import JSONValue

try:
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session
except ImportError as exc:
    raise missing_extra("sqlalchemy", "SQLAlchemy 2", "sqlalchemy") from exc

__all__ = ["driver_connection", "enqueue_tx", "submit_once_tx", "submit_tx"]


def driver_connection(bind: Session | Connection) -> PsycopgConnection:
    """The psycopg connection under ``bind``, in the transaction ``bind`` has (or begins).

    Raises ``TypeError`` when the engine's dialect is not ``postgresql+psycopg``.
    """
    conn = bind.connection() if isinstance(bind, Session) else bind
    if not isinstance(conn, Connection):
        raise TypeError(f"expected a sqlalchemy Session or Connection, not {bind!r}")
    if not conn.in_transaction():
        # Begun by SQLAlchemy, as its own first statement would: a transaction begun under
        # it on the driver connection would be one its commit() knows nothing of (the run
        # then rolled back when the connection went back to the pool).
        conn.begin()
    return psycopg_connection(
        conn.connection.driver_connection,
        "a SQLAlchemy engine with the postgresql+psycopg dialect "
        "(create_engine('postgresql+psycopg://...'))",
    )


def submit_tx(
    bind: Session | Connection,
    client: Client,
    workflow: object,
    input: JSONValue = None,
    *,
    deadline: timedelta | None = None,
) -> RunHandle:
    """:meth:`Client.submit_tx <cyclone_dsl.Client.submit_tx>` in ``bind``'s transaction."""
    conn = driver_connection(bind)
    return client.submit_tx(conn, workflow, input, deadline=deadline)


def submit_once_tx(
    bind: Session | Connection,
    client: Client,
    workflow: object,
    input: JSONValue = None,
    *,
    key: str,
    deadline: timedelta | None = None,
) -> RunHandle:
    """:meth:`Client.submit_once_tx <cyclone_dsl.Client.submit_once_tx>` in ``bind``'s
    transaction."""
    conn = driver_connection(bind)
    return client.submit_once_tx(conn, workflow, input, key=key, deadline=deadline)


def enqueue_tx(
    bind: Session | Connection,
    client: Client,
    step: object,
    input: JSONValue = None,
    *,
    queue: str | None = None,
    priority: int | None = None,
    scheduled_at: datetime | None = None,
    max_attempts: int | None = None,
    timeout: timedelta | float | None = None,
    unique_key: str | None = None,
    sequence_key: str | None = None,
    retention: timedelta | float | None = None,
    concurrency_key: str | None = None,
) -> RunHandle:
    """:meth:`Client.enqueue_tx <cyclone_dsl.Client.enqueue_tx>` in ``bind``'s transaction."""
    conn = driver_connection(bind)
    return client.enqueue_tx(
        conn,
        step,
        input,
        queue=queue,
        priority=priority,
        scheduled_at=scheduled_at,
        max_attempts=max_attempts,
        timeout=timeout,
        unique_key=unique_key,
        sequence_key=sequence_key,
        retention=retention,
        concurrency_key=concurrency_key,
    )
