"""SQL hygiene: every named query prepares, is used, and SQL text lives only in sql/ files."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import psycopg
import pytest

from cyclone_dsl.sql import Q
from cyclone_dsl.sql._loader import load_queries

PACKAGE = Path(__file__).resolve().parents[1] / "cyclone_dsl"
QUERIES = load_queries("cyclone_dsl.sql")
#: Statements PREPARE does not take: DDL, and several statements in one.
DDL = {"create_version_table", "completion_setup", "completion_reset", "completion_reset_watched"}


@pytest.mark.parametrize("name", sorted(set(QUERIES) - DDL))
def test_every_query_prepares_on_a_migrated_schema(cyclone_dsn: str, name: str) -> None:
    numbers: dict[str, int] = {}

    def placeholder(match: re.Match[str]) -> str:
        numbers.setdefault(match.group(1), len(numbers) + 1)
        return f"${numbers[match.group(1)]}"

    body = re.sub(r"%\((\w+)\)[sb]", placeholder, QUERIES[name])
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute(f"PREPARE probe AS {body}".encode())


def parse(path: Path) -> ast.Module:
    """ast.parse, retried: CPython 3.11 can raise a spurious SystemError ("AST constructor
    recursion depth mismatch") while other threads of the test process run Python code."""
    for attempt in range(5):
        try:
            return ast.parse(path.read_text())
        except SystemError:
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


def test_every_query_is_used_and_every_use_exists() -> None:
    used: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(parse(path)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "Q"
            ):
                used.add(node.attr)
    assert used - set(QUERIES) == set()
    assert set(QUERIES) - used == set()


def test_queries_are_exposed_as_attributes() -> None:
    for name, text in QUERIES.items():
        assert getattr(Q, name) == text


def test_no_sql_is_built_outside_the_sql_package() -> None:
    """execute() outside sql/ and db/ and migrate/ only ever gets a Q.* constant."""
    offenders = []
    allowed = {PACKAGE / "db", PACKAGE / "migrate", PACKAGE / "sql", PACKAGE / "testing"}
    for path in PACKAGE.rglob("*.py"):
        if any(parent in allowed for parent in path.parents):
            continue
        for node in ast.walk(parse(path)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "execute"
                and node.args
            ):
                first = node.args[0]
                is_q = (
                    isinstance(first, ast.Attribute)
                    and isinstance(first.value, ast.Name)
                    and first.value.id == "Q"
                )
                if not is_q:
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_fragments_are_included_and_never_left_behind() -> None:
    from cyclone_dsl.sql._loader import _include

    assert not [name for name, text in QUERIES.items() if "{{" in text or "}}" in text]
    shared = "WHEN c.has_slots THEN"
    assert shared in QUERIES["claim_steps"]
    assert shared in QUERIES["assemble_inputs"]
    with pytest.raises(RuntimeError, match="unknown fragment"):
        _include("SELECT {{missing}}", {})


#: Statements that change rows, take row locks or have side effects.
WRITES = re.compile(
    r"\b(INSERT|UPDATE|DELETE|MERGE|TRUNCATE|pg_notify|set_config|pg_advisory\w*|"
    r"pg_try_advisory\w*)\b",
    re.IGNORECASE,
)


#: Queries that only set a setting of their own session or transaction (no row, no lock):
#: allowed anywhere.
SESSION_SETTINGS = {
    "iso_dates",
    "keep_idle_session",
    "watch_client",
    "completion_setup",
    "completion_reset",
    "completion_reset_watched",
}


def test_only_the_engine_and_the_migrator_write() -> None:
    """Outside cyclone_dsl/engine (and the migrator, which owns the schema) only reads run:
    every state change goes through the Engine."""
    writers = {PACKAGE / "engine", PACKAGE / "migrate"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if any(parent in writers for parent in path.parents):
            continue
        for node in ast.walk(parse(path)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "Q"
                and node.attr not in SESSION_SETTINGS
                and WRITES.search(QUERIES[node.attr])
            ):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} Q.{node.attr}")
    assert offenders == []


def test_comments_and_indentation_are_not_sent_but_quoted_text_is() -> None:
    from cyclone_dsl.sql._loader import _compact

    body = """
    SELECT 'a --  b',   "odd--name",  -- a comment
           'it''s -- kept' AS x
    -- a line of comment
    FROM t  -- trailing
    """
    assert _compact(body) == "SELECT 'a --  b', \"odd--name\",\n'it''s -- kept' AS x\nFROM t"


@pytest.mark.parametrize("body", ["SELECT 'open", 'SELECT "open', "SELECT 'a''"])
def test_a_quote_left_open_is_refused(body: str) -> None:
    from cyclone_dsl.sql._loader import _compact

    with pytest.raises(RuntimeError, match="unterminated quote"):
        _compact(body)


#: psycopg converts a query's text once and caches it only up to this length (its
#: MAX_CACHED_STATEMENT_LENGTH): a longer statement is parsed again in Python on every
#: execution. The claims of flow-controlled queues are the statements over it.
PSYCOPG_CACHED_LENGTH = 4096


def test_hot_statements_fit_psycopg_query_cache() -> None:
    from psycopg import _queries

    assert PSYCOPG_CACHED_LENGTH <= _queries.MAX_CACHED_STATEMENT_LENGTH
    too_long = {
        name for name, text in QUERIES.items() if len(text.encode()) > PSYCOPG_CACHED_LENGTH
    }
    assert too_long == {"claim_gated_steps", "claim_capped_steps"}


def test_array_parameters_are_sent_in_binary() -> None:
    """A list in text format costs psycopg an escape per element in Python (a completion
    batch's lists were about 7 us of worker CPU per step); binary format does not."""
    text_array = re.compile(r"%\(\w+\)s::\w+\[\]")
    found = {name: text_array.findall(body) for name, body in QUERIES.items()}
    assert {name: places for name, places in found.items() if places} == {}


def test_the_reset_sets_the_client_check_the_worker_sets() -> None:
    """completion_reset_watched holds CHECK_CLIENT_MS as a literal (several statements in one
    take no parameter)."""
    from cyclone_dsl.db.connect import CHECK_CLIENT_MS

    assert (
        f"'client_connection_check_interval', '{CHECK_CLIENT_MS}'"
        in QUERIES["completion_reset_watched"]
    )
