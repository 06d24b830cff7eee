"""LISTEN on a dedicated connection (the channel is a constant identifier, never user data)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql


def listen(conn: psycopg.Connection[Any], channel: str) -> None:
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


async def listen_async(conn: psycopg.AsyncConnection[Any], channel: str) -> None:
    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
