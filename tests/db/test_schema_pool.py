"""The pool of migrated test schemas (cyclone_dsl.testing.schemas.SchemaPool): a reused
schema is indistinguishable from a fresh one, and a schema a test changed is not reused."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cyclone_dsl import Client, step
from cyclone_dsl.migrate import LATEST_EXTENSION_VERSION, LATEST_SCHEMA_VERSION, migrate, versions
from cyclone_dsl.testing import schemas
from cyclone_dsl.testing.schemas import (
    SchemaPool,
    create_schema,
    drop_schema,
    nonempty_tables,
    reset_schema,
    with_search_path,
)


@step(name="sp_noop")
def noop(x: int) -> int:
    return x


@pytest.fixture
def pool(cyclone_admin_dsn: str) -> Iterator[SchemaPool]:
    pool = SchemaPool(cyclone_admin_dsn, lock_timeout=0.5)
    yield pool
    pool.close()


def exists(admin_dsn: str, name: str) -> bool:
    with psycopg.connect(admin_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", [name])
        return row.fetchone() == (1,)


def advanced_sequences(conn: psycopg.Connection[Any], name: str) -> list[str]:
    rows = conn.execute(
        "SELECT sequencename FROM pg_sequences WHERE schemaname = %s AND last_value IS NOT NULL",
        [name],
    ).fetchall()
    return [str(seq) for (seq,) in rows]


def test_a_reused_schema_is_empty_at_its_version_and_restarts_its_ids(
    pool: SchemaPool, cyclone_admin_dsn: str
) -> None:
    name = pool.checkout()
    dsn = with_search_path(cyclone_admin_dsn, name)
    with Client(dsn) as client:
        first = client.enqueue(noop, 1).id
        client.enqueue_many(noop, [2, 3])
        client.schedule(noop, "0 * * * *", id="hourly", location="UTC", input=1)
    with psycopg.connect(dsn) as conn:  # an insert rolled back: its table stays empty
        conn.execute("INSERT INTO cyclone_signals (run_id, name) VALUES (%s, 'x')", [first])
        conn.rollback()
        assert "cyclone_signals" not in nonempty_tables(conn, name)
        assert "cyclone_signals_id_seq" in advanced_sequences(conn, name)
    pool.checkin(name)

    assert pool.checkout() == name
    assert (pool.created, pool.reused, pool.dropped) == (1, 1, 0)
    with psycopg.connect(cyclone_admin_dsn) as conn:
        assert nonempty_tables(conn, name) == []
        assert advanced_sequences(conn, name) == []
    assert versions(dsn) == (LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION)
    with Client(dsn) as client:
        assert client.enqueue(noop, 4).id == first
        assert client.list_schedules() == []


def test_reset_truncates_only_tables_with_rows_and_restarts_every_used_sequence(
    cyclone_admin_dsn: str,
) -> None:
    name = create_schema(cyclone_admin_dsn, migrated=False)
    try:
        with psycopg.connect(with_search_path(cyclone_admin_dsn, name), autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE cyclone_schema_version (version int4 NOT NULL);"
                "INSERT INTO cyclone_schema_version VALUES (7);"
                "CREATE TABLE filled (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY);"
                "CREATE TABLE child (parent bigint REFERENCES filled (id));"
                "CREATE TABLE rolled_back (id serial);"
                "CREATE TABLE untouched (id serial);"
                "CREATE SEQUENCE loose;"
                "INSERT INTO filled DEFAULT VALUES; INSERT INTO child VALUES (1);"
                "SELECT nextval('loose'), nextval('loose')"
            )
            with pytest.raises(psycopg.errors.DivisionByZero), conn.transaction():
                conn.execute("INSERT INTO rolled_back SELECT nextval('rolled_back_id_seq') / 0")
            conn.execute("SELECT nextval('rolled_back_id_seq')")

            assert reset_schema(conn, name) == ["child", "filled"]

            assert nonempty_tables(conn, name) == []
            assert advanced_sequences(conn, name) == []
            assert conn.execute("SELECT version FROM cyclone_schema_version").fetchall() == [(7,)]
            assert conn.execute("INSERT INTO filled DEFAULT VALUES RETURNING id").fetchone() == (1,)
            assert conn.execute("SELECT nextval('loose')").fetchone() == (1,)
            assert conn.execute("SELECT nextval('rolled_back_id_seq')").fetchone() == (1,)
    finally:
        drop_schema(cyclone_admin_dsn, name)


def file_nodes(conn: psycopg.Connection[Any], name: str) -> dict[str, int]:
    """Each relation of schema ``name`` and its file (a truncate gives it a new one)."""
    rows = conn.execute(
        "SELECT relname, relfilenode FROM pg_class WHERE relnamespace = %s::regnamespace", [name]
    ).fetchall()
    return {str(rel): int(node) for rel, node in rows}


def test_reset_deletes_few_rows_in_key_order_and_truncates_many_or_a_cycle(
    cyclone_admin_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small tables are deleted from, referencing ones first (a restricting key would
    refuse the other order); a big table is truncated, with the tables that reference
    it; tables whose keys reference each other are truncated."""
    monkeypatch.setattr(schemas, "DELETE_AT_MOST", 5)
    name = create_schema(cyclone_admin_dsn, migrated=False)
    try:
        with psycopg.connect(with_search_path(cyclone_admin_dsn, name), autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE parent (id int PRIMARY KEY);"
                "CREATE TABLE kid (p int REFERENCES parent (id) ON DELETE RESTRICT);"
                "CREATE TABLE big (id int PRIMARY KEY);"
                "CREATE TABLE on_big (b int REFERENCES big (id));"
                "CREATE TABLE a (id int PRIMARY KEY, b int);"
                "CREATE TABLE b (id int PRIMARY KEY, a int REFERENCES a (id));"
                "ALTER TABLE a ADD FOREIGN KEY (b) REFERENCES b (id);"
                "INSERT INTO parent VALUES (1), (2); INSERT INTO kid VALUES (1), (2);"
                "INSERT INTO big SELECT generate_series(1, 50); INSERT INTO on_big VALUES (1);"
            )
            files = file_nodes(conn, name)
            assert reset_schema(conn, name) == ["big", "kid", "on_big", "parent"]
            assert nonempty_tables(conn, name) == []
            after = file_nodes(conn, name)
            assert after["parent"] == files["parent"] and after["kid"] == files["kid"]  # deleted
            assert after["big"] != files["big"] and after["on_big"] != files["on_big"]

            conn.execute("INSERT INTO parent VALUES (1); INSERT INTO kid VALUES (1)")
            conn.execute(
                "BEGIN; SET CONSTRAINTS ALL DEFERRED;"
                "INSERT INTO a VALUES (1, NULL); INSERT INTO b VALUES (1, 1);"
                "UPDATE a SET b = 1; COMMIT"
            )
            assert reset_schema(conn, name) == ["a", "b", "kid", "parent"]
            assert nonempty_tables(conn, name) == []
    finally:
        drop_schema(cyclone_admin_dsn, name)


