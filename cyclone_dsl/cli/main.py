"""The ``cyclone`` command line.

Exit codes: 0 success, 1 an operation failed (a run failed, a timeout, the database
cannot be reached or refused a statement, a migration failed), 2 bad usage or input
(a bad option, an unknown run, malformed JSON, an unknown workflow, an unmigrated
database). Every error is one line on standard error, ``cyclone: <what is wrong>``, with
the fix where there is one, and never shows a password; ``-v`` adds the traceback of an
error nobody planned for, and click's full usage text for bad usage.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, NoReturn

import click

from cyclone_dsl.cli.render import printable
from cyclone_dsl.cli.values import Retention, human_duration, to_json
from cyclone_dsl.db import diagnose
from cyclone_dsl.db.connect import ENV_LISTEN_URL, ENV_POOLED
from cyclone_dsl.db.embedded import ENV_URL, embedded_database
from cyclone_dsl.db.errors import DatabaseError
from cyclone_dsl.engine import DEFAULT_MAX_RECLAIMS, DEFAULT_RETENTION
from cyclone_dsl.errors import (
    CycloneError,
    DatabaseUnavailable,
    EmbeddedServerError,
    MigrationError,
    RunFailed,
    SubmitContended,
    WorkerCrashed,
)

EXIT_FAILED = 1
EXIT_USAGE = 2

#: Errors that mean the operation could not be carried out (exit 1). Every other
#: CycloneError is bad usage or input (exit 2), including a database not migrated for
#: this build.
FAILED_ERRORS: tuple[type[CycloneError], ...] = (
    DatabaseUnavailable,
    EmbeddedServerError,
    MigrationError,
    RunFailed,
    SubmitContended,
    WorkerCrashed,
)


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


def check_migrated(dsn: str, *, pooled: bool = False) -> None:
    """Reachable and migrated for this build, else a typed error saying what to do."""
    from cyclone_dsl.migrate import check_database

    check_database(dsn, name="cyclone-cli", pooled=pooled)


def one_line(text: str) -> str:
    """``text`` on one line, its lines joined (a message's later lines are often its hint)."""
    parts = [line.strip() for line in text.splitlines() if line.strip()]
    joined = parts[0] if parts else ""
    for part in parts[1:]:
        joined += " " if joined.endswith(":") or part.startswith("(") else "; "
        joined += part
    return joined


def error_line(message: str) -> str:
    """The ``cyclone: ...`` line for ``message``: one line, passwords masked."""
    # Escaped: a message can carry a handler's error text or a name from the database.
    line = printable(one_line(message))
    return f"cyclone: {diagnose.mask_passwords(line, _dsn_given())}"


def _dsn_given() -> str | None:
    """The DSN of the command line or the environment, whose password no message shows."""
    return _last["dsn"] or os.environ.get(ENV_URL)


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    click.echo(error_line(message), err=True)
    sys.exit(code)


def emit(data: Any, as_json: bool, text: str) -> None:
    """Print ``data`` as JSON (ISO 8601 timestamps) with --json, else ``text``."""
    click.echo(to_json(data) if as_json else text)


#: What the group's options said, for the error report after click has returned.
_last: dict[str, Any] = {"dsn": None, "verbose": False}


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
    _last.update(dsn=dsn, verbose=verbose)
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
        migrate_outcome,
        versions,
    )

    if status and (target is not None or extension_target is not None):
        raise click.UsageError("--status shows the versions: it takes no target")
    if target is not None and not 0 <= target <= LATEST_SCHEMA_VERSION:
        raise click.BadParameter(
            f"{target} is outside 0..{LATEST_SCHEMA_VERSION}", param_hint="--target"
        )
    if extension_target is not None and not 0 <= extension_target <= LATEST_EXTENSION_VERSION:
        raise click.BadParameter(
            f"{extension_target} is outside 0..{LATEST_EXTENSION_VERSION}",
            param_hint="--extension-target",
        )
    if extension_target is not None and target not in (None, LATEST_SCHEMA_VERSION):
        raise click.UsageError(
            f"--extension-target needs the core schema at its latest ({LATEST_SCHEMA_VERSION}),"
            f" not --target {target}"
        )
    with database(ctx.obj["dsn"]) as pooled_or_direct:
        dsn = direct_dsn(ctx, pooled_or_direct)
        if status:
            before, ext_before = versions(dsn)
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
        outcome = migrate_outcome(dsn, version=target, extension_version=extension_target)
        before, after = outcome.before, outcome.version
        ext_before, ext_after = outcome.extension_before, outcome.extension_version
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


