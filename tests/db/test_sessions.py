"""Cyclone's own sessions turn JIT off; a transactional handler's session and a DSN that
sets ``jit`` itself keep their setting."""

from __future__ import annotations

import psycopg
import pytest

from cyclone_dsl.db.connect import connect, make_pool
from cyclone_dsl.db.handler_tx import handler_pool


def _jit(conn: psycopg.Connection[object]) -> str:
    row = conn.execute("SHOW jit").fetchone()
    assert row is not None
    return str(row[0])


def test_cyclone_sessions_run_without_jit(cyclone_dsn: str) -> None:
    with psycopg.connect(cyclone_dsn) as plain:
        assert _jit(plain) == "on"  # the server's default: the test shows a change
    pool = make_pool(cyclone_dsn, name="t-jit")
    try:
        with pool.connection() as conn:
            assert _jit(conn) == "off"
    finally:
        pool.close()
    with connect(cyclone_dsn, name="t-jit") as conn:
        assert _jit(conn) == "off"


def test_handler_sessions_keep_the_servers_jit(cyclone_dsn: str) -> None:
    pool = handler_pool(cyclone_dsn, name="t-jit-handler", max_size=1, idle_s=60)
    try:
        with pool.connection() as conn:
            assert _jit(conn) == "on"
    finally:
        pool.close()


@pytest.mark.parametrize("setting", ["on", "off"])
def test_a_dsn_that_sets_jit_keeps_it(cyclone_dsn: str, setting: str) -> None:
    dsn = psycopg.conninfo.make_conninfo(cyclone_dsn, options=f"-c jit={setting}")
    with connect(dsn, name="t-jit") as conn:
        assert _jit(conn) == setting
