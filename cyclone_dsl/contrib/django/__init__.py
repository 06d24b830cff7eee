"""Cyclone in a Django project (``pip install 'cyclone-dsl[django]'``).

Add ``"cyclone_dsl.contrib.django"`` to ``INSTALLED_APPS`` (for the
``cyclone_worker`` and ``cyclone_migrate`` management commands) and, optionally,
configure it in the settings::

    CYCLONE = {
        "DSN": "postgresql://...",     # default: built from DATABASES[DATABASE]
        "DATABASE": "default",         # the alias whose connection submit_tx uses
        "MODULES": ["shop.workflows"], # what `manage.py cyclone_worker` serves by default
        "QUEUES": ["default"],
        "CONCURRENCY": None,           # handlers at once; None: adaptive
        "GRACE": 30.0,                 # seconds a stopping worker gives running handlers
        "POOL_SIZE": 4,                # connections of the process-wide Client
    }

Then submit inside ``transaction.atomic()``: the run is written on Django's own
connection, in the same transaction as the rows the view wrote, and exists if and
only if the block commits::

    with transaction.atomic():
        order = Order.objects.create(total=42)
        submit_tx(fulfil, {"order_id": order.id})

It needs the ``postgresql`` backend on psycopg 3 (Django 4.2+ uses psycopg 3 when
it is installed, which Cyclone requires), with Cyclone's tables in the database
(and on the ``search_path``) of that connection: ``manage.py cyclone_migrate``.
"""

from __future__ import annotations

import atexit
import threading
from datetime import datetime, timedelta
from typing import Any

import psycopg  # noqa: TID251 - the DSN is built from Django's connection parameters

from cyclone_dsl.client.handle import RunHandle
from cyclone_dsl.client.sync import Client
from cyclone_dsl.contrib import missing_extra
from cyclone_dsl.contrib._connections import psycopg_connection
from cyclone_dsl.db.callers import Connection
from cyclone_dsl.payload import JSONValue

try:
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.signals import setting_changed
    from django.db import DEFAULT_DB_ALIAS, connections
except ImportError as exc:
    raise missing_extra("django", "Django", "django") from exc

__all__ = [
    "close_client",
    "cyclone_settings",
    "database_settings",
    "dsn",
    "enqueue_tx",
    "get_client",
    "submit_once_tx",
    "submit_tx",
]

#: The keys of ``settings.CYCLONE`` and their defaults (``DSN``: built from ``DATABASES``).
DEFAULTS: dict[str, Any] = {
    "DSN": None,
    "DATABASE": DEFAULT_DB_ALIAS,
    "MODULES": [],
    "QUEUES": ["default"],
    "CONCURRENCY": None,
    "GRACE": 30.0,
    "POOL_SIZE": 4,
}


def cyclone_settings() -> dict[str, Any]:
    """``settings.CYCLONE`` over :data:`DEFAULTS`; an unknown key is an error (a typo)."""
    configured = getattr(settings, "CYCLONE", None) or {}
    if not isinstance(configured, dict):
        raise ImproperlyConfigured("settings.CYCLONE must be a dict")
    unknown = sorted(set(configured) - set(DEFAULTS))
    if unknown:
        raise ImproperlyConfigured(
            f"settings.CYCLONE has unknown keys {unknown}; known: {sorted(DEFAULTS)}"
        )
    return {**DEFAULTS, **configured}


def dsn() -> str:
    """Cyclone's DSN: ``CYCLONE["DSN"]``, else the connection parameters of
    ``DATABASES[CYCLONE["DATABASE"]]`` (host, port, name, user, password and the
    libpq ``OPTIONS``, such as ``options="-c search_path=..."``)."""
    conf = cyclone_settings()
    if conf["DSN"]:
        return str(conf["DSN"])
    wrapper = connections[conf["DATABASE"]]
    if wrapper.vendor != "postgresql":
        raise ImproperlyConfigured(
            f"Cyclone needs PostgreSQL: DATABASES[{conf['DATABASE']!r}] uses "
            f"{wrapper.settings_dict['ENGINE']!r}; set CYCLONE['DSN'] or CYCLONE['DATABASE']"
        )
    libpq = {option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults()}
    params = {
        name: str(value)
        for name, value in wrapper.get_connection_params().items()
        if name in libpq and value is not None
    }
    return psycopg.conninfo.make_conninfo("", **params)


