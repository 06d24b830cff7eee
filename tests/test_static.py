"""The code base stays ruff-clean, mypy --strict clean, and exports what it documents."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cyclone_dsl

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_ruff_check() -> None:
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = _run("ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict() -> None:
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_public_names_are_unique_and_importable() -> None:
    names = cyclone_dsl.__all__  # ruff's RUF022 keeps the list sorted
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(cyclone_dsl, name), name


def test_package_is_typed() -> None:
    assert (ROOT / "cyclone_dsl" / "py.typed").exists()


def test_import_layers() -> None:
    """The import-linter contracts of pyproject.toml: the layers, a pure DSL, one Engine."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
