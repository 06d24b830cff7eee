"""The ``cyclone`` command line.

Exit codes: 0 success, 1 an operation failed (a run failed, a timeout),
2 bad usage or input (unknown run, malformed JSON, unknown workflow).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click

from cyclone_dsl.cli.values import to_json
from cyclone_dsl.db import diagnose
from cyclone_dsl.db.connect import ENV_LISTEN_URL, ENV_POOLED
from cyclone_dsl.db.embedded import ENV_URL, embedded_database
from cyclone_dsl.db.errors import DatabaseError
from cyclone_dsl.errors import CycloneError, DatabaseUnavailable

EXIT_FAILED = 1
EXIT_USAGE = 2


@contextmanager
def database(dsn: str | None) -> Iterator[str]:
    """The DSN from --dsn, else $CYCLONE_DATABASE_URL, else the embedded server."""
    if dsn:
        yield dsn
        return
    with embedded_database() as url:
        yield url


def check_reachable(dsn: str) -> None:
    """Fail fast (one connection attempt) instead of waiting for a pool to give up."""
    diagnose.check_reachable(dsn, name="cyclone-cli")


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    click.echo(f"cyclone: {message}", err=True)
    sys.exit(code)


def emit(data: Any, as_json: bool, text: str) -> None:
    """Print ``data`` as JSON (ISO 8601 timestamps) with --json, else ``text``."""
    click.echo(to_json(data) if as_json else text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--dsn", envvar=ENV_URL, help="PostgreSQL URL (default: the embedded server).")
@click.option(
    "--pooled",
    is_flag=True,
    envvar=ENV_POOLED,
    help="The --dsn goes through a transaction-mode pooler (PgBouncer).",
)
@click.option(
    "--listen-url",
    envvar=ENV_LISTEN_URL,
    default=None,
    help="A direct connection for LISTEN (and migrations) when --dsn is pooled.",
)
@click.option("-v", "--verbose", is_flag=True, help="Log what the engine does.")
@click.pass_context
def cli(
    ctx: click.Context, dsn: str | None, pooled: bool, listen_url: str | None, verbose: bool
) -> None:
    """Cyclone: durable workflows on PostgreSQL."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    ctx.obj = {"dsn": dsn, "pooled": pooled, "listen_url": listen_url or None}


def direct_dsn(ctx: click.Context, dsn: str) -> str:
    """A DSN that is not pooled (migrations take a session-level lock): --listen-url when
    --dsn is pooled."""
    if not ctx.obj["pooled"]:
        return dsn
    if ctx.obj["listen_url"] is None:
        fail(
            "migrations need a direct (or session-mode) connection, and --dsn is pooled: "
            "give --listen-url (CYCLONE_LISTEN_URL), or a direct --dsn without --pooled"
        )
    direct: str = ctx.obj["listen_url"]
    return direct


@cli.command()
@click.option("--status", is_flag=True, help="Show the applied and latest versions only.")
@click.option(
    "--target",
    type=int,
    default=None,
    help="Migrate the core up or down to this version (below the latest, the extension "
    "track goes to 0 first).",
)
@click.option(
    "--extension-target",
    type=int,
    default=None,
    help="Move the extension track to this version (the core goes to its latest).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def migrate(
    ctx: click.Context,
    status: bool,
    target: int | None,
    extension_target: int | None,
    as_json: bool,
) -> None:
    """Apply the schema migrations (or step down with --target / --extension-target)."""
    from cyclone_dsl.migrate import (
        LATEST_EXTENSION_VERSION,
        LATEST_SCHEMA_VERSION,
        migrate_versions,
        versions,
    )

    with database(ctx.obj["dsn"]) as pooled_or_direct:
        dsn = direct_dsn(ctx, pooled_or_direct)
        before, ext_before = versions(dsn)
        if status:
            emit(
                {
                    "version": before,
                    "latest": LATEST_SCHEMA_VERSION,
                    "extension_version": ext_before,
                    "extension_latest": LATEST_EXTENSION_VERSION,
                },
                as_json,
                f"schema version {before} (this build: {LATEST_SCHEMA_VERSION})\n"
                f"extension version {ext_before} (this build: {LATEST_EXTENSION_VERSION})",
            )
            return
        after, ext_after = migrate_versions(dsn, version=target, extension_version=extension_target)
        core_text = f"{before} -> {after}" if before != after else f"at {after}"
        ext_text = f"{ext_before} -> {ext_after}" if ext_before != ext_after else f"at {ext_after}"
        emit(
            {
                "before": before,
                "version": after,
                "extension_before": ext_before,
                "extension_version": ext_after,
            },
            as_json,
            f"schema version {core_text}, extension version {ext_text}",
        )