def database_settings(url: str) -> dict[str, Any]:
    """A ``DATABASES`` entry (``postgresql`` backend) for a PostgreSQL URL or conninfo:
    host, port, name, user and password, the other parameters in ``OPTIONS``."""
    params: dict[str, Any] = psycopg.conninfo.conninfo_to_dict(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.pop("dbname", ""),
        "USER": params.pop("user", ""),
        "PASSWORD": params.pop("password", ""),
        "HOST": params.pop("host", ""),
        "PORT": str(params.pop("port", "")),
        "OPTIONS": params,
    }


_client: Client | None = None
_client_lock = threading.Lock()


def get_client() -> Client:
    """The process-wide :class:`~cyclone_dsl.Client` on :func:`dsn`, made on first use.

    It is replaced when ``settings.CYCLONE`` or ``settings.DATABASES`` change (as under
    ``override_settings``) and closed when the process exits.
    """
    global _client
    with _client_lock:
        if _client is None:
            _client = Client(dsn(), pool_size=int(cyclone_settings()["POOL_SIZE"]))
        return _client


def close_client() -> None:
    """Close the process-wide client; the next :func:`get_client` makes a new one."""
    global _client
    with _client_lock:
        client, _client = _client, None
    if client is not None:
        client.close()


def _on_setting_changed(*, setting: str, **_: Any) -> None:
    if setting in ("CYCLONE", "DATABASES"):
        close_client()


setting_changed.connect(_on_setting_changed, dispatch_uid="cyclone_dsl.contrib.django")
atexit.register(close_client)


def atomic_connection(using: str | None = None) -> Connection:
    """The psycopg connection of Django's database ``using`` (default:
    ``CYCLONE["DATABASE"]``), opened if needed, in the current ``atomic()`` block's
    transaction if there is one (else in autocommit mode, as Django's own queries)."""
    alias = using or str(cyclone_settings()["DATABASE"])
    wrapper = connections[alias]
    wrapper.ensure_connection()
    wrapper.validate_no_broken_transaction()
    return psycopg_connection(
        wrapper.connection,
        f"the 'django.db.backends.postgresql' backend on psycopg 3 for database {alias!r}",
    )


def submit_tx(
    workflow: object,
    input: JSONValue = None,
    *,
    deadline: timedelta | None = None,
    using: str | None = None,
    client: Client | None = None,
) -> RunHandle:
    """:meth:`Client.submit_tx <cyclone_dsl.Client.submit_tx>` on Django's connection:
    inside ``transaction.atomic()``, the run exists iff the block commits.

    Outside an atomic block Django's connection is in autocommit mode, and the submit
    commits on its own, like an ORM write there. ``client`` defaults to
    :func:`get_client`.
    """
    conn = atomic_connection(using)
    return (client or get_client()).submit_tx(conn, workflow, input, deadline=deadline)


def submit_once_tx(
    workflow: object,
    input: JSONValue = None,
    *,
    key: str,
    deadline: timedelta | None = None,
    using: str | None = None,
    client: Client | None = None,
) -> RunHandle:
    """:meth:`Client.submit_once_tx <cyclone_dsl.Client.submit_once_tx>` on Django's
    connection (see :func:`submit_tx`)."""
    conn = atomic_connection(using)
    return (client or get_client()).submit_once_tx(
        conn, workflow, input, key=key, deadline=deadline
    )


def enqueue_tx(
    step: object,
    input: JSONValue = None,
    *,
    queue: str | None = None,
    priority: int | None = None,
    scheduled_at: datetime | None = None,
    max_attempts: int | None = None,
    timeout: timedelta | float | None = None,
    unique_key: str | None = None,
    sequence_key: str | None = None,
    retention: timedelta | float | None = None,
    concurrency_key: str | None = None,
    using: str | None = None,
    client: Client | None = None,
) -> RunHandle:
    """:meth:`Client.enqueue_tx <cyclone_dsl.Client.enqueue_tx>` on Django's connection
    (see :func:`submit_tx`)."""
    conn = atomic_connection(using)
    return (client or get_client()).enqueue_tx(
        conn,
        step,
        input,
        queue=queue,
        priority=priority,
        scheduled_at=scheduled_at,
        max_attempts=max_attempts,
        timeout=timeout,
        unique_key=unique_key,
        sequence_key=sequence_key,
        retention=retention,
        concurrency_key=concurrency_key,
    )
