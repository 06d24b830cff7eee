"""Each integration is an optional extra: nothing imports a framework unless asked, and a
missing framework is an ImportError that names the extra to install."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

FRAMEWORKS = ["fastapi", "starlette", "django", "sqlalchemy"]


def test_importing_cyclone_imports_no_framework() -> None:
    probe = (
        "import sys, cyclone_dsl, cyclone_dsl.contrib; "
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("integration", "framework"),
    [("fastapi", "fastapi"), ("django", "django"), ("sqlalchemy", "sqlalchemy")],
)
def test_a_missing_framework_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, integration: str, framework: str
) -> None:
    # Every import of the framework (or of a module of it already loaded) fails, as if it
    # were not installed.
    for name in [framework, *(m for m in sys.modules if m.startswith(f"{framework}."))]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, f"cyclone_dsl.contrib.{integration}", raising=False)
    with pytest.raises(ImportError, match=rf"pip install 'cyclone-dsl\[{integration}\]'"):
        importlib.import_module(f"cyclone_dsl.contrib.{integration}")
