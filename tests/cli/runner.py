"""Running ``cyclone``: as a user does (a subprocess), or in this process through the
entry point's own error handling (:func:`cyclone_dsl.cli.main.run`), which costs no
interpreter start (about 0.4 s of CPU a command); both give stdout, stderr and the exit
code."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from click.testing import CliRunner

from cyclone_dsl.cli.main import run as cli_main

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


def in_process(dsn: str) -> Cli:
    """``cyclone --dsn DSN ARGS`` in this process (stdin is not a terminal); for commands
    that end on their own (not ``worker`` or ``ui``)."""

    def run(*args: str, input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = ["--dsn", dsn, *args]
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        try:
            with CliRunner().isolation(input=input_text) as (out, err, _):
                try:
                    code = cli_main(argv)
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                return subprocess.CompletedProcess(
                    argv, code, out.getvalue().decode(), err.getvalue().decode()
                )
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)

    return run


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single ``cyclone: ...`` line on stderr (fails the test on anything else)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("cyclone: "), result.stderr
    assert result.stdout == "", result.stdout
    return lines[0]
