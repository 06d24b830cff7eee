"""Handlers for tests/faults/test_mpa_audit.py (the multi-process worker audit).

Worker processes import this module by name. Its import can be made to fail in them
(not in the test process, which imported it first) through ``$MPA_BREAK_IMPORT``:
``missing`` (a dependency that is not installed) or ``raise``
(a RuntimeError at import). Each import is appended to ``$MPA_IMPORT_LOG`` when set.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from cyclone_dsl import step

if os.environ.get("MPA_IMPORT_LOG"):
    with open(os.environ["MPA_IMPORT_LOG"], "a") as _log:
        _log.write(f"{os.getpid()} {time.monotonic()}\n")

_BREAK = os.environ.get("MPA_BREAK_IMPORT")
if _BREAK == "missing":
    import mpa_dependency_that_is_not_installed  # type: ignore[import-not-found]  # noqa: F401
elif _BREAK == "raise":
    raise RuntimeError("mpa_handlers: configuration missing in this process")


@step(name="mpa_env")
def env(x: object) -> dict[str, object]:
    """What the worker process that ran it sees: its pid, cwd, environment, sys.path."""
    return {
        "x": x,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cwd": os.getcwd(),
        "marker": os.environ.get("MPA_MARKER"),
        "spec": os.environ.get("CYCLONE_WORKER_SPEC"),
        "spec_anywhere": any("CYCLONE_WORKER_SPEC" in k for k in os.environ),
        "sys_path": list(sys.path),
    }


@step(name="mpa_sleep", max_attempts=1)
def sleep(spec: dict[str, object]) -> int:
    """Touch ``spec["started"]``, sleep ``spec["seconds"]``, touch ``spec["ended"]``."""
    Path(str(spec["started"])).touch()
    time.sleep(float(spec["seconds"]))  # type: ignore[arg-type]
    Path(str(spec["ended"])).touch()
    return os.getpid()