CHANGES: dict[str, Callable[[str], object]] = {
    "migrate down": lambda dsn: migrate(dsn, version=LATEST_SCHEMA_VERSION - 1),
    "add a column": lambda dsn: execute(dsn, "ALTER TABLE cyclone_runs ADD COLUMN extra int"),
    "drop an index": lambda dsn: execute(dsn, "DROP INDEX idx_steps_sequence"),
    "a table of its own altering a core one": lambda dsn: execute(
        dsn,
        "CREATE TABLE scratch (x int PRIMARY KEY)",
        "ALTER TABLE cyclone_runs ADD COLUMN extra int REFERENCES scratch (x)",
    ),
    "a trigger on a core table": lambda dsn: execute(
        dsn,
        "CREATE FUNCTION stamp() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END'",
        "CREATE TRIGGER stamp BEFORE INSERT ON cyclone_runs FOR EACH ROW EXECUTE FUNCTION stamp()",
    ),
    "grant": lambda dsn: execute(dsn, "GRANT SELECT ON cyclone_runs TO PUBLIC"),
    "replace a view": lambda dsn: execute(
        dsn,
        "DO $$ BEGIN EXECUTE 'CREATE OR REPLACE VIEW cyclone_v_kinds AS '"
        " || rtrim(pg_get_viewdef('cyclone_v_kinds'), ';') || ' LIMIT 0'; END $$",
    ),
    "add a function": lambda dsn: execute(
        dsn, "CREATE FUNCTION one() RETURNS int LANGUAGE sql AS 'SELECT 1'"
    ),
    "a column's default": lambda dsn: execute(
        dsn, "ALTER TABLE cyclone_runs ALTER COLUMN workflow SET DEFAULT 'w'"
    ),
    "a check on a core table": lambda dsn: execute(
        dsn, "ALTER TABLE cyclone_steps ADD CONSTRAINT positive CHECK (attempt >= 0)"
    ),
    "a sequence's increment": lambda dsn: execute(
        dsn,
        "DO $$ BEGIN EXECUTE format('ALTER SEQUENCE %s INCREMENT 2',"
        " pg_get_serial_sequence('cyclone_runs', 'id')); END $$",
    ),
    "an enum type": lambda dsn: execute(dsn, "CREATE TYPE mood AS ENUM ('calm')"),
}
NO_CHANGES: dict[str, Callable[[str], object]] = {
    "rows": lambda dsn: execute(
        dsn, "INSERT INTO cyclone_runs (workflow, def_version) VALUES ('w', 'v')"
    ),
    "analyze and vacuum": lambda dsn: execute(dsn, "ANALYZE cyclone_runs", "VACUUM cyclone_steps"),
    "migrate again": lambda dsn: migrate(dsn),  # a no-op
    # An application's own tables (a transactional step's ledger): dropped at checkin, as
    # a migrated schema had none, and the schema is reused.
    "create a table": lambda dsn: execute(
        dsn,
        "CREATE TABLE scratch (id bigserial PRIMARY KEY, x int UNIQUE,"
        " run_id bigint REFERENCES cyclone_runs (id))",
        "CREATE INDEX ON scratch (run_id)",
        "INSERT INTO scratch (x) VALUES (1)",
    ),
    "create tables, a view and a sequence": lambda dsn: execute(
        dsn,
        "CREATE TABLE one (x int PRIMARY KEY)",
        "CREATE TABLE two (x int REFERENCES one)",
        "CREATE VIEW both_ AS SELECT one.x FROM one JOIN two USING (x)",
        "CREATE SEQUENCE numbers",
        "CREATE UNLOGGED TABLE fast (x int)",
        # an identity column's sequence, which refuses to be dropped before its table
        "CREATE TABLE a_identity (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY)",
    ),
}


