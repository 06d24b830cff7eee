"""Applies the migration files directly, without the migrator, in a scratch schema.

The catalog tests use this to check each file's up and down parts on their own, the core's
and the extension track's: the files are read here with tern's format (up, the separator
line, down), each part runs in its own transaction, and nothing else is done (no version
table, no lock).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"
EXT_MIGRATIONS = MIGRATIONS / "ext"
SEPARATOR = "---- create above / drop below ----"
_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class File:
    version: int
    name: str
    up: str
    down: str

    def out_of_band(self) -> list[str]:
        """The statements the up part's comment gives for a build out of band.

        They are the comment lines indented by three spaces after ``--``; a statement
        ends with ``;``.
        """
        lines = [line[5:] for line in self.up.splitlines() if line.startswith("--   ")]
        return [s.strip() for s in " ".join(lines).split(";") if s.strip()]


def read_files(folder: Path = MIGRATIONS) -> list[File]:
    """The files of ``folder`` (the core's by default, ``EXT_MIGRATIONS`` for the extension
    track; the core's folder is read without its sub-folders)."""
    files = []
    for path in sorted(folder.glob("*.sql")):
        match = _NAME.match(path.name)
        assert match is not None, f"{path.name} is not named NNN_name.sql"
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        assert lines.count(SEPARATOR) == 1, f"{path.name}: the separator line must appear once"
        up, down = text.split(SEPARATOR + "\n")
        files.append(File(int(match.group(1)), match.group(2), up, down))
    return files


def with_search_path(dsn: str, schema: str) -> str:
    params: dict[str, Any] = conninfo_to_dict(dsn)
    options = str(params.get("options") or "")
    params["options"] = f"{options} -c search_path={schema}".strip()
    return make_conninfo("", **params)


@contextmanager
def scratch_schema(admin_dsn: str) -> Iterator[tuple[str, str]]:
    """(name, DSN with search_path) of a new empty schema, dropped afterwards."""
    name = f"cyclone_scratch_{secrets.token_hex(6)}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    try:
        yield name, with_search_path(admin_dsn, name)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def run_part(conn: psycopg.Connection[Any], text: str) -> None:
    """One migration part in its own transaction (``conn`` is in autocommit mode)."""
    with conn.transaction():
        conn.execute(text.encode("utf-8"))
