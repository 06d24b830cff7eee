"""The documentation builds strictly, and every example runs."""

from __future__ import annotations

import html
import os
import re
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
    missing = [
        f"{page.relative_to(ROOT)} includes {included} but its page does not show it"
        for page, included in includes()
        if included.endswith(".py") and not shows(built_page(tmp_path, page), ROOT / included)
    ]
    assert missing == []


#: A snippet include line of pymdownx.snippets, as written in a page.
INCLUDE = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)


def includes() -> list[tuple[Path, str]]:
    """(page, included file) for every snippet include of the docs; a line that looks like
    a mangled include (a formatter once turned ``--8<--`` into ``--8 < --``) fails here."""
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text()
        assert "--8 <" not in text, f"{page.relative_to(ROOT)} has a mangled snippet include"
        found += [(page, name) for name in INCLUDE.findall(text)]
    assert found, "no snippet include found: the pattern is stale"
    return found


def built_page(site: Path, page: Path) -> str:
    relative = page.relative_to(ROOT / "docs").with_suffix("")
    folder = site if relative.name == "index" else site / relative
    return (folder / "index.html").read_text()


def shows(html_text: str, included: Path) -> bool:
    """Whether the built page shows the included file: each of its code lines appears in
    the page's text once the syntax-highlighting markup is stripped."""
    text = html.unescape(re.sub(r"<[^>]+>", "", html_text))
    lines = [line.strip() for line in included.read_text().splitlines() if line.strip()]
    return all(line in text for line in lines)


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


FIGURE = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s*(steps/s|jobs/s|ms|x)\b")


def test_the_comparison_cites_only_measured_figures() -> None:
    """Every figure on the comparison page is one of the performance page's measured
    figures (with the same unit, as rounded there): it cannot drift from the benchmark."""
    measured: dict[str, list[float]] = {}
    for number, unit in FIGURE.findall((ROOT / "docs" / "performance.md").read_text()):
        measured.setdefault(unit, []).append(float(number.replace(",", "")))
    cited = FIGURE.findall((ROOT / "docs" / "comparison.md").read_text())
    assert cited, "the comparison cites no figure: the pattern is stale"
    unmatched = []
    for number, unit in cited:
        shown = float(number.replace(",", ""))
        decimals = len(number.split(".")[1]) if "." in number else 0
        tolerance = 0.5 * 10**-decimals + 1e-9
        if not any(abs(value - shown) <= tolerance for value in measured.get(unit, [])):
            unmatched.append(f"{number} {unit}")
    assert unmatched == []