def execute(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement.encode())


@pytest.mark.parametrize(
    ("change", "reused"),
    [(c, False) for c in CHANGES] + [(c, True) for c in NO_CHANGES],
)
def test_a_schema_whose_structure_changed_is_dropped_not_reused(
    pool: SchemaPool, cyclone_admin_dsn: str, change: str, reused: bool
) -> None:
    name = pool.checkout()
    {**CHANGES, **NO_CHANGES}[change](with_search_path(cyclone_admin_dsn, name))
    pool.checkin(name)
    assert exists(cyclone_admin_dsn, name) is reused
    assert pool.dropped == (0 if reused else 1)
    if reused:
        assert pool.checkout() == name


def test_a_schema_checked_in_as_not_reusable_is_dropped(
    pool: SchemaPool, cyclone_admin_dsn: str
) -> None:
    name = pool.checkout()
    pool.checkin(name, reusable=False)
    assert not exists(cyclone_admin_dsn, name)
    assert pool.dropped == 1


def test_a_transaction_left_open_fails_the_checkin_and_the_schema_is_not_reused(
    pool: SchemaPool, cyclone_admin_dsn: str
) -> None:
    name = pool.checkout()
    with psycopg.connect(with_search_path(cyclone_admin_dsn, name)) as leaked:
        leaked.execute("INSERT INTO cyclone_runs (workflow, def_version) VALUES ('w', 'v')")
        with pytest.raises(RuntimeError, match=r"still hold locks on the tables of test schema"):
            pool.checkin(name)  # the insert, not committed yet, could reach the next test
        assert exists(cyclone_admin_dsn, name)  # its locks keep the schema from being dropped
        assert pool.checkout() != name
    pool.close()  # the session is gone: the schema can be dropped now
    assert not exists(cyclone_admin_dsn, name)


def test_migrations_that_leave_rows_are_refused(
    pool: SchemaPool, cyclone_admin_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []

    def seeding(admin_dsn: str) -> str:
        name = create_schema(admin_dsn)
        made.append(name)
        execute(
            with_search_path(admin_dsn, name),
            "INSERT INTO cyclone_runs (workflow, def_version) VALUES ('seed', 'v')",
        )
        return name

    monkeypatch.setattr(schemas, "create_schema", seeding)
    with pytest.raises(RuntimeError, match=r"left rows in \['cyclone_runs'\]"):
        pool.checkout()
    assert not exists(cyclone_admin_dsn, made[0])


INNER = """
import os


def record(name):
    with open(os.environ["POOL_LOG"], "a") as log:
        log.write(name + "\\n")


def test_1_fails(cyclone_schema):
    record(cyclone_schema)
    raise AssertionError("fails on purpose")


def test_2_passes(cyclone_schema):
    record(cyclone_schema)


def test_3_passes(cyclone_schema):
    record(cyclone_schema)
"""


def test_the_plugin_reuses_the_schema_of_a_passed_test_only(
    cyclone_admin_dsn: str, tmp_path: Path
) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    log = tmp_path / "schemas.log"
    env = {**os.environ, "CYCLONE_DATABASE_URL": cyclone_admin_dsn, "POOL_LOG": str(log)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_inner.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "1 failed, 2 passed" in out.stdout, out.stdout + out.stderr
    failed, passed, reused = log.read_text().split()
    assert failed != passed  # the failed test's schema was dropped, not reused
    assert reused == passed
    assert not any(exists(cyclone_admin_dsn, name) for name in (failed, passed))


def test_the_structure_check_reads_the_catalogs_by_the_schemas_own_relations(
    pool: SchemaPool, cyclone_admin_dsn: str
) -> None:
    """Every checkin compares the schema's structure with the one it was made with; the
    catalogs hold every schema of the server (a suite's dozens), so the columns,
    defaults, constraints, indexes and triggers are read by the schema's relations, never
    by a scan of a whole catalog (17 ms of server CPU per test with 40 schemas)."""
    name = pool.checkout()
    with psycopg.connect(cyclone_admin_dsn) as conn:
        rows = conn.execute(b"EXPLAIN " + schemas._SIGNATURE.encode(), {"schema": name})
        plan = "\n".join(str(line) for (line,) in rows.fetchall())
    for catalog in ("pg_attribute", "pg_attrdef", "pg_constraint", "pg_index", "pg_trigger"):
        assert f"Seq Scan on {catalog} " not in plan, plan
    pool.checkin(name)
