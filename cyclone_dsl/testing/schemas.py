"""Schemas for tests: ``cyclone_test_<random>``, fresh or from a pool of migrated ones.

:func:`create_schema` makes a new schema (migrated, at a given version, or empty)
for the tests that need one of their own. :class:`SchemaPool` is River's
``riverdbtest`` trick for every other test: each schema is migrated once, then
reused, emptied on checkout by :func:`reset_schema`: a ``DELETE`` from each
table that holds a few rows (a ``TRUNCATE`` of one that holds many), among every
table but the migration version tables.

What a reused schema could carry over from the test before, and why it does not:

* rows and sequences: deleted or truncated, and every sequence that handed out a
  value restarted (:func:`reset_schema`);
* its structure (a test that migrates down, or alters a table): the pool compares
  the catalog's :func:`schema_signature` at checkin with the one taken when the
  schema was made, and drops a schema that changed instead of reusing it. Tables,
  views and sequences a test added (an application's own, as a transactional
  step's test makes) are dropped first, and the schema reused if nothing else
  changed;
* whatever a failed test left behind: the pytest plugin checks in the schema of a
  test that did not pass (its setup, call or teardown failed) as not reusable, so
  the pool drops it;
* a worker a test started and never stopped, even a test that passed: its
  registration is still live (not stopped, its process alive on this host), so
  :meth:`SchemaPool.checkin` drops the schema rather than hand the worker the next
  test's steps (:func:`live_workers`);
* locks: the engine's advisory locks are keyed by schema; the scanners' and the
  registry's are transaction-level, the migrator's is session-level and goes
  with its connection. A session that still holds a lock on a table (a
  transaction left open) makes the checkin fail after ``lock_timeout``, loudly;
* LISTEN/NOTIFY: channels are per database, not per schema, so tests never had
  private channels; a notification reaches only the sessions listening when it
  is committed, and those belong to the test that is running.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any, LiteralString

import attrs
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone_dsl.migrate import EXTENSION_VERSION_TABLE, SCHEMA_VERSION_TABLE, migrate

#: The tables a reset keeps: they record which migrations the schema has.
VERSION_TABLES = frozenset({SCHEMA_VERSION_TABLE, EXTENSION_VERSION_TABLE})


def with_search_path(dsn: str, schema: str) -> str:
    """``dsn`` with its ``search_path`` set to ``schema`` (other options kept)."""
    params: dict[str, Any] = conninfo_to_dict(dsn)
    options = str(params.get("options") or "")
    params["options"] = f"{options} -c search_path={schema}".strip()
    return make_conninfo("", **params)


def new_schema_name() -> str:
    return f"cyclone_test_{secrets.token_hex(6)}"


def create_schema(admin_dsn: str, *, migrated: bool = True, version: int | None = None) -> str:
    """Create a new schema (migrated unless ``migrated=False``); return its name."""
    name = new_schema_name()
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    if migrated:
        migrate(with_search_path(admin_dsn, name), version=version)
    return name


def drop_schema(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


# -- resetting a schema for reuse -------------------------------------------------------

_TABLES: LiteralString = """
SELECT c.relname
FROM pg_catalog.pg_class AS c
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p')
ORDER BY c.relname
"""

# Restart the sequences of a schema that have handed out a value since they were
# (re)started, except those owned by the version tables. ``setval(..., false)`` is what
# ``ALTER SEQUENCE ... RESTART`` does to the next value, without a new file per sequence.
_RESTART_ADVANCED_SEQUENCES: LiteralString = """
SELECT s.relname, pg_catalog.setval(s.oid, q.start_value, false)
FROM pg_catalog.pg_class AS s
JOIN pg_catalog.pg_namespace AS n ON n.oid = s.relnamespace
JOIN pg_catalog.pg_sequences AS q ON q.schemaname = n.nspname AND q.sequencename = s.relname
WHERE n.nspname = %(schema)s AND s.relkind = 'S' AND q.last_value IS NOT NULL
  AND NOT EXISTS (
      SELECT FROM pg_catalog.pg_depend AS d
      JOIN pg_catalog.pg_class AS t ON t.oid = d.refobjid
      WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.objid = s.oid
        AND d.refclassid = 'pg_catalog.pg_class'::regclass AND d.deptype IN ('a', 'i')
        AND t.relname = ANY(%(kept)s::text[])
  )
