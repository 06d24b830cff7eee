"""Peer systems measured on the same PostgreSQL server as Cyclone.

Each peer module exposes synchronous functions taking the server's admin URL
first (``noop_throughput``, ``wakeup_latency``, and ``chain_throughput`` for
peers with workflows) and uses its own database ``bench_<peer>`` on that server.
"""

from __future__ import annotations

import importlib
import time
from types import ModuleType
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

PEERS = ("raw", "pgqueuer", "procrastinate", "dbos", "absurd")


def peer_url(admin_url: str, dbname: str) -> str:
    """Create database ``dbname`` on the server if missing; return its URL (path swapped)."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    parts = urlsplit(admin_url)
    return urlunsplit(parts._replace(path="/" + dbname))


def reset_database(url: str) -> None:
    """Drop every user schema of the peer's own database, then recreate ``public`` empty."""
    with psycopg.connect(url, autocommit=True) as conn:
        names = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%%'"
            " AND nspname <> 'information_schema'"
        ).fetchall()
        for (name,) in names:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))
        conn.execute("CREATE SCHEMA public")


def connect_kwargs(url: str) -> dict[str, object]:
    """asyncpg.connect() keyword arguments for a libpq URL (Unix socket or TCP)."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(url)
    return {
        "host": params.get("host"),
        "port": int(params.get("port") or 5432),
        "user": params.get("user"),
        "password": params.get("password"),
        "database": params.get("dbname"),
    }


def load(name: str) -> ModuleType | None:
    """The peer module ``name``, or None when its library is not installed."""
    module = importlib.import_module(f"{__name__}.{'raw' if name == 'raw' else name + '_peer'}")
    check = getattr(module, "available", None)
    return module if check is None or check() else None


def name_of(module: ModuleType) -> str:
    """The peer name of a module returned by :func:`load`."""
    return module.__name__.rsplit(".", 1)[-1].removesuffix("_peer")


def wait_count(
    url: str, query: str, expected: int, timeout: float = 60.0, params: tuple[object, ...] = ()
) -> float:
    """Poll ``query`` (a single count) every 2 ms until it reaches ``expected``; return the time."""
    deadline = time.perf_counter() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(query, params).fetchone()
            now = time.perf_counter()
            if row is not None and row[0] >= expected:
                return now
            if now > deadline:
                raise TimeoutError(f"{row[0] if row else 0} of {expected} done after {timeout} s")
            time.sleep(0.002)
