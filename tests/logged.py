"""The JSON lines the root logger prints, each through the step-context filter, as a
worker started with ``--log-format json`` prints them (conftest's ``logged`` fixture)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from cyclone_dsl.observability import JsonFormatter, StepContextFilter

Lines = Callable[[], list[dict[str, Any]]]


@contextmanager
def json_lines() -> Iterator[Lines]:
    """The JSON lines the root logger printed so far (through the step filter)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(StepContextFilter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