ORDER BY s.relname
"""

# The foreign keys between the tables of a schema: (referencing, referenced).
_FOREIGN_KEYS: LiteralString = """
SELECT DISTINCT c.relname, r.relname
FROM pg_catalog.pg_constraint AS k
JOIN pg_catalog.pg_class AS c ON c.oid = k.conrelid
JOIN pg_catalog.pg_class AS r ON r.oid = k.confrelid
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND k.contype = 'f' AND k.conrelid <> k.confrelid
"""

#: A table with more rows than this is truncated; smaller ones are deleted from, which
#: costs a fraction of a truncate's file operations (a new file per table and index).
DELETE_AT_MOST = 1000


def truncatable_tables(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """Every table of ``schema`` (found in the catalog) except the migration version tables."""
    rows = conn.execute(_TABLES, {"schema": schema}).fetchall()
    return [str(name) for (name,) in rows if name not in VERSION_TABLES]


def nonempty_tables(
    conn: psycopg.Connection[Any], schema: str, tables: Sequence[str] | None = None
) -> list[str]:
    """Those of ``tables`` (default: :func:`truncatable_tables`) that hold rows."""
    tables = truncatable_tables(conn, schema) if tables is None else tables
    if not tables:
        return []
    probe = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {} WHERE EXISTS (SELECT FROM {})").format(
            sql.Literal(table), sql.Identifier(schema, table)
        )
        for table in tables
    )
    return [str(name) for (name,) in conn.execute(probe).fetchall()]


def truncate_statement(schema: str, tables: Sequence[str]) -> sql.Composed:
    """``TRUNCATE`` of ``schema``'s ``tables`` (and, by CASCADE, of the tables whose
    foreign keys reference them), restarting the sequences their columns own."""
    return sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(
        sql.SQL(", ").join(sql.Identifier(schema, table) for table in tables)
    )


def row_counts(
    conn: psycopg.Connection[Any], schema: str, tables: Sequence[str], *, cap: int
) -> dict[str, int]:
    """The tables of ``tables`` that hold rows, with their row counts up to ``cap + 1``."""
    if not tables:
        return {}
    probe = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {}, (SELECT count(*) FROM (SELECT FROM {} LIMIT {}) AS r)").format(
            sql.Literal(table), sql.Identifier(schema, table), sql.Literal(cap + 1)
        )
        for table in tables
    )
    return {str(name): int(n) for name, n in conn.execute(probe).fetchall() if n}


ForeignKeys = Sequence[tuple[str, str]]


def foreign_keys(conn: psycopg.Connection[Any], schema: str) -> ForeignKeys:
    """The foreign keys between the tables of ``schema``: (referencing, referenced)."""
    rows = conn.execute(_FOREIGN_KEYS, {"schema": schema}).fetchall()
    return [(str(referencing), str(referenced)) for referencing, referenced in rows]


def deletion_order(
    conn: psycopg.Connection[Any],
    schema: str,
    tables: Sequence[str],
    keys: ForeignKeys | None = None,
) -> list[str]:
    """``tables`` with each one before the tables its foreign keys reference (so deleting
    in this order violates no key); raises ValueError for a cycle of references.
    ``keys``: the schema's :func:`foreign_keys`, when the caller knows them."""
    if not tables:
        return []
    references: dict[str, set[str]] = {table: set() for table in tables}
    for referencing, referenced in foreign_keys(conn, schema) if keys is None else keys:
        if referencing in references and referenced in references:
            references[referencing].add(referenced)
    order: list[str] = []
    left = set(tables)
    while left:
        free = sorted(t for t in left if not any(t in references[o] for o in left))
        if not free:
            raise ValueError(f"the foreign keys of {sorted(left)} reference each other")
        order += free
        left -= set(free)
    return order


