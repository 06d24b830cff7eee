"""A worker process for the fault tests: ``python -m tests.faults.worker_main DSN``."""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

from cyclone_dsl import Worker
from cyclone_dsl.testing import set_clock_shift
from tests.faults import handlers

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    skew = float(os.environ.get("CYCLONE_FAULT_CLOCK_SKEW", "0"))
    if skew:
        # This process's wall clock (time.time, datetime.now) runs ``skew`` seconds off.
        import time

        import time_machine

        time_machine.travel(time.time() + skew, tick=True).start()
    set_clock_shift(timedelta(seconds=float(os.environ.get("CYCLONE_FAULT_SHIFT", "0"))))
    if "CYCLONE_FAULT_BEAT" in os.environ:
        # Registry beats this often (the fleet tests call a worker gone after ~1 s).
        from cyclone_dsl.worker import worker as worker_module

        worker_module.REGISTRY_BEAT_S = float(os.environ["CYCLONE_FAULT_BEAT"])
    served: list[object] = [handlers]
    if os.environ.get("CYCLONE_FAULT_ASYNC") == "1":
        from tests.faults import async_handlers

        served.append(async_handlers)
    Worker(
        sys.argv[1],
        served,
        lease=float(os.environ.get("CYCLONE_FAULT_LEASE", "1")),
        grace=float(os.environ.get("CYCLONE_FAULT_GRACE", "30")),
        poll_interval=0.1,
        scan_interval=0.2,
        concurrency=8,
        processes=int(os.environ.get("CYCLONE_FAULT_PROCESSES", "1")),
    ).run()
