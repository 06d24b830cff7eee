"""A step that logs, for the CLI's --log-format json test."""

from __future__ import annotations

import logging

from cyclone_dsl import step

log = logging.getLogger("tests.cli.log_flows")


@step(name="cli_logs")
def logs_a_line(x: int) -> int:
    log.warning("handling %d", x)
    return x * 2
