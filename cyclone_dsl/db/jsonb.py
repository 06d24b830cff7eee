"""How the engine reads ``json`` and ``jsonb``: with :func:`cyclone_dsl.payload.decode`.

Registered on the engine's own connections when they open, and on each cursor the
engine opens on a connection it does not own (the application's, or a transactional
handler's, whose loaders stay as they are).
"""

from __future__ import annotations

from typing import Any

import psycopg
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

Context = psycopg.Connection[Any] | psycopg.AsyncConnection[Any] | psycopg.Cursor[Any]
AnyCursor = psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]


def use_engine_loaders(context: Context | AnyCursor) -> None:
    """Read ``json`` and ``jsonb`` on ``context`` as the engine does."""
    for name, loader in _LOADERS:
        context.adapters.register_loader(name, loader)


def has_engine_loaders(context: Context | AnyCursor) -> bool:
    return context.adapters.get_loader(_JSONB_OID, Format.TEXT) is _EngineJsonbLoader