def reset_schema(
    conn: psycopg.Connection[Any],
    schema: str,
    tables: Sequence[str] | None = None,
    keys: ForeignKeys | None = None,
) -> list[str]:
    """Empty ``schema`` for its next test, as a fresh migration leaves it; return the tables
    that held rows.

    ``tables`` (default: :func:`truncatable_tables`, every table but the version tables)
    are emptied if they hold rows; those already empty are left alone. A table with more
    than :data:`DELETE_AT_MOST` rows is truncated (with ``CASCADE``: the tables whose
    foreign keys reference it too); the others are deleted from, referencing tables
    first, in one transaction: a truncate costs file operations for every table and index
    it touches, a small delete does not (tables whose keys reference each other are
    truncated). Then every sequence of the schema (but the version tables') that has
    handed out a value since it was restarted is restarted. ``keys``: the schema's
    :func:`foreign_keys`, when the caller knows them (read from the catalog otherwise).
    """
    tables = truncatable_tables(conn, schema) if tables is None else tables
    counts = row_counts(conn, schema, tables, cap=DELETE_AT_MOST)
    used = sorted(counts)
    big = [t for t in used if counts[t] > DELETE_AT_MOST]
    try:
        order = deletion_order(conn, schema, [t for t in used if t not in big], keys)
    except ValueError:
        big, order = used, []
    if big:
        conn.execute(truncate_statement(schema, big))
    if order:
        with conn.transaction():
            for table in order:
                conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(schema, table)))
    kept = sorted(VERSION_TABLES)
    conn.execute(_RESTART_ADVANCED_SEQUENCES, {"schema": schema, "kept": kept})
    return used


