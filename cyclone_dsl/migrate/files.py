"""Finds the migration files (shipped in the wheel, or at the repository root) and checks them.

The core migrations are ``migrations/NNN_name.sql``; the extension track is
``migrations/ext/NNN_name.sql``, numbered on its own. Both use tern's format: the up
part, the separator line, the down part.
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

import attrs

from cyclone_dsl.errors import MigrationError

SEPARATOR = "---- create above / drop below ----"
EXTENSION_FOLDER = "ext"
_NAME = re.compile(r"^(\d+)_([A-Za-z0-9_]+)\.sql$")
#: A down part's guard: a ``DO`` block first, which only reads and raises to refuse.
_GUARD = re.compile(r"\ADO \$\$\n.*?\n\$\$;", re.DOTALL)


@attrs.frozen
class Migration:
    version: int
    name: str
    up: str
    down: str

    @property
    def down_guard(self) -> str | None:
        """The check that opens the down part (a ``DO`` block that only reads and refuses
        while runs in flight need what the down part drops), or None."""
        match = _GUARD.match(self.down)
        return match[0] if match else None


def migrations_dir() -> Traversable:
    """``cyclone_dsl/migrations`` inside a wheel, else ``migrations/`` of a source checkout."""
    packaged = resources.files("cyclone_dsl").joinpath("migrations")
    if packaged.is_dir():
        return packaged
    source = Path(__file__).resolve().parents[2] / "migrations"
    if source.is_dir():
        return source
    raise MigrationError("the migration files are missing from this installation")


def extension_migrations_dir() -> Traversable:
    """The ``ext`` folder of :func:`migrations_dir`: the extension track's files."""
    folder = migrations_dir().joinpath(EXTENSION_FOLDER)
    if not folder.is_dir():
        raise MigrationError("the extension migration files are missing from this installation")
    return folder


def load_migrations(directory: Traversable | None = None) -> tuple[Migration, ...]:
    """Every core migration in version order; a gap, a duplicate or a malformed file is an
    error. Sub-folders (the extension track's ``ext``) are not read."""
    return _load(directory if directory is not None else migrations_dir())


def load_extension_migrations(directory: Traversable | None = None) -> tuple[Migration, ...]:
    """Every extension migration in version order, checked as :func:`load_migrations` does."""
    return _load(directory if directory is not None else extension_migrations_dir())


def _load(folder: Traversable) -> tuple[Migration, ...]:
    found: dict[int, Migration] = {}
    for entry in folder.iterdir():
        if not entry.is_file() or not entry.name.endswith(".sql"):
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
    if versions and versions[0] < 1:
        raise MigrationError(
            f"migration {versions[0]:03d}_{found[versions[0]].name}.sql: versions start at 1"
        )
    expected = list(range(1, len(versions) + 1))
    if versions != expected:
        missing = sorted(set(range(1, max(versions, default=0) + 1)) - set(versions))
        raise MigrationError(f"the migrations have a gap: version(s) {missing} missing")
    return tuple(found[v] for v in versions)
