"""A transactional step, for ``cyclone worker --transactional-dsn``."""

from __future__ import annotations

from cyclone_dsl import StepContext, step


@step(name="cli_tx_touch", transactional=True)
def touch(n: int, *, ctx: StepContext) -> int:
    return n