# The catalog entries that make up a schema's structure, as text: relations (with their
# privileges), columns, constraints, indexes, views, triggers, functions, types and
# sequences. Compared before and after a test to see that it left the structure alone.
# The catalogs hold every schema of the server (a suite's dozens): the schema's relations
# and types are read once, and everything else is probed by their oids through the
# catalogs' indexes (OFFSET 0 keeps each probe from being flattened into a join).
# Scanning every catalog made it 14-17 ms of server CPU with 40 schemas; about 6 now.
_SIGNATURE: LiteralString = """
WITH ns AS (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s),
rels AS MATERIALIZED (
    SELECT c.oid, c.relname, c.relkind, c.relpersistence, c.relrowsecurity, c.relacl
    FROM pg_catalog.pg_class AS c WHERE c.relnamespace = (SELECT oid FROM ns)
),
types AS MATERIALIZED (
    SELECT t.oid, t.typname, t.typtype
    FROM pg_catalog.pg_type AS t WHERE t.typnamespace = (SELECT oid FROM ns)
)
SELECT coalesce(md5(string_agg(item, E'\\n' ORDER BY item)), '') FROM (
    SELECT format('relation %%s %%s %%s %%s %%s', r.relname, r.relkind, r.relpersistence,
                  r.relrowsecurity, r.relacl) AS item
    FROM rels AS r
  UNION ALL
    SELECT format('column %%s.%%s %%s %%s %%s %%s', r.relname, a.attname,
                  pg_catalog.format_type(a.atttypid, a.atttypmod), a.attnotnull,
                  a.attidentity,
                  (SELECT pg_catalog.pg_get_expr(d.adbin, d.adrelid)
                   FROM pg_catalog.pg_attrdef AS d
                   WHERE d.adrelid = a.attrelid AND d.adnum = a.attnum))
    FROM rels AS r
    CROSS JOIN LATERAL (
        SELECT a.attrelid, a.attnum, a.attname, a.atttypid, a.atttypmod, a.attnotnull,
               a.attidentity
        FROM pg_catalog.pg_attribute AS a
        WHERE a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped
        OFFSET 0
    ) AS a
  UNION ALL
    SELECT format('constraint %%s %%s %%s', co.conrelid::regclass, co.conname,
                  pg_catalog.pg_get_constraintdef(co.oid))
    FROM (
        -- a table's constraints, by conrelid, and a domain's, by contypid
        SELECT c.oid, c.conrelid, c.conname
        FROM rels AS r
        CROSS JOIN LATERAL (
            SELECT c.oid, c.conrelid, c.conname FROM pg_catalog.pg_constraint AS c
            WHERE c.conrelid = r.oid
            OFFSET 0
        ) AS c
      UNION ALL
        SELECT c.oid, c.conrelid, c.conname
        FROM types AS t
        CROSS JOIN LATERAL (
            SELECT c.oid, c.conrelid, c.conname FROM pg_catalog.pg_constraint AS c
            WHERE c.contypid = t.oid
            OFFSET 0
        ) AS c
    ) AS co
  UNION ALL
    SELECT 'index ' || pg_catalog.pg_get_indexdef(r.oid)
    FROM rels AS r WHERE r.relkind IN ('i', 'I')
  UNION ALL
    SELECT format('view %%s %%s', r.relname, pg_catalog.pg_get_viewdef(r.oid))
    FROM rels AS r WHERE r.relkind IN ('v', 'm')
  UNION ALL
    SELECT 'trigger ' || pg_catalog.pg_get_triggerdef(t.oid)
    FROM rels AS r
    CROSS JOIN LATERAL (
        SELECT t.oid FROM pg_catalog.pg_trigger AS t
        WHERE t.tgrelid = r.oid AND NOT t.tgisinternal
        OFFSET 0
    ) AS t
  UNION ALL
    SELECT format('function %%s(%%s) %%s %%s', p.proname,
                  pg_catalog.pg_get_function_identity_arguments(p.oid), p.prokind,
                  md5(p.prosrc))
    FROM pg_catalog.pg_proc AS p WHERE p.pronamespace = (SELECT oid FROM ns)
  UNION ALL
    SELECT format('type %%s %%s %%s', t.typname, t.typtype,
                  (SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
                   FROM pg_catalog.pg_enum AS e WHERE e.enumtypid = t.oid))
    FROM types AS t
  UNION ALL
    SELECT format('sequence %%s %%s %%s %%s %%s', r.relname, s.seqstart, s.seqincrement,
                  s.seqmin, s.seqmax)
    FROM rels AS r
    CROSS JOIN LATERAL (
        SELECT s.seqstart, s.seqincrement, s.seqmin, s.seqmax FROM pg_catalog.pg_sequence AS s
        WHERE s.seqrelid = r.oid
        OFFSET 0
    ) AS s
    WHERE r.relkind = 'S'
) AS items
"""


_LOCK_HOLDERS: LiteralString = """
SELECT DISTINCT format('%%s (%%s)', a.pid, a.application_name)
FROM pg_catalog.pg_locks AS l
JOIN pg_catalog.pg_class AS c ON c.oid = l.relation
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
WHERE n.nspname = %(schema)s AND l.database = (
        SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database()
    )
  AND a.backend_type = 'client backend' AND a.pid <> pg_catalog.pg_backend_pid()
"""


