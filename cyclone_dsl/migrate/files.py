"""Finds the migration files (shipped in the wheel, or at the repository root) and checks them."""

from __future__ import annotations

import re
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

import attrs

from cyclone_dsl.errors import MigrationError

SEPARATOR = "---- create above / drop below ----"
_NAME = re.compile(r"^(\d+)_([A-Za-z0-9_]+)\.sql$")


@attrs.frozen
class Migration:
    version: int
    name: str
    up: str
    down: str


def migrations_dir() -> Traversable:
    """``cyclone_dsl/migrations`` inside a wheel, else ``migrations/`` of a source checkout."""
    packaged = resources.files("cyclone_dsl").joinpath("migrations")
    if packaged.is_dir():
        return packaged
    source = Path(__file__).resolve().parents[2] / "migrations"
    if source.is_dir():
        return source
    raise MigrationError("the migration files are missing from this installation")


def load_migrations(directory: Traversable | None = None) -> tuple[Migration, ...]:
    """Every migration in version order; a gap, a duplicate or a malformed file is an error."""
    folder = directory if directory is not None else migrations_dir()
    found: dict[int, Migration] = {}
    for entry in folder.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _NAME.match(entry.name)
        if match is None:
            raise MigrationError(f"migration file {entry.name!r} is not named NNN_name.sql")
        version = int(match.group(1))
        text = entry.read_text(encoding="utf-8")
        if text.count(SEPARATOR) != 1:
            raise MigrationError(
                f"migration {entry.name} must contain the line {SEPARATOR!r} exactly once"
            )
        up, down = text.split(SEPARATOR)
        if version in found:
            raise MigrationError(
                f"two migrations have version {version}: {found[version].name} and {match.group(2)}"
            )
        found[version] = Migration(version, match.group(2), up.strip(), down.strip())
    versions = sorted(found)
    expected = list(range(1, len(versions) + 1))
    if versions != expected:
        missing = sorted(set(range(1, max(versions, default=0) + 1)) - set(versions))
        raise MigrationError(f"the migrations have a gap: version(s) {missing} missing")
    return tuple(found[v] for v in versions)
