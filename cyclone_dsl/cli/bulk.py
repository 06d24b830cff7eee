"""``cyclone cancel-many``, ``retry-many`` and ``resume-many``: operations in bulk by filter."""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any

import click

from cyclone_dsl.cli.commands import as_json, client_for
from cyclone_dsl.cli.main import EXIT_FAILED, cli, emit, fail
from cyclone_dsl.client.bulk import BulkResult
from cyclone_dsl.client.sync import Client
from cyclone_dsl.engine import DEFAULT_BATCH_SIZE, MAX_BATCH_SIZE, RunFilter
from cyclone_dsl.errors import InvalidArgument


def _when(value: str | None, option: str) -> datetime | None:
    """An ISO 8601 instant with its offset (``2026-05-01T12:00:00+00:00``, or ``Z``)."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        fail(f"{option} must be an ISO 8601 date and time with an offset, not {value!r}")
    if parsed.tzinfo is None:
        fail(f"{option} needs a UTC offset (2026-05-01T12:00:00+00:00 or ...Z), not {value!r}")
    return parsed


def filter_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The filter options every bulk command takes (each repeatable option: any of them)."""
    options = [
        click.option("--workflow", "workflows", multiple=True, help="Runs of this workflow."),
        click.option("--state", "states", multiple=True, help="Runs in this state."),
        click.option("--queue", "queues", multiple=True, help="Runs with a step in this queue."),
        click.option(
            "--error-kind",
            "error_kinds",
            multiple=True,
            help="Runs with a step of this error kind (timeout, panic, error...).",
        ),
        click.option("--since", help="Created at or after (ISO 8601 with offset)."),
        click.option("--until", help="Created before (ISO 8601 with offset)."),
        click.option("--ended-since", help="Ended at or after (ISO 8601 with offset)."),
        click.option("--ended-until", help="Ended before (ISO 8601 with offset)."),
        click.option("--all", "match_all", is_flag=True, help="Every run the command applies to."),
        click.option("--dry-run", is_flag=True, help="Only count the runs selected."),
        click.option("--yes", is_flag=True, help="Do not ask for confirmation."),
        click.option(
            "--batch-size",
            type=click.IntRange(1, MAX_BATCH_SIZE),  # checked with --dry-run too
            default=DEFAULT_BATCH_SIZE,
            show_default=True,
        ),
        as_json,
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _bulk(ctx: click.Context, verb: str, opts: dict[str, Any]) -> None:
    try:
        where = RunFilter(
            workflows=opts["workflows"],
            states=opts["states"],
            queues=opts["queues"],
            error_kinds=opts["error_kinds"],
            since=_when(opts["since"], "--since"),
            until=_when(opts["until"], "--until"),
            ended_since=_when(opts["ended_since"], "--ended-since"),
            ended_until=_when(opts["ended_until"], "--ended-until"),
            match_all=opts["match_all"],
        )
    except InvalidArgument as exc:
        message = str(exc).replace("RunFilter(match_all=True)", "--all")
        fail(message.replace("an empty RunFilter", "no filter option"))
    json_out: bool = opts["as_json"]
    with client_for(ctx) as client:
        operation: Callable[..., BulkResult] = getattr(client, f"{verb}_many")
        counted = operation(where, dry_run=True)
        if opts["dry_run"]:
            emit(
                _data(counted),
                json_out,
                f"{counted.matched} runs would be {_done(verb)} (dry run: nothing changed)",
            )
            return
        if counted.matched and not opts["yes"]:
            if not sys.stdin.isatty():
                fail(
                    f"{counted.matched} runs would be {_done(verb)}: confirm with --yes "
                    "(or see --dry-run)"
                )
            click.confirm(f"{verb} {counted.matched} runs?", abort=True)
        result = _act(client, operation, where, opts["batch_size"])
    lines = [f"{result.acted} runs {_done(verb)}, {result.skipped} skipped"]
    lines += [f"  run {run_id}: {reason}" for run_id, reason in result.skipped_runs]
    emit(_data(result), json_out, "\n".join(lines))
    if result.skipped and not result.acted:
        sys.exit(EXIT_FAILED)


def _act(
    client: Client, operation: Callable[..., BulkResult], where: RunFilter, batch_size: int
) -> BulkResult:
    def progress(so_far: BulkResult) -> None:
        click.echo(
            f"{so_far.matched} runs done: {so_far.acted} acted on, {so_far.skipped} skipped",
            err=True,
        )

    return operation(where, progress=progress, batch_size=batch_size)


def _done(verb: str) -> str:
    return {"cancel": "cancelled", "retry": "retried", "resume": "resumed"}[verb]


def _data(result: BulkResult) -> dict[str, Any]:
    return {
        "action": result.action,
        "dry_run": result.dry_run,
        "matched": result.matched,
        "acted": result.acted,
        "skipped": result.skipped,
        "skipped_runs": [{"run_id": r, "reason": why} for r, why in result.skipped_runs],
    }


@cli.command(name="cancel-many")
@filter_options
@click.pass_context
def cancel_many(ctx: click.Context, /, **opts: Any) -> None:
    """Cancel every running or paused run the filter selects (child runs included)."""
    _bulk(ctx, "cancel", opts)


@cli.command(name="retry-many")
@filter_options
@click.pass_context
def retry_many(ctx: click.Context, /, **opts: Any) -> None:
    """Retry every failed run the filter selects (--state cancelled: cancelled ones too),
    each as a whole: the nodes that failed it run again with fresh attempts."""
    _bulk(ctx, "retry", opts)


@cli.command(name="resume-many")
@filter_options
@click.pass_context
def resume_many(ctx: click.Context, /, **opts: Any) -> None:
    """Resume every paused run the filter selects."""
    _bulk(ctx, "resume", opts)
