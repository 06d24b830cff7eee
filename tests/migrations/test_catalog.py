"""The catalog the migrations build is the schema reference's, at every version, and the
extension track's tables are ``expected_schema.EXT_TABLES``, at every extension version.

* After a full migration (the ``cyclone_dsn`` fixture), each table and each view is
  compared with ``expected_schema``: one assertion per object, listing every difference.
* The files are also applied directly, without the migrator, in a scratch schema: after
  each up part the catalog must be the reference's for that version (a migration does
  what the reference says for its version and no more), each down part must restore
  the catalog of the version before it exactly, down to an empty schema, and a second
  pass up must give the same catalog again. The extension files are checked the same
  way, one by one on top of the core at 19.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from cyclone_dsl import LATEST_EXTENSION_VERSION, LATEST_SCHEMA_VERSION
from cyclone_dsl.migrate import load_extension_migrations, load_migrations, migrate
from tests.migrations import expected_schema as expected
from tests.migrations.catalog import catalog_differences, read_catalog, table_differences
from tests.migrations.scratch import EXT_MIGRATIONS, File, read_files, run_part, scratch_schema

FILES = read_files()
EXT_FILES = read_files(EXT_MIGRATIONS)
FINAL = expected.expected_at(expected.LATEST, expected.EXT_LATEST)


@pytest.fixture
def admin_dsn(request: pytest.FixtureRequest) -> str:
    """A DSN of the test server with rights to create schemas (``pg_admin_dsn``, or the
    plugin's ``cyclone_admin_dsn`` under its other name)."""
    for name in ("pg_admin_dsn", "cyclone_admin_dsn"):
        try:
            return str(request.getfixturevalue(name))
        except pytest.FixtureLookupError:
            continue
    pytest.fail("no admin DSN fixture (pg_admin_dsn) is available")


@pytest.fixture(scope="module")
def catalog(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The catalog of a schema the migrator built (once for the module: the table and view
    tests, one per object, read the same catalog)."""
    with scratch_schema(str(request.getfixturevalue("cyclone_admin_dsn"))) as (name, dsn):
        migrate(dsn)
        with psycopg.connect(dsn) as conn:
            return read_catalog(conn, name)


@pytest.fixture
def scratch(admin_dsn: str) -> Iterator[tuple[str, psycopg.Connection[Any]]]:
    """(name, autocommit connection) of an empty scratch schema on the search_path."""
    with scratch_schema(admin_dsn) as (name, dsn), psycopg.connect(dsn, autocommit=True) as conn:
        yield name, conn


def migrate_files(conn: psycopg.Connection[Any], start: int, goal: int) -> None:
    """Apply the files' up (or down) parts from version ``start`` to ``goal``."""
    for version in range(start + 1, goal + 1):
        run_part(conn, FILES[version - 1].up)
    for version in range(start, goal, -1):
        run_part(conn, FILES[version - 1].down)


def migrate_ext_files(conn: psycopg.Connection[Any], start: int, goal: int) -> None:
    """The same for the extension files (the core must be at 19)."""
    for version in range(start + 1, goal + 1):
        run_part(conn, EXT_FILES[version - 1].up)
    for version in range(start, goal, -1):
        run_part(conn, EXT_FILES[version - 1].down)


def _executed(text: str) -> str:
    """The part's SQL without its comments, upper-cased, on one line."""
    lines = [line.split("--", 1)[0] for line in text.splitlines()]
    return " ".join(" ".join(lines).upper().split())


def test_the_files_are_numbered_one_to_nineteen() -> None:
    assert [f.version for f in FILES] == list(range(1, expected.LATEST + 1))
    assert LATEST_SCHEMA_VERSION == expected.LATEST
    assert [m.version for m in load_migrations()] == [f.version for f in FILES]  # no ext/
    for f in FILES + EXT_FILES:
        # The runner wraps each part in a transaction; the parts must not manage their own.
        executed = [line for line in (f.up + f.down).splitlines() if not line.startswith("--")]
        text = " ".join(executed).upper()
        for word in ("BEGIN;", "COMMIT", "ROLLBACK", "CONCURRENTLY", "PUBLIC."):
            assert word not in text, f"{f.version:03d}_{f.name} has {word}"


def test_the_extension_files_are_numbered_from_one() -> None:
    assert [f.version for f in EXT_FILES] == list(range(1, expected.EXT_LATEST + 1))
    assert LATEST_EXTENSION_VERSION == expected.EXT_LATEST
    loaded = load_extension_migrations()
    assert [(m.version, m.name) for m in loaded] == [(f.version, f.name) for f in EXT_FILES]


@pytest.mark.parametrize("f", EXT_FILES, ids=lambda f: f.name)
def test_an_extension_file_is_additive(f: File) -> None:
    """New cyclone_ext_ tables and idx_ext_ indexes on them; nothing else, no ALTER; the
    down part drops them without IF EXISTS, after at most one guard that only reads and
    refuses (runs in flight that need the rows)."""
    up, down = _executed(f.up), _executed(f.down)
    guard = re.match(
        r"DO \$\$ BEGIN IF EXISTS \((.*?)\) THEN RAISE EXCEPTION .*? END IF; END \$\$;", down
    )
    if guard is not None:
        assert not re.search(r"\b(INSERT|UPDATE|DELETE|DROP|CREATE|TRUNCATE)\b", guard[1]), f.name
        down = down[guard.end() :]
    statements = [s.strip() for s in up.split(";") if s.strip()]
    for statement in statements:
        table = re.fullmatch(r"CREATE TABLE (CYCLONE_EXT_\w+) \(.*\)", statement)
        index = re.fullmatch(
            r"CREATE INDEX IDX_EXT_\w+ ON CYCLONE_EXT_\w+ \([^()]*\)( WHERE .*)?", statement
        )
        assert table or index, f"{f.name}: not a new extension table or index: {statement}"
    assert "ALTER " not in up + down, f.name
    created = re.findall(r"CREATE TABLE (CYCLONE_EXT_\w+)", up)
    # an index on a table of an earlier file is dropped on its own; the others go with theirs
    indexes = [
        name
        for name, table in re.findall(r"CREATE INDEX (IDX_EXT_\w+) ON (CYCLONE_EXT_\w+)", up)
        if table not in created
    ]
    dropped = [s.strip() for s in down.split(";") if s.strip()]
    assert dropped == [f"DROP INDEX {i}" for i in reversed(indexes)] + [
        f"DROP TABLE {t}" for t in reversed(created)
    ], f.name
    for reference in re.findall(r"REFERENCES (\w+) \(\w+\)( ON DELETE CASCADE)?", up):
        assert reference[1], f"{f.name}: a foreign key to {reference[0]} without ON DELETE CASCADE"


@pytest.mark.parametrize("table", sorted(FINAL["tables"]))
def test_table_matches_the_reference(catalog: dict[str, Any], table: str) -> None:
    problems = table_differences(FINAL["tables"][table], catalog["tables"].get(table))
    assert problems == [], f"{table}:\n" + "\n".join(problems)


@pytest.mark.parametrize("view", sorted(FINAL["views"]))
def test_view_matches_the_reference(catalog: dict[str, Any], view: str) -> None:
    assert catalog["views"].get(view) == FINAL["views"][view], view


def test_the_schema_holds_nothing_else(catalog: dict[str, Any]) -> None:
    assert sorted(catalog["tables"]) == sorted(FINAL["tables"])
    assert sorted(catalog["views"]) == sorted(FINAL["views"])
    assert catalog["others"] == []


def test_each_version_up_and_down_matches_the_reference(
    scratch: tuple[str, psycopg.Connection[Any]],
) -> None:
    name, conn = scratch
    up = {0: read_catalog(conn, name, definitions=True)}
    problems = [
        f"version 0: {p}"
        for p in catalog_differences(expected.expected_at(0, with_version_table=False), up[0])
    ]
    seen: set[str] = set()  # a problem is reported at the first version that shows it
    for f in FILES:
        run_part(conn, f.up)
        up[f.version] = read_catalog(conn, name, definitions=True)
        want = expected.expected_at(f.version, with_version_table=False)
        found = catalog_differences(want, up[f.version])
        problems += [f"up to {f.version}: {p}" for p in found if p not in seen]
        seen = set(found)
    for f in reversed(FILES):
        run_part(conn, f.down)
        now = read_catalog(conn, name, definitions=True)
        found = catalog_differences(up[f.version - 1], now)
        problems += [f"down from {f.version}: {p}" for p in found if p not in seen]
        seen = set(found)
    migrate_files(conn, 0, expected.LATEST)
    again = read_catalog(conn, name, definitions=True)
    problems += [f"second pass: {p}" for p in catalog_differences(up[expected.LATEST], again)]
    assert problems == [], "\n".join(problems)


def test_each_extension_version_up_and_down_matches(
    scratch: tuple[str, psycopg.Connection[Any]],
) -> None:
    """On the core at 19, each extension file's up part gives the extension catalog of
    its version (and leaves the core's as it was), each down part restores the catalog
    before it, and a second pass gives the same catalog again."""
    name, conn = scratch
    migrate_files(conn, 0, expected.LATEST)
    up = {0: read_catalog(conn, name, definitions=True)}
    problems = [
        f"extension 0: {p}"
        for p in catalog_differences(
            expected.expected_at(expected.LATEST, 0, with_version_table=False), up[0]
        )
    ]
    for f in EXT_FILES:
        run_part(conn, f.up)
        up[f.version] = read_catalog(conn, name, definitions=True)
        want = expected.expected_at(expected.LATEST, f.version, with_version_table=False)
        problems += [f"up to {f.version}: {p}" for p in catalog_differences(want, up[f.version])]
    for f in reversed(EXT_FILES):
        run_part(conn, f.down)
        now = read_catalog(conn, name, definitions=True)
        found = catalog_differences(up[f.version - 1], now)
        problems += [f"down from {f.version}: {p}" for p in found]
    migrate_ext_files(conn, 0, expected.EXT_LATEST)
    again = read_catalog(conn, name, definitions=True)
    problems += [f"second pass: {p}" for p in catalog_differences(up[expected.EXT_LATEST], again)]
    migrate_ext_files(conn, expected.EXT_LATEST, 0)
    migrate_files(conn, expected.LATEST, 0)  # nothing of the extension is left behind
    empty = read_catalog(conn, name)
    want = expected.expected_at(0, with_version_table=False)
    problems += [f"down to 0: {p}" for p in catalog_differences(want, empty)]
    assert problems == [], "\n".join(problems)


def test_the_files_build_what_the_migrator_builds(
    scratch: tuple[str, psycopg.Connection[Any]], catalog: dict[str, Any]
) -> None:
    name, conn = scratch
    migrate_files(conn, 0, expected.LATEST)
    migrate_ext_files(conn, 0, expected.EXT_LATEST)
    by_files = read_catalog(conn, name)
    by_migrator = dict(catalog, tables=dict(catalog["tables"]))
    by_migrator["tables"].pop(expected.VERSION_TABLE, None)
    by_migrator["tables"].pop(expected.EXT_VERSION_TABLE, None)
    assert catalog_differences(by_migrator, by_files) == []


@pytest.mark.parametrize("f", [f for f in FILES if f.out_of_band()], ids=lambda f: f.name)
def test_the_out_of_band_statements_in_a_comment_work(
    scratch: tuple[str, psycopg.Connection[Any]], f: File
) -> None:
    """Run the comment's statements (CONCURRENTLY, outside a transaction) first: the
    migration then completes and the catalog is the same as without them."""
    name, conn = scratch
    migrate_files(conn, 0, f.version - 1)
    for statement in f.out_of_band():
        conn.execute(statement.encode("utf-8"))
    run_part(conn, f.up)
    want = expected.expected_at(f.version, with_version_table=False)
    assert catalog_differences(want, read_catalog(conn, name)) == []
    run_part(conn, f.down)
    want = expected.expected_at(f.version - 1, with_version_table=False)
    assert catalog_differences(want, read_catalog(conn, name)) == []


def _run(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "INSERT INTO cyclone_runs (workflow, def_version) VALUES ('w', 'v') RETURNING id"
    ).fetchone()
    assert row is not None
    return int(row[0])


def _step(conn: psycopg.Connection[Any], run_id: int, node: str, state: str) -> None:
    conn.execute(
        "INSERT INTO cyclone_steps (run_id, node, kind, state) VALUES (%s, %s, 'k', %s)",
        (run_id, node, state),
    )


@pytest.mark.parametrize(
    ("version", "table", "state", "message"),
    [
        (2, "cyclone_steps", "waiting_timer", "cannot migrate down from 2 while a step is"),
        (18, "cyclone_runs", "paused", "cannot migrate down from 18 while a run or a step"),
        (18, "cyclone_steps", "paused", "cannot migrate down from 18 while a run or a step"),
        (19, "cyclone_steps", "waiting_child", "cannot migrate down from 19 while a step is"),
    ],
)
def test_a_down_part_refuses_while_rows_use_its_state(
    scratch: tuple[str, psycopg.Connection[Any]],
    version: int,
    table: str,
    state: str,
    message: str,
) -> None:
    name, conn = scratch
    migrate_files(conn, 0, version)
    run_id = _run(conn)
    if table == "cyclone_runs":
        conn.execute("UPDATE cyclone_runs SET state = %s", (state,))
    else:
        _step(conn, run_id, "n", state)
    before = read_catalog(conn, name, definitions=True)
    with pytest.raises(psycopg.errors.RaiseException, match=message):
        run_part(conn, FILES[version - 1].down)
    assert catalog_differences(before, read_catalog(conn, name, definitions=True)) == []
    conn.execute("UPDATE cyclone_runs SET state = 'cancelled'")
    conn.execute("UPDATE cyclone_steps SET state = 'cancelled'")
    run_part(conn, FILES[version - 1].down)
    want = expected.expected_at(version - 1, with_version_table=False)
    assert catalog_differences(want, read_catalog(conn, name)) == []


def test_each_version_admits_exactly_its_states(
    scratch: tuple[str, psycopg.Connection[Any]],
) -> None:
    _, conn = scratch
    step_states = {
        1: expected.STEP_STATES_V1,
        2: expected.STEP_STATES_V2,
        18: expected.STEP_STATES_V18,
        19: expected.STEP_STATES_V19,
    }
    every = set(expected.STEP_STATES_V19)
    wrong = []
    current = 0
    for version, admitted in step_states.items():
        migrate_files(conn, current, version)
        current = version
        run_id = _run(conn)
        for state in sorted(every):
            try:
                with conn.transaction():
                    _step(conn, run_id, f"{version}-{state}", state)
                accepted = True
            except psycopg.errors.CheckViolation:
                accepted = False
            if accepted != (state in admitted):
                wrong.append(f"version {version}: {state} accepted={accepted}")
        conn.execute("DELETE FROM cyclone_runs")
    assert wrong == []


def test_migration_4_changes_only_the_defaults(
    scratch: tuple[str, psycopg.Connection[Any]],
) -> None:
    _, conn = scratch
    migrate_files(conn, 0, 3)
    run_id = _run(conn)
    _step(conn, run_id, "a", "pending")
    migrate_files(conn, 3, 4)
    _step(conn, run_id, "b", "pending")
    rows = conn.execute("SELECT node, max_attempts FROM cyclone_steps ORDER BY node").fetchall()
    assert rows == [("a", 25), ("b", 5)]


def test_migration_13_repairs_old_rows_then_guards_new_ones(
    scratch: tuple[str, psycopg.Connection[Any]],
) -> None:
    _, conn = scratch
    migrate_files(conn, 0, 12)
    run_id = _run(conn)
    conn.execute(
        "INSERT INTO cyclone_steps (run_id, node, kind, unique_key, sequence_key, max_attempts) "
        "VALUES (%s, 'a', 'k', '', '', 0), (%s, 'b', 'k', 'u', 's', -3)",
        (run_id, run_id),
    )
    migrate_files(conn, 12, 13)
    rows = conn.execute(
        "SELECT node, unique_key, sequence_key, max_attempts FROM cyclone_steps ORDER BY node"
    ).fetchall()
    assert rows == [("a", None, None, 1), ("b", "u", "s", 1)]
    with pytest.raises(psycopg.errors.CheckViolation, match="cyclone_steps_max_attempts_check"):
        conn.execute(
            "INSERT INTO cyclone_steps (run_id, node, kind, max_attempts) VALUES (%s, 'c', 'k', 0)",
            (run_id,),
        )


def test_queue_names_are_capped_at_256_bytes(
    scratch: tuple[str, psycopg.Connection[Any]],
) -> None:
    _, conn = scratch
    migrate_files(conn, 0, expected.LATEST)
    run_id = _run(conn)
    fits, too_long = "é" * 128, "é" * 128 + "x"  # 256 and 257 bytes
    conn.execute(
        "INSERT INTO cyclone_steps (run_id, node, kind, queue) VALUES (%s, 'a', 'k', %s)",
        (run_id, fits),
    )
    with pytest.raises(psycopg.errors.CheckViolation, match="cyclone_steps_queue_check"):
        conn.execute(
            "INSERT INTO cyclone_steps (run_id, node, kind, queue) VALUES (%s, 'b', 'k', %s)",
            (run_id, too_long),
        )
    with pytest.raises(psycopg.errors.CheckViolation, match="cyclone_schedules_queue_check"):
        conn.execute(
            "INSERT INTO cyclone_schedules (id, kind, cron_spec, next_run_at, queue) "
            "VALUES ('s', 'k', '* * * * *', now(), %s)",
            (too_long,),
        )


def test_deleting_a_run_cascades_and_unlinks_its_schedule(
    scratch: tuple[str, psycopg.Connection[Any]],
) -> None:
    _, conn = scratch
    migrate_files(conn, 0, expected.LATEST)
    run_id = _run(conn)
    _step(conn, run_id, "a", "completed")
    _step(conn, run_id, "b", "pending")
    conn.execute(
        "INSERT INTO cyclone_deps (run_id, node, dep_node) VALUES (%s, 'b', 'a')", (run_id,)
    )
    conn.execute(
        "INSERT INTO cyclone_step_inputs (run_id, node, slot, dep_node) VALUES (%s, 'b', 0, 'a')",
        (run_id,),
    )
    conn.execute("INSERT INTO cyclone_signals (run_id, name) VALUES (%s, 'go')", (run_id,))
    conn.execute(
        "INSERT INTO cyclone_schedules (id, kind, cron_spec, next_run_at, last_run_id) "
        "VALUES ('s', 'k', '* * * * *', now(), %s)",
        (run_id,),
    )
    conn.execute(
        "INSERT INTO cyclone_schedule_fires (schedule_id, scheduled_for, run_id) "
        "VALUES ('s', now(), %s)",
        (run_id,),
    )
    conn.execute("DELETE FROM cyclone_runs")
    left = conn.execute(
        "SELECT (SELECT count(*) FROM cyclone_steps) + (SELECT count(*) FROM cyclone_deps)"
        " + (SELECT count(*) FROM cyclone_step_inputs) + (SELECT count(*) FROM cyclone_signals)"
        " + (SELECT count(*) FROM cyclone_schedule_fires),"
        " (SELECT last_run_id FROM cyclone_schedules WHERE id = 's')"
    ).fetchone()
    assert left == (0, None)


def test_extension_rows_go_with_their_step_or_worker(
    scratch: tuple[str, psycopg.Connection[Any]],
) -> None:
    """Purging a run removes its attempt history (through its steps); deleting a worker
    removes its handler and version rows."""
    _, conn = scratch
    migrate_files(conn, 0, expected.LATEST)
    migrate_ext_files(conn, 0, expected.EXT_LATEST)
    run_id = _run(conn)
    _step(conn, run_id, "a", "available")
    conn.execute(
        "INSERT INTO cyclone_ext_attempts (step_id, run_id, attempt, outcome) "
        "SELECT id, run_id, 1, 'retried' FROM cyclone_steps"
    )
    conn.execute(
        "INSERT INTO cyclone_ext_workers (id, host, pid, queues, concurrency, package_version) "
        "VALUES ('w1', 'h', 1, '{default}', 4, '0')"
    )
    conn.execute(
        "INSERT INTO cyclone_ext_worker_handlers (worker_id, kind, identity) "
        "VALUES ('w1', 'k', 'mod:k')"
    )
    conn.execute(
        "INSERT INTO cyclone_ext_worker_versions (worker_id, workflow, def_version) "
        "VALUES ('w1', 'wf', 'v')"
    )
    with pytest.raises(psycopg.errors.GeneratedAlways):
        conn.execute(
            "INSERT INTO cyclone_ext_attempts (id, step_id, run_id, attempt, outcome) "
            "SELECT 99, id, run_id, 2, 'failed' FROM cyclone_steps"
        )
    conn.execute("DELETE FROM cyclone_runs")
    conn.execute("DELETE FROM cyclone_ext_workers")
    left = conn.execute(
        "SELECT (SELECT count(*) FROM cyclone_ext_attempts)"
        " + (SELECT count(*) FROM cyclone_ext_worker_handlers)"
        " + (SELECT count(*) FROM cyclone_ext_worker_versions)"
    ).fetchone()
    assert left == (0,)
