"""Running ``cyclone`` as a user does: a subprocess, with its stdout, stderr and exit code."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
Cli = Callable[..., subprocess.CompletedProcess[str]]


def runner(dsn: str) -> Cli:
    """``cyclone --dsn DSN ARGS`` in a subprocess (stdin is not a terminal)."""

    def run(*args: str, input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cyclone_dsl.cli", "--dsn", dsn, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            input=input_text,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )

    return run


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single ``cyclone: ...`` line on stderr (fails the test on anything else)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("cyclone: "), result.stderr
    assert result.stdout == "", result.stdout
    return lines[0]
