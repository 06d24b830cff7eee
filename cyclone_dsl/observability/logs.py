"""Structured logs: the step in scope on every log record, and a JSON-lines formatter.

While a worker runs a handler (on its thread, or in its asyncio task), the step is held in
a context variable. :class:`StepContextFilter`, added to a logging handler, copies it onto
each record as the attributes ``run_id``, ``node``, ``step_id``, ``attempt`` (from 1, as
``ctx.attempt``) and ``kind``: the worker's and the engine's records, and the records a
handler logs with the standard :mod:`logging` module. The worker's own records about a
step outside its handler (a lost lease, a timeout) carry the same fields as ``extra``.
"""

from __future__ import annotations

import json as jsonlib
import logging
import sys
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from typing import Any, Protocol, TextIO

#: The attributes a record gets while a step is in scope.
CONTEXT_FIELDS = ("run_id", "node", "step_id", "attempt", "kind")


class _Step(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def run_id(self) -> int: ...
    @property
    def node(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def attempt(self) -> int: ...  # attempts recorded so far: this execution is attempt + 1


_current: ContextVar[_Step | None] = ContextVar("cyclone_step", default=None)


def enter(step: _Step) -> Token[_Step | None]:
    """Put ``step`` in scope in the current context (a thread's, or an asyncio task's)."""
    return _current.set(step)


def leave(token: Token[_Step | None]) -> None:
    _current.reset(token)


def step_fields(step: _Step) -> dict[str, Any]:
    """The context fields of ``step``, for ``extra=`` of a record logged outside its scope."""
    return {
        "run_id": step.run_id,
        "node": step.node,
        "step_id": step.id,
        "attempt": step.attempt + 1,
        "kind": step.kind,
    }


class StepContextFilter(logging.Filter):
    """Adds the step in scope (if any) to each record; add it to your logging handlers."""

    def filter(self, record: logging.LogRecord) -> bool:
        step = _current.get()
        if step is not None and not hasattr(record, "step_id"):
            record.run_id = step.run_id
            record.node = step.node
            record.step_id = step.id
            record.attempt = step.attempt + 1
            record.kind = step.kind
        return True


_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (ISO 8601, UTC), ``level``, ``logger``,
    ``message``, every ``extra`` field (the step context among them), and ``exc_info``
    or ``stack_info`` when the record has them."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(
            (key, value)
            for key, value in record.__dict__.items()
            if key not in _STANDARD and not key.startswith("_")
        )
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return jsonlib.dumps(out, default=str, ensure_ascii=False)


#: Control characters as escapes in a text line: a message carrying user data (a database
#: error's DETAIL echoes the row) must not start a forged line or steer a terminal.
_ESCAPES = {
    code: {"\n": "\\n", "\r": "\\r"}.get(chr(code), f"\\x{code:02x}")
    for code in [*range(32), 127]
    if chr(code) != "\t"
}


class TextFormatter(logging.Formatter):
    """The usual text line, followed by the step context when a step is in scope. Control
    characters of the message are escaped (``\\n``); a traceback follows on lines of its
    own."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return super().formatMessage(record).translate(_ESCAPES)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if not hasattr(record, "step_id"):
            return text
        context = " ".join(f"{name}={getattr(record, name, None)!r}" for name in CONTEXT_FIELDS)
        first, newline, rest = text.partition("\n")
        return f"{first} [{context}]{newline}{rest}"


def configure_logging(
    *, json: bool = False, level: int | str = logging.INFO, stream: TextIO | None = None
) -> logging.Handler:
    """Log to ``stream`` (default stderr) through one root handler, replacing the root's
    handlers: JSON lines with ``json=True``, else text lines; both carry the step context.
    Returns the handler."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    handler.addFilter(StepContextFilter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    return handler
