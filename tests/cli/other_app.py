"""Another application whose step has the name of one in tests.cli.flows (not imported with it)."""

from __future__ import annotations

from cyclone_dsl import step


@step(name="cli_add")
def add(x: int) -> int:
    return x - 1
