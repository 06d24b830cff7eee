"""cyclone_dsl.contrib.sqlalchemy: runs submitted in a Session's transaction.

The run exists iff the session commits, for every root shape and every submit
method; a worker completes a committed run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from cyclone_dsl import Client, Worker
from cyclone_dsl.contrib.sqlalchemy import enqueue_tx, submit_once_tx, submit_tx
from tests.contrib.shapes import SHAPES, WORKFLOWS, check_activated, counts, work


class Refused(Exception):
    pass


@pytest.fixture
def engine(app_dsn: str) -> Iterator[Engine]:
    engine = create_engine("postgresql+psycopg://", connect_args=conninfo_to_dict(app_dsn))
    yield engine
    engine.dispose()


Submit = Callable[[Session, Client, Any, Any], int]

METHODS: dict[str, Submit] = {
    "submit_tx": lambda session, client, wf, value: submit_tx(session, client, wf, value).id,
    "submit_once_tx": lambda session, client, wf, value: (
        submit_once_tx(session, client, wf, value, key=f"order-{wf.name}").id
    ),
}


def place(session: Session, sku: str) -> None:
    session.execute(text("INSERT INTO orders (sku, qty) VALUES (:sku, 1)"), {"sku": sku})


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_run_exists_iff_the_session_commits(
    engine: Engine, app_dsn: str, client: Client, shape: str, method: str
) -> None:
    wf, value = SHAPES[shape].workflow, SHAPES[shape].input
    submit = METHODS[method]

    def refuse() -> None:
        with Session(engine) as session, session.begin():
            place(session, "refused")
            submit(session, client, wf, value)
            raise Refused

    with pytest.raises(Refused):
        refuse()
    assert counts(app_dsn) == (0, 0), "a rolled-back session left its order or its run"

    with Session(engine) as session, session.begin():
        place(session, "placed")
        run_id = submit(session, client, wf, value)
        assert counts(app_dsn) == (0, 0), "visible before the session commits"
    assert counts(app_dsn) == (1, SHAPES[shape].runs)
    check_activated(client, run_id, shape)


def test_a_session_without_begin_decides_with_commit_or_rollback(
    engine: Engine, app_dsn: str, client: Client
) -> None:
    wf, value = SHAPES["wait"].workflow, SHAPES["wait"].input
    with Session(engine) as session:
        place(session, "refused")
        submit_tx(session, client, wf, value)
        session.rollback()
        assert counts(app_dsn) == (0, 0)
        place(session, "placed")
        run_id = submit_tx(session, client, wf, value).id
        assert counts(app_dsn) == (0, 0)
        session.commit()
    assert counts(app_dsn) == (1, 1)
    check_activated(client, run_id, "wait")


def test_a_worker_completes_a_committed_run(
    engine: Engine, app_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*WORKFLOWS)
    with Session(engine) as session, session.begin():
        place(session, "sku-1")
        handle = submit_tx(session, client, SHAPES["step"].workflow, SHAPES["step"].input)
    assert handle.result(timeout=20) == "order 1 done"


def test_enqueue_tx_and_a_core_connection(engine: Engine, app_dsn: str, client: Client) -> None:
    def refuse() -> None:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO orders (sku, qty) VALUES ('refused', 1)"))
            enqueue_tx(conn, client, work, {"order_id": 1}, unique_key="o-1")
            raise Refused

    with pytest.raises(Refused):
        refuse()
    assert counts(app_dsn) == (0, 0)
    with Session(engine) as session, session.begin():
        place(session, "placed")
        first = enqueue_tx(session, client, work, {"order_id": 1}, unique_key="o-1", priority=3)
        again = enqueue_tx(session, client, work, {"order_id": 1}, unique_key="o-1")
    assert first.created and not again.created and again.id == first.id
    assert counts(app_dsn) == (1, 1)
    assert client.get_run(first.id).step("fw_work").priority == 3


def test_the_sessions_connection_keeps_its_own_json_decoder(app_dsn: str, client: Client) -> None:
    """An engine with its own ``json_deserializer``: the engine's statements decode jsonb
    as psycopg does (a child run's input stays intact); the session's decode as it asks."""
    engine = create_engine(
        "postgresql+psycopg://",
        connect_args=conninfo_to_dict(app_dsn),
        json_deserializer=lambda text: {"decoded by": "the app", "text": text},
    )
    try:
        with Session(engine) as session, session.begin():
            run_id = submit_tx(session, client, SHAPES["child"].workflow, SHAPES["child"].input).id
            mine = session.execute(text("""SELECT '{"a": 1}'::jsonb""")).scalar_one()
        assert mine["decoded by"] == "the app"
        check_activated(client, run_id, "child")
    finally:
        engine.dispose()


def test_an_engine_without_psycopg_is_refused(client: Client) -> None:
    engine = create_engine("sqlite://")
    with Session(engine) as session, pytest.raises(TypeError, match=r"postgresql\+psycopg"):
        submit_tx(session, client, SHAPES["step"].workflow, SHAPES["step"].input)
    engine.dispose()