def lock_holders(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """The client sessions (``"pid (application_name)"``) other than ``conn``'s that hold
    or wait for a lock on a relation of ``schema``: sessions inside a transaction that
    touched it (autovacuum is not a client session)."""
    rows = conn.execute(_LOCK_HOLDERS, {"schema": schema}).fetchall()
    return sorted(str(holder) for (holder,) in rows)


_WORKERS_TABLE: LiteralString = """
SELECT to_regclass(format('%%I.cyclone_ext_workers', %(schema)s::text))
"""


def live_workers(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """The workers registered in ``schema`` that never recorded their stop and whose
    process runs on this host (this one among them: a ``Worker`` a test left running)."""
    if conn.execute(_WORKERS_TABLE, {"schema": schema}).fetchone() in (None, (None,)):
        return []
    rows = conn.execute(
        sql.SQL("SELECT id, host, pid FROM {} WHERE stopped_at IS NULL").format(
            sql.Identifier(schema, "cyclone_ext_workers")
        )
    ).fetchall()
    here = socket.gethostname()
    return sorted(str(id_) for id_, host, pid in rows if host == here and _alive(int(pid)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


# Those of the given tables that exist in the schema, by name (no scan of the catalog).
_EXISTING_TABLES: LiteralString = """
SELECT t FROM unnest(%(tables)s::text[]) AS t
WHERE pg_catalog.to_regclass(format('%%I.%%I', %(schema)s::text, t)) IS NOT NULL
ORDER BY t
"""


def schema_signature(conn: psycopg.Connection[Any], schema: str) -> str:
    """A digest of ``schema``'s structure (see ``_SIGNATURE``) and of its version tables'
    rows: equal before and after a test that changed neither."""
    row = conn.execute(_SIGNATURE, {"schema": schema}).fetchone()
    parts = [str(row[0]) if row else ""]
    tables = conn.execute(
        _EXISTING_TABLES, {"schema": schema, "tables": sorted(VERSION_TABLES)}
    ).fetchall()
    for (table,) in tables:
        rows = conn.execute(
            sql.SQL("SELECT t::text FROM {} AS t ORDER BY 1").format(sql.Identifier(schema, table))
        ).fetchall()
        parts.append(f"{table}: {[text for (text,) in rows]}")
    return "\n".join(parts)


# -- the pool ---------------------------------------------------------------------------


@attrs.define
class _Pooled:
    signature: str  # the structure it was made with
    tables: list[str]  # the tables a reset may truncate
    keys: ForeignKeys  # the foreign keys between them
    relations: frozenset[str]  # the relations it was made with


# The relations of a schema a test may add beside the migrated ones, by kind, and how
# to drop one: tables, views, materialized views, sequences.
_RELATIONS: LiteralString = """
SELECT c.relname, c.relkind FROM pg_catalog.pg_class AS c
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
"""
_DROP_KIND: dict[str, LiteralString] = {
    "r": "TABLE",
    "p": "TABLE",
    "v": "VIEW",
    "m": "MATERIALIZED VIEW",
    "S": "SEQUENCE",
    "f": "FOREIGN TABLE",
}


_DROP_ORDER = ["r", "p", "f", "m", "v", "S"]


def _relations(conn: psycopg.Connection[Any], schema: str) -> dict[str, str]:
    """The tables, views and sequences of ``schema``: name to ``relkind``."""
    rows = conn.execute(_RELATIONS, {"schema": schema}).fetchall()
    return {str(name): str(kind) for name, kind in rows}


def _drop_added(conn: psycopg.Connection[Any], schema: str, kept: frozenset[str]) -> bool:
    """Drop the relations a test added to ``schema`` (an application's own tables, for a
    transactional step): those not in ``kept``. False when it added none."""
    added = {name: kind for name, kind in _relations(conn, schema).items() if name not in kept}
    # Tables first: their CASCADE takes the sequences they own (which refuse to go alone)
    # and the views on them.
    for name, kind in sorted(added.items(), key=lambda item: _DROP_ORDER.index(item[1])):
        conn.execute(
            sql.SQL("DROP {} IF EXISTS {} CASCADE").format(
                sql.SQL(_DROP_KIND[kind]), sql.Identifier(schema, name)
            )
        )
    return bool(added)


class SchemaPool:
    """Migrated schemas reused across the tests of one process (River's riverdbtest).

    :meth:`checkout` hands out an idle schema, emptied by :func:`reset_schema`, or a
    new one, migrated. :meth:`checkin` takes it back for reuse, unless the test did not
    pass or changed the schema's structure: then the schema is dropped. :meth:`close`
    drops them all. One test at a time per schema; not thread-safe (pytest runs the
    tests of a process one after the other; ``pytest -n`` gives each process its pool).
    """

    def __init__(self, admin_dsn: str, *, lock_timeout: float = 10.0) -> None:
        self.admin_dsn = admin_dsn
        self.lock_timeout = lock_timeout
        self.created = 0
        self.reused = 0
        self.dropped = 0
        self._idle: list[str] = []
        self._known: dict[str, _Pooled] = {}
        self._conn: psycopg.Connection[Any] | None = None

    @contextlib.contextmanager
    def _connect(self) -> Iterator[psycopg.Connection[Any]]:
        """The pool's own connection, kept from test to test (a new session per checkout
        and checkin cost a third of their time: the connection, and catalog caches that
        start cold); a new one when the last broke (a test restarted the server)."""
        conn = self._conn
        if conn is not None:
            try:
                conn.execute("SELECT")
            except psycopg.OperationalError:
                conn.close()
                conn = None
        if conn is None:
            conn = psycopg.connect(self.admin_dsn, autocommit=True)
            conn.execute(
                sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{self.lock_timeout:g}s"))
            )
            self._conn = conn
        try:
            yield conn
        finally:
            if conn.broken or conn.closed:
                self._conn = None

    def checkout(self) -> str:
        """A migrated schema with empty tables and restarted sequences."""
        if self._idle:
            name = self._idle.pop()
            try:
                with self._connect() as conn:
                    known = self._known[name]
                    reset_schema(conn, name, known.tables, known.keys)
            except psycopg.errors.LockNotAvailable as exc:
                # Not reused, and dropped by close() if the session lets go by then.
                raise RuntimeError(
                    f"could not empty test schema {name} within {self.lock_timeout:g}s: a "
                    f"session still holds locks on its tables (a worker or connection that "
                    f"outlived its test)"
                ) from exc
            self.reused += 1
            return name
        name = create_schema(self.admin_dsn)
        with self._connect() as conn:
            seeded = nonempty_tables(conn, name)
            pooled = _Pooled(
                schema_signature(conn, name),
                truncatable_tables(conn, name),
                foreign_keys(conn, name),
                frozenset(_relations(conn, name)),
            )
        self._known[name] = pooled
        if seeded:
            self._drop(name)
            raise RuntimeError(
                f"the migrations left rows in {seeded}: a pooled test schema is emptied on "
                f"reuse and would lose them (teach cyclone_dsl.testing.schemas to restore them)"
            )
        self.created += 1
        return name

    def checkin(self, name: str, *, reusable: bool = True) -> None:
        """Take ``name`` back: idle for the next test if ``reusable`` and its structure is
        unchanged, else dropped.

        Raises RuntimeError (after dropping what it can) if client sessions still hold
        locks on the schema's tables ``lock_timeout`` seconds after the test: a
        transaction the test left open, whose changes could reach the next test.
        """
        with self._connect() as conn:
            holders = lock_holders(conn, name)
            deadline = time.monotonic() + self.lock_timeout
            while holders and time.monotonic() < deadline:  # a closing session lets go
                time.sleep(0.05)
                holders = lock_holders(conn, name)
            if reusable and not holders:
                known = self._known[name]
                reusable = schema_signature(conn, name) == known.signature or (
                    _drop_added(conn, name, known.relations)
                    and schema_signature(conn, name) == known.signature
                )
            if reusable and not holders:
                reusable = not live_workers(conn, name)
        if reusable and not holders:
            self._idle.append(name)
            return
        self._drop(name)
        if holders:
            raise RuntimeError(
                f"sessions {holders} still hold locks on the tables of test schema {name} "
                f"{self.lock_timeout:g}s after its test ended: a transaction left open (a "
                f"worker or connection that outlived its test)"
            )

    def discard(self, name: str) -> None:
        """Drop ``name`` if it is idle: it was checked in before its test turned out not
        to pass (a fixture's teardown failed after)."""
        if name in self._idle:
            self._idle.remove(name)
            self._drop(name)

    def close(self) -> None:
        """Drop every schema this pool made, idle or not."""
        self._idle.clear()
        for name in list(self._known):
            self._drop(name)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._known:
            raise RuntimeError(
                f"could not drop test schemas {sorted(self._known)}: sessions still hold "
                f"locks on their tables"
            )

    def _drop(self, name: str) -> None:
        """Drop ``name``; if a session's locks keep it, leave it known for close()."""
        try:
            with self._connect() as conn:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
                )
        except psycopg.errors.LockNotAvailable:
            return
        self._known.pop(name, None)
        self.dropped += 1