@cli.command()
@click.argument("modules", nargs=-1, required=True)
@click.option("--queues", default="default", help="Comma-separated queues to serve.")
@click.option("--concurrency", default=10, show_default=True, help="Handlers at once, per process.")
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes under one supervisor (default: the number of cores; 1: the "
    "worker runs in this process).",
)
@click.option("--grace", default=30.0, show_default=True, help="Seconds to finish on SIGTERM.")
@click.option(
    "--transactional-dsn",
    default=None,
    help="Where transactional handlers write (default: the Cyclone database).",
)
@click.option(
    "--poll-interval",
    default=1.0,
    show_default=True,
    help="Seconds between claims when no wake-up comes (without LISTEN: always).",
)
@click.option("--pooled", is_flag=True, help="As `cyclone --pooled`, for this worker.")
@click.option("--listen-url", default=None, help="As `cyclone --listen-url`, for this worker.")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics on this port at /metrics (needs the metrics extra).",
)
@click.option(
    "--metrics-host",
    default="0.0.0.0",  # noqa: S104 - Prometheus scrapes from another host
    show_default=True,
    help="The address /metrics listens on.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one JSON object per line; lines logged while a step runs carry its "
    "run_id, node, step_id, attempt and kind.",
)
@click.pass_context
def worker(
    ctx: click.Context,
    modules: tuple[str, ...],
    queues: str,
    concurrency: int,
    processes: int | None,
    grace: float,
    transactional_dsn: str | None,
    poll_interval: float,
    pooled: bool,
    listen_url: str | None,
    metrics_port: int | None,
    metrics_host: str,
    log_format: str,
) -> None:
    """Run a worker for the handlers of MODULES (dotted names) until SIGTERM/SIGINT."""
    from cyclone_dsl.observability import configure_logging
    from cyclone_dsl.worker.processes import default_processes
    from cyclone_dsl.worker.worker import Worker

    configure_logging(json=log_format == "json", level=logging.getLogger().level)
    loaded = [_import(name) for name in modules]
    with database(ctx.obj["dsn"]) as dsn:
        Worker(
            dsn,
            loaded,
            queues=[q.strip() for q in queues.split(",") if q.strip()],
            concurrency=concurrency,
            grace=grace,
            transactional_dsn=transactional_dsn,
            poll_interval=poll_interval,
            pooled=pooled or ctx.obj["pooled"],
            listen_dsn=listen_url or ctx.obj["listen_url"] or "",
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            processes=processes if processes is not None else default_processes(),
        ).run()


@cli.command()
@click.option("--steps", "show_steps", is_flag=True, help="Print every step as it finishes.")
@click.pass_context
def demo(ctx: click.Context, show_steps: bool) -> None:
    """Run the flagship example end to end on the embedded PostgreSQL."""
    from cyclone_dsl.cli.demo import run_demo

    with database(ctx.obj["dsn"]) as dsn:
        code = run_demo(dsn)
    sys.exit(code)


def _import(name: str) -> object:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        fail(f"cannot import {name!r}: {exc}")


def main() -> None:
    from cyclone_dsl.cli import commands  # noqa: F401 - registers the commands on cli

    try:
        cli(standalone_mode=True)
    except DatabaseUnavailable as exc:
        fail(str(exc), EXIT_FAILED)
    except CycloneError as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    except DatabaseError as exc:
        first = str(exc).strip().splitlines()
        fail(f"the database refused the call: {first[0] if first else exc}", EXIT_FAILED)
