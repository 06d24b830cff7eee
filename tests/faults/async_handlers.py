"""An async handler for the fault tests, served only by workers started with
``CYCLONE_FAULT_ASYNC=1`` (serving it gives a worker a second lane and more slots)."""

from __future__ import annotations

import asyncio
import os

from cyclone_dsl import StepContext, step
from tests.faults.handlers import record


@step(name="fault_async_work", max_attempts=3, max_reclaims=5)
async def async_work(x: object, *, ctx: StepContext) -> dict[str, object]:
    record(ctx, "start")
    await asyncio.sleep(float(os.environ.get("CYCLONE_FAULT_SLEEP", "0")))
    record(ctx, "end")
    return {"x": x, "by": os.getpid()}