#: ``cyclone worker``'s and ``cyclone scan``'s ``Worker(max_reclaims=N)``.
max_reclaims_option = click.option(
    "--max-reclaims",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_RECLAIMS,
    show_default=True,
    help="Reclaims of a step whose worker died before it is discarded (reclaim_limit), for "
    "steps that set no max_reclaims of their own.",
)


@cli.command()
@click.argument("modules", nargs=-1, required=True)
@click.option("--queues", default="default", help="Comma-separated queues to serve.")
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="Sync handlers at once, fixed, per process (default: adaptive, from 10 up to "
    "--max-concurrency).",
)
@click.option(
    "--max-concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="The most sync handlers at once when adaptive (default 256; 32 with transactional "
    "handlers).",
)
@click.option(
    "--max-async",
    type=click.IntRange(min=1),
    default=None,
    help="The most async handlers at once, per process; their number adapts from 100 up to "
    "it (default 10000). They hold no thread.",
)
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
@click.option(
    "--lease",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds a claimed step is leased; heartbeats renew it while its handler runs.",
)
@click.option(
    "--retention",
    type=Retention(),
    default=human_duration(DEFAULT_RETENTION),
    show_default=True,
    help="How long ended runs are kept when no step sets a retention (30s, 12h, 7d, 2w), "
    "then the scanner deletes them; none: keep them.",
)
@click.option(
    "--no-scanners",
    is_flag=True,
    help="Do not run the maintenance scanner (expired leases, timeouts, timers, deadlines, "
    "schedules, retention): run it elsewhere, as `cyclone scan` or other workers.",
)
@click.option(
    "--catch-up",
    type=click.Choice(["latest", "all"]),
    default="latest",
    show_default=True,
    help="Missed schedule slots: fire only the latest, or each in turn.",
)
@max_reclaims_option
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
    concurrency: int | None,
    max_concurrency: int | None,
    max_async: int | None,
    processes: int | None,
    grace: float,
    transactional_dsn: str | None,
    poll_interval: float,
    lease: float,
    retention: timedelta | None,
    no_scanners: bool,
    catch_up: str,
    max_reclaims: int,
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
    if transactional_dsn:
        check_reachable(transactional_dsn)  # its pool connects only when a step needs it
    with database(ctx.obj["dsn"]) as dsn:
        Worker(
            dsn,
            loaded,
            queues=[q.strip() for q in queues.split(",") if q.strip()],
            concurrency=concurrency,
            max_concurrency=max_concurrency,
            max_async=max_async,
            grace=grace,
            transactional_dsn=transactional_dsn,
            poll_interval=poll_interval,
            lease=lease,
            retention=retention,
            scanners=not no_scanners,
            catch_up=catch_up,
            max_reclaims=max_reclaims,
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
    except (ImportError, ValueError, TypeError) as exc:  # "", ".relative": not ImportError
        fail(f"cannot import {name!r}: {exc}")


def main(args: Sequence[str] | None = None) -> NoReturn:
    """The ``cyclone`` entry point: run the command, every error one line."""
    sys.exit(run(args))


def run(args: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (errors are reported on stderr)."""
    from cyclone_dsl.cli import bulk, commands  # noqa: F401 - registers the commands on cli

    _last.update(dsn=None, verbose=False)
    try:
        code = cli.main(args=args, prog_name="cyclone", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        exc.show()
        return EXIT_USAGE
    except click.UsageError as exc:
        if _last["verbose"]:
            exc.show()  # click's usage text and its message
            return EXIT_USAGE
        where = exc.ctx.command_path if exc.ctx is not None else "cyclone"
        return report(f"{usage_message(exc)} (see '{where} --help')", EXIT_USAGE)
    except click.ClickException as exc:
        return report(exc.format_message(), exc.exit_code)
    except click.Abort:
        return report("aborted", EXIT_FAILED)
    except CycloneError as exc:
        code = EXIT_FAILED if isinstance(exc, FAILED_ERRORS) else EXIT_USAGE
        return report(str(exc) or type(exc).__name__, code)
    except DatabaseError as exc:
        if _last["verbose"]:
            raise
        first = first_line(str(exc)) or type(exc).__name__
        return report(
            f"the database refused the call: {first} (-v prints the traceback)", EXIT_FAILED
        )
    except Exception as exc:  # the CLI's boundary: one line, -v for the traceback
        if _last["verbose"]:
            raise
        return report(
            f"unexpected error ({type(exc).__name__}: {one_line(str(exc))}): please report it, "
            "with the traceback that -v prints",
            EXIT_FAILED,
        )
    return code if isinstance(code, int) else 0


def usage_message(exc: click.UsageError) -> str:
    """click's message in the style of ours: lower case, no final full stop."""
    text = one_line(exc.format_message()).removesuffix(".")
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def report(message: str, code: int) -> int:
    click.echo(error_line(message), err=True)
    return code
