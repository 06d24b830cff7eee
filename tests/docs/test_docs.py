"""The documentation builds strictly, and every example runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_the_site_builds_without_warnings(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    assert (tmp_path / "guarantees" / "index.html").exists()


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_runs(example: Path, cyclone_dsn: str) -> None:
    result = subprocess.run(
        [sys.executable, str(example)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "CYCLONE_DATABASE_URL": cyclone_dsn, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_cli_reference_lists_every_command() -> None:
    from cyclone_dsl.cli import commands  # noqa: F401 - registers the commands
    from cyclone_dsl.cli.main import cli

    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    missing = [name for name in cli.commands if f"`cyclone {name}" not in page]
    assert missing == []


def test_the_schema_reference_lists_every_migration() -> None:
    from cyclone_dsl.migrate import load_migrations

    page = (ROOT / "docs" / "reference" / "schema.md").read_text()
    rows = {line.split("|")[1].strip() for line in page.splitlines() if line.startswith("| ")}
    assert {str(m.version) for m in load_migrations()} <= rows
