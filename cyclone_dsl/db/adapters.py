"""How the engine reads ``json`` and ``jsonb`` (with :func:`cyclone_dsl.payload.decode`)
and sends durations (as a length of time, never as calendar days).

Registered on the engine's own connections when they open, and on each cursor the
engine opens on a connection it does not own (the application's, or a transactional
handler's, whose adapters stay as they are).

psycopg sends ``timedelta(days=1)`` as ``1 day``, and PostgreSQL adds a day to a
``timestamptz`` in the session's time zone: across a daylight-saving change, a 1-day
deadline, timer or retention would be 23 or 25 hours long. The engine sends a duration
as microseconds, which PostgreSQL adds as an exact length of time.
"""

from __future__ import annotations

import struct
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.adapt import Buffer, Dumper
from psycopg.pq import Format
from psycopg.types.json import JsonbBinaryLoader, JsonBinaryLoader, JsonbLoader, JsonLoader

from cyclone_dsl import payload


class _EngineJsonLoader(JsonLoader):
    _loads = staticmethod(payload.decode)


class _EngineJsonBinaryLoader(JsonBinaryLoader):
    _loads = staticmethod(payload.decode)


class _EngineJsonbLoader(JsonbLoader):
    _loads = staticmethod(payload.decode)


class _EngineJsonbBinaryLoader(JsonbBinaryLoader):
    _loads = staticmethod(payload.decode)


_LOADERS = (
    ("json", _EngineJsonLoader),
    ("json", _EngineJsonBinaryLoader),
    ("jsonb", _EngineJsonbLoader),
    ("jsonb", _EngineJsonbBinaryLoader),
)
_JSONB_OID = psycopg.adapters.types["jsonb"].oid
_INTERVAL_OID = psycopg.adapters.types["interval"].oid
_INTERVAL = struct.Struct("!qii")  # microseconds, days, months


class _DurationDumper(Dumper):
    """A ``timedelta`` as a number of microseconds (no day part: see the module's doc)."""

    oid = _INTERVAL_OID

    def dump(self, obj: timedelta) -> Buffer | None:
        return b"%d microseconds" % (obj // timedelta(microseconds=1))


class _DurationBinaryDumper(Dumper):
    format = Format.BINARY
    oid = _INTERVAL_OID

    def dump(self, obj: timedelta) -> Buffer | None:
        return _INTERVAL.pack(obj // timedelta(microseconds=1), 0, 0)


Context = psycopg.Connection[Any] | psycopg.AsyncConnection[Any] | psycopg.Cursor[Any]
AnyCursor = psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]


def use_engine_adapters(context: Context | AnyCursor) -> None:
    """Read ``json`` and ``jsonb``, and send durations, on ``context`` as the engine does."""
    for name, loader in _LOADERS:
        context.adapters.register_loader(name, loader)
    context.adapters.register_dumper(timedelta, _DurationDumper)
    context.adapters.register_dumper(timedelta, _DurationBinaryDumper)


def has_engine_adapters(context: Context | AnyCursor) -> bool:
    return context.adapters.get_loader(_JSONB_OID, Format.TEXT) is _EngineJsonbLoader
