"""Workflows the CLI tests submit by module:name."""

from __future__ import annotations

from cyclone_dsl import step, wait_signal, workflow


@step(name="cli_add")
def add(x: int) -> int:
    return x + 1


@workflow(name="cli_flow")
def flow(x):  # type: ignore[no-untyped-def]
    return add(x)


@workflow(name="cli_waiting")
def waiting(x):  # type: ignore[no-untyped-def]
    return add(wait_signal("go"))
