"""Commands that read and steer runs: submit, runs, run, signal, cancel, pause, resume, retry,
schedules, stats, purge, scan."""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import click

from cyclone_dsl.arguments import check_seconds
from cyclone_dsl.cli.main import (
    EXIT_FAILED,
    check_migrated,
    cli,
    database,
    emit,
    fail,
    max_reclaims_option,
)
from cyclone_dsl.cli.reads import check_read_url, read_url_option, reading_client
from cyclone_dsl.cli.render import event_line, printable, render_run
from cyclone_dsl.cli.values import Duration, Retention, human_duration, to_json_line
from cyclone_dsl.client import base
from cyclone_dsl.client.sync import Client
from cyclone_dsl.db.connect import ENV_READ_URL
from cyclone_dsl.dsl.registry import Registry, default_registry
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.engine import DEFAULT_RETENTION
from cyclone_dsl.errors import RunFailed
from cyclone_dsl.graph.rows import KIND_CHILD
from cyclone_dsl.payload import JSONValue
from cyclone_dsl.states import RunState, StepState


@contextmanager
def client_for(ctx: click.Context) -> Iterator[Client]:
    with (
        database(ctx.obj["dsn"]) as dsn,
        Client(dsn, pooled=ctx.obj["pooled"], listen_dsn=ctx.obj["listen_url"] or "") as client,
    ):
        yield client


def parse_json(text: str | None, what: str) -> JSONValue:
    """JSON from the argument, or from a file with ``@path``."""
    if text is None:
        return None
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            fail(f"cannot read {what} file: {exc}")
        except UnicodeDecodeError as exc:
            fail(f"cannot read {what} file {text[1:]!r}: it is not UTF-8 text ({exc.reason})")
    try:
        value: JSONValue = json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"{what} is not valid JSON: {exc}")
    except RecursionError:
        fail(f"{what} is not JSON Cyclone takes: it is nested too deeply")
    except ValueError as exc:  # an integer past Python's limit on digits
        fail(f"{what} is not JSON Cyclone takes: {exc}")
    return value


def import_modules(names: tuple[str, ...]) -> None:
    for name in names:
        import_module(name)


def import_module(name: str) -> object:
    """The module ``name``, or a one-line usage error (an empty or relative name raises
    ValueError or TypeError, not ImportError)."""
    try:
        return importlib.import_module(name)
    except (ImportError, ValueError, TypeError) as exc:
        fail(f"cannot import {name!r}: {exc}")


def resolve_workflow(spec: str) -> WorkflowDef:
    """``module:attribute`` or a name registered by an imported module."""
    if ":" in spec:
        module_name, attribute = spec.split(":", 1)
        import_modules((module_name,))
        found = getattr(sys.modules[module_name], attribute, None)
        if not isinstance(found, WorkflowDef):
            fail(f"{spec!r} is not a @workflow")
        return found
    return default_registry().workflow(spec)


def resolve_target(spec: str, modules: tuple[str, ...]) -> object:
    """A workflow, step or action: ``module:attribute``, or a registered name."""
    import_modules(modules)
    if ":" in spec:
        module_name, attribute = spec.split(":", 1)
        import_modules((module_name,))
        found = getattr(sys.modules[module_name], attribute, None)
        if found is None:
            fail(f"module {module_name!r} has no {attribute!r}")
        return found
    return spec


def run_json(run: Any) -> dict[str, Any]:
    data = attrs.asdict(run, recurse=True)
    return data


imports = click.option(
    "--import", "-m", "modules", multiple=True, help="Import this module first (repeatable)."
)
as_json = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


@cli.command()
@click.argument("workflow")
@click.option("--input", "input_text", help="Run input as JSON, or @file.")
@click.option("--once", "key", help="Submit key: return the existing run for this key.")
@click.option("--wait", is_flag=True, help="Wait for the end, with live progress.")
@click.option(
    "--timeout",
    type=Duration(),
    default="600s",
    show_default=True,
    help="How long to --wait (600, 30s, 5m...).",
)
@imports
@as_json
@click.pass_context
def submit(
    ctx: click.Context,
    workflow: str,
    input_text: str | None,
    key: str | None,
    wait: bool,
    timeout: timedelta,
    modules: tuple[str, ...],
    as_json: bool,
) -> None:
    """Submit a run of WORKFLOW (module:name, or a name from an --import-ed module)."""
    import_modules(modules)
    definition = resolve_workflow(workflow)
    value = parse_json(input_text, "--input")
    with client_for(ctx) as client:
        if key is not None:
            handle = client.submit_once(definition, value, key=key)
        else:
            handle = client.submit(definition, value)
        if not wait:
            text = str(handle.id)
            if not handle.created:
                text = f"{handle.id} (existing run for key {key!r}: nothing new was created)"
            emit({"run_id": handle.id, "created": handle.created}, as_json, text)
            return
        deadline = time.monotonic() + timeout.total_seconds()
        last = (-1, -1)
        while not client.get_run(handle.id).is_terminal:
            done, total = client.progress(handle.id)
            if (done, total) != last and not as_json:
                click.echo(f"run {handle.id}: {done}/{total} steps done", err=True)
                last = (done, total)
            if time.monotonic() > deadline:
                fail(
                    f"run {handle.id} did not finish within {human_duration(timeout)}",
                    EXIT_FAILED,
                )
            time.sleep(0.2)
        try:
            result = handle.result(timeout=5)
        except RunFailed as exc:
            fail(str(exc), EXIT_FAILED)
        except Exception as exc:  # noqa: BLE001 - NoOutput and friends become a one-line message
            emit({"run_id": handle.id, "result": None}, as_json, f"run {handle.id}: {exc}")
            return
        emit({"run_id": handle.id, "result": result}, as_json, json.dumps(result))


@cli.command()
@click.option("--state", help="Only runs in this state.")
@click.option("--workflow", help="Only runs of this workflow.")
@click.option("--limit", default=20, show_default=True)
@read_url_option
@as_json
@click.pass_context
def runs(
    ctx: click.Context,
    state: str | None,
    workflow: str | None,
    limit: int,
    read_url: str | None,
    as_json: bool,
) -> None:
    """List runs, newest first."""
    with reading_client(ctx, read_url) as client:
        try:
            found = client.list_runs(state=state, workflow=workflow, limit=limit)
        except ValueError as exc:
            fail(str(exc))
        rows = [run_json(r) for r in found]
        lines = [f"{'run':>8}  {'state':<9}  {'workflow':<30}  created"]
        lines += [
            f"{r.id:>8}  {r.state:<9}  {printable(r.workflow):<30}  "
            f"{r.created_at:%Y-%m-%d %H:%M:%S %Z}"
            for r in found
        ]
        emit(rows, as_json, "\n".join(lines) if found else "no runs")


@cli.command(name="run")
@click.argument("run_id", type=int)
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Print the run's events (ctx.emit, ctx.progress) as they come, one line each, until "
    "the run ends; then its final state (exit 1 unless it completed).",
)
@click.option(
    "--after", default=0, show_default=True, help="With --follow: start after this event seq."
)
@read_url_option
@as_json
@click.pass_context
def show_run(
    ctx: click.Context, run_id: int, follow: bool, after: int, read_url: str | None, as_json: bool
) -> None:
    """Show a run: every node with its state, attempt, timing and error, as a tree; with
    --follow, print its events live until it ends (from --dsn: a replica gets no wake-ups)."""
    if follow:
        follow_run(ctx, run_id, after, as_json)
        return
    with reading_client(ctx, read_url) as client:
        run = client.get_run(run_id)
        children = {c["parent_node_id"]: c["id"] for c in client.children_of(run_id)}
        reasons = client.why_waiting(run_id)
        if as_json:
            emit({**run_json(run), "child_runs": children, "waiting_for": reasons}, True, "")
            return
        text = render_run(run, client.dependencies(run_id), children=children, reasons=reasons)
        emit(None, False, text)


def follow_run(ctx: click.Context, run_id: int, after: int, as_json: bool) -> None:
    """Print the run's events live (JSON Lines with --json), then how it ended."""
    with client_for(ctx) as client:
        for event in client.events(run_id, after=after):
            click.echo(to_json_line(attrs.asdict(event)) if as_json else event_line(event))
        run = client.get_run(run_id)
    failed = next((s for s in run.steps if s.state is StepState.DISCARDED), None)
    where = f" at node {failed.node!r}: {failed.error}" if failed and failed.error else ""
    final = {"run_id": run_id, "state": run.state.value}
    text = printable(f"run {run_id} {run.workflow} {run.state.value}{where}")
    click.echo(to_json_line(final) if as_json else text)
    if run.state is not RunState.COMPLETED:
        sys.exit(EXIT_FAILED)


@cli.command()
@click.argument("run_id", type=int)
@click.argument("name")
@click.argument("payload", required=False)
@as_json
@click.pass_context
def signal(ctx: click.Context, run_id: int, name: str, payload: str | None, as_json: bool) -> None:
    """Send signal NAME (with an optional JSON PAYLOAD) to a run."""
    value = parse_json(payload, "PAYLOAD")
    with client_for(ctx) as client:
        delivery = client.signal(run_id, name, value)
        emit({"delivery": delivery.value}, as_json, f"signal {name!r}: {delivery.value}")


def _steer(ctx: click.Context, verb: str, run_id: int, as_json: bool) -> None:
    with client_for(ctx) as client:
        getattr(client, verb)(run_id)
        state = client.get_run(run_id).state
    emit(
        {"run_id": run_id, "action": verb, "state": state.value},
        as_json,
        f"run {run_id}: {verb} done (now {state.value})",
    )


@cli.command()
@click.argument("run_id", type=int)
@as_json
@click.pass_context
def cancel(ctx: click.Context, run_id: int, as_json: bool) -> None:
    """Cancel a run and its child runs."""
    _steer(ctx, "cancel", run_id, as_json)


@cli.command()
@click.argument("run_id", type=int)
@as_json
@click.pass_context
def pause(ctx: click.Context, run_id: int, as_json: bool) -> None:
    """Pause a running run."""
    _steer(ctx, "pause", run_id, as_json)


@cli.command()
@click.argument("run_id", type=int)
@as_json
@click.pass_context
def resume(ctx: click.Context, run_id: int, as_json: bool) -> None:
    """Resume a paused run."""
    _steer(ctx, "resume", run_id, as_json)


@cli.command()
@click.argument("run_id", type=int)
@click.argument("node")
@click.option(
    "--force",
    is_flag=True,
    help="Replay: NODE may have completed; it and everything downstream run again.",
)
@as_json
@click.pass_context
def retry(ctx: click.Context, run_id: int, node: str, force: bool, as_json: bool) -> None:
    """Retry a discarded or cancelled NODE of a run (fresh attempts); with --force, replay a
    completed one and its downstream."""
    with client_for(ctx) as client:
        client.retry(run_id, node, force=force)
        state = client.get_run(run_id).state
    what = "and everything downstream of it will run again" if force else "will run again"
    emit(
        {"run_id": run_id, "action": "retry", "node": node, "force": force, "state": state.value},
        as_json,
        f"run {run_id}: node {node!r} {what} (run now {state.value})",
    )


@cli.command()
@click.argument("run_id", type=int)
@click.argument("node")
@click.option("--input", "input_text", help="A new run input as JSON, or @file.")
@click.option(
    "--current-definition",
    is_flag=True,
    help="Fork onto this process's definition of the workflow (copied nodes keep their kind).",
)
@imports
@as_json
@click.pass_context
def fork(
    ctx: click.Context,
    run_id: int,
    node: str,
    input_text: str | None,
    current_definition: bool,
    modules: tuple[str, ...],
    as_json: bool,
) -> None:
    """Start a new run of RUN_ID's workflow from NODE: what the run completed outside NODE's
    downstream part is copied, the rest runs again (needs the workflow: --import its module)."""
    import_modules(modules)
    given = {} if input_text is None else {"input": parse_json(input_text, "--input")}
    with client_for(ctx) as client:
        handle = client.fork(run_id, node, current_definition=current_definition, **given)
        copied = [s.node for s in client.get_run(handle.id).steps if s.copied]
    emit(
        {"run_id": handle.id, "forked_from": run_id, "from_node": node, "copied": copied},
        as_json,
        f"{handle.id} (fork of run {run_id} from {node!r}; copied: {', '.join(copied) or 'none'})",
    )


@cli.group(invoke_without_command=True)
@read_url_option
@as_json
@click.pass_context
def schedules(ctx: click.Context, read_url: str | None, as_json: bool) -> None:
    """List cron schedules (zone, enabled, next fire, last run, last error); or change them
    with a subcommand."""
    if ctx.invoked_subcommand is not None:
        return
    with reading_client(ctx, read_url) as client:
        found = client.list_schedules()
    lines = [f"{'id':<24} {'cron':<16} {'zone':<16} {'enabled':<8} next fire / last run"]
    lines += [
        f"{printable(s.id):<24} {s.cron_spec:<16} {s.location:<16} "
        f"{'yes' if s.enabled else 'no':<8}"
        f" next {s.next_run_at:%Y-%m-%d %H:%M %Z}  last run {s.last_run_id or '-'}"
        f"{'  error: ' + printable(s.last_error) if s.last_error else ''}"
        for s in found
    ]
    emit(found, as_json, "\n".join(lines) if found else "no schedules")


@schedules.command(name="add")
@click.argument("target")
@click.argument("cron")
@click.option("--id", "schedule_id", help="Schedule id (default: the target's name).")
@click.option("--location", help="IANA time zone of the cron (default: the machine's).")
@click.option("--input", "input_text", help="Input of each fire, as JSON or @file.")
@click.option("--disabled", is_flag=True, help="Create it disabled.")
@click.option("--queue", help="Queue of the fired steps.")
@click.option("--priority", type=int, help="Priority of the fired steps.")
@click.option("--max-attempts", type=int, help="Attempts of the fired steps.")
@click.option("--timeout", type=Duration(), help="Timeout of each fired step (30s, 5m...).")
@click.option("--retention", type=Duration(), help="How long fired runs are kept (7d...).")
@imports
@as_json
@click.pass_context
def schedules_add(
    ctx: click.Context,
    target: str,
    cron: str,
    schedule_id: str | None,
    location: str | None,
    input_text: str | None,
    disabled: bool,
    queue: str | None,
    priority: int | None,
    max_attempts: int | None,
    timeout: timedelta | None,
    retention: timedelta | None,
    modules: tuple[str, ...],
    as_json: bool,
) -> None:
    """Create or update a schedule of TARGET (a workflow, step or action: module:name, or
    a name from an --import-ed module) on CRON."""
    definition = resolve_target(target, modules)
    value = parse_json(input_text, "--input")
    with client_for(ctx) as client:
        created = client.schedule(
            definition,
            cron,
            id=schedule_id,
            location=location,
            enabled=not disabled,
            input=value,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            retention=retention,
        )
    emit(
        created,
        as_json,
        f"schedule {printable(created.id)}: {created.cron_spec} ({created.location}), next fire "
        f"{created.next_run_at:%Y-%m-%d %H:%M %Z}" + ("" if created.enabled else ", disabled"),
    )


def _enable(ctx: click.Context, schedule_id: str, enabled: bool, as_json: bool) -> None:
    with client_for(ctx) as client:
        client.enable_schedule(schedule_id, enabled)
    word = "enabled" if enabled else "disabled"
    text = f"schedule {printable(schedule_id)}: {word}"
    emit({"id": schedule_id, "enabled": enabled}, as_json, text)


@schedules.command(name="enable")
@click.argument("schedule_id")
@as_json
@click.pass_context
def schedules_enable(ctx: click.Context, schedule_id: str, as_json: bool) -> None:
    """Enable a schedule."""
    _enable(ctx, schedule_id, True, as_json)


@schedules.command(name="disable")
@click.argument("schedule_id")
@as_json
@click.pass_context
def schedules_disable(ctx: click.Context, schedule_id: str, as_json: bool) -> None:
    """Disable a schedule (it keeps its slot; enable fires at most the latest slot it missed;
    a worker's start does not enable it again)."""
    _enable(ctx, schedule_id, False, as_json)


@schedules.command(name="rm")
@click.argument("schedule_id")
@as_json
@click.pass_context
def schedules_rm(ctx: click.Context, schedule_id: str, as_json: bool) -> None:
    """Delete a schedule (the runs it fired stay)."""
    with client_for(ctx) as client:
        client.unschedule(schedule_id)
    text = f"schedule {printable(schedule_id)}: deleted"
    emit({"id": schedule_id, "deleted": True}, as_json, text)


def limit_line(row: dict[str, Any]) -> str:
    """One limited share: ``step:send  tenant-7  3/3  12 waiting`` (a rate: its window)."""
    used = f"{row['in_use']}/{row['max_count']}"
    if row["per_s"] is not None:
        used += f" per {human_duration(timedelta(seconds=row['per_s']))}"
    key = printable(row["key"]) if row["key"] else "-"
    line = f"{printable(row['scope']):<30} {key:<20} {used:>6} {row['waiting']:>8}"
    if row["next_free_at"] is not None:
        line += f"  full until {row['next_free_at']:%H:%M:%S}"
    return line


@cli.command()
@read_url_option
@as_json
@click.pass_context
def stats(ctx: click.Context, read_url: str | None, as_json: bool) -> None:
    """Queues and kinds: available, running, waiting, oldest available age, expired leases."""
    with reading_client(ctx, read_url) as client:
        data = client.stats()
    lines = ["queue                available  running  waiting  oldest(s)  expired"]
    lines += [
        f"{printable(q['queue']):<20} {q['available']:>9} {q['running']:>8} {q['waiting']:>8}"
        f" {q['oldest_available_s'] or 0:>10.1f} {q['expired_leases']:>8}"
        for q in data["queues"]
    ]
    if data["kinds"]:
        lines += ["", "kind                 state        steps  oldest(s)  expired"]
        lines += [
            f"{printable(k['kind']):<20} {k['state']:<12} {k['count']:>6}"
            f" {k['oldest_available_s'] or 0:>10.1f} {k['expired_leases']:>8}"
            for k in data["kinds"]
        ]
    if data["limits"]:
        lines += ["", "limit                          key                  in use  waiting"]
        lines += [limit_line(row) for row in data["limits"]]
    if data["unserved"]:
        lines += ["", "waiting for a worker that has their definition (see the versioning guide):"]
        lines += [
            f"  {u['steps']:>6} "
            + (
                "child runs to start"
                if u["kind"] == KIND_CHILD
                else f"steps of {printable(repr(u['kind']))}"
            )
            + f" in queue {printable(repr(u['queue']))}"
            + (
                ""
                if u["def_version"] == "standalone"
                else f" (workflow {printable(repr(u['workflow']))} at {u['def_version']})"
            )
            + f", due since {u['oldest']:%Y-%m-%d %H:%M:%S %Z}"
            for u in data["unserved"]
        ]
    emit(data, as_json, "\n".join(lines))


@cli.command()
@as_json
@click.option("--all", "show_all", is_flag=True, help="Also workers that stopped or went silent.")
@read_url_option
@click.pass_context
def workers(ctx: click.Context, as_json: bool, show_all: bool, read_url: str | None) -> None:
    """Live workers: where they run, their queues and the workflow versions they serve."""
    with reading_client(ctx, read_url) as client:
        rows = [w for w in client.workers() if show_all or w["live"]]
    lines = []
    for w in rows:
        state = "live" if w["live"] else ("stopped" if w["stopped_at"] else "silent")
        lines.append(
            f"{printable(w['id'])}  [{state}]  queues {printable(','.join(w['queues']))}"
            f"  concurrency {w['concurrency']}"
            f"  last beat {w['heartbeat_at']:%H:%M:%S}  cyclone {w['package_version']}"
        )
        lines += [f"    {printable(v['workflow'])} {v['def_version']}" for v in w["versions"]]
        lines.append(f"    kinds: {printable(', '.join(sorted(w['handlers'])))}")
    emit(rows, as_json, "\n".join(lines) if lines else "no live workers")


@cli.command()
@click.option(
    "--older-than",
    type=Duration(),
    default=human_duration(DEFAULT_RETENTION),
    show_default=True,
    help="Only runs that ended at least this long ago (30s, 15m, 12h, 7d, 2w).",
)
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([s.value for s in base.ENDED_STATES]),
    help="Only runs in this state (repeatable; default: completed, failed and cancelled).",
)
@click.option("--dry-run", is_flag=True, help="Only count the runs that would be deleted.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--batch-size",
    type=click.IntRange(1, 2**63 - 1),  # checked with --dry-run too
    default=1000,
    show_default=True,
)
@as_json
@click.pass_context
def purge(
    ctx: click.Context,
    older_than: timedelta,
    states: tuple[str, ...],
    dry_run: bool,
    yes: bool,
    batch_size: int,
    as_json: bool,
) -> None:
    """Delete ended runs that ended more than --older-than ago (default: the retention)."""
    wanted: tuple[RunState | str, ...] = states or base.ENDED_STATES
    age = human_duration(older_than)
    with client_for(ctx) as client:
        count = client.count_purgeable(older_than=older_than, states=wanted)
        if dry_run:
            emit(
                {"would_delete": count, "older_than_s": older_than.total_seconds()},
                as_json,
                f"{count} runs ended more than {age} ago would be deleted",
            )
            return
        if count and not yes:
            if not sys.stdin.isatty():
                fail(f"{count} runs would be deleted: confirm with --yes (or see --dry-run)")
            click.confirm(f"delete {count} runs that ended more than {age} ago?", abort=True)
        deleted = client.purge(older_than=older_than, states=wanted, batch_size=batch_size)
    emit({"deleted": deleted}, as_json, f"deleted {deleted} runs")


@cli.command(name="queue-limit")
@click.argument("queue")
@click.argument("limit")
@as_json
@click.pass_context
def queue_limit(ctx: click.Context, queue: str, limit: str, as_json: bool) -> None:
    """Cap how many steps of QUEUE run at once across all workers (LIMIT: a number, or
    'none' to remove the cap). Workers pick it up within seconds."""
    cap: int | None = None
    if limit.lower() != "none":
        try:
            cap = int(limit)
        except ValueError:
            fail(f"LIMIT must be a number >= 1 or 'none', not {limit!r}")
    with client_for(ctx) as client:
        client.set_queue_limit(queue, cap)
    text = f"queue {queue!r}: at most {cap} running" if cap else f"queue {queue!r}: no cap"
    emit({"queue": queue, "limit": cap}, as_json, text)


@cli.command()
@imports
@click.option("--once", is_flag=True, help="One pass, then exit.")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between passes.")
@click.option(
    "--retention",
    type=Retention(),
    default=human_duration(DEFAULT_RETENTION),
    show_default=True,
    help="How long ended runs are kept when no step sets a retention; none: keep them.",
)
@max_reclaims_option
@click.pass_context
def scan(
    ctx: click.Context,
    modules: tuple[str, ...],
    once: bool,
    interval: float,
    retention: timedelta | None,
    max_reclaims: int,
) -> None:
    """Run the scanner alone: expired leases, timeouts, timers, deadlines, schedules, retention."""
    from cyclone_dsl.db.connect import make_pool
    from cyclone_dsl.db.diagnose import require_writable
    from cyclone_dsl.dsl import runs
    from cyclone_dsl.engine import Engine
    from cyclone_dsl.migrate import checked_connection
    from cyclone_dsl.worker.scanner import Scanner

    check_seconds("--interval", interval, positive=True)
    import_modules(modules)
    registry: Registry = default_registry()
    with database(ctx.obj["dsn"]) as dsn:
        pooled = ctx.obj["pooled"]
        checked = checked_connection(dsn, name="cyclone-scan", pooled=pooled)
        try:
            require_writable(checked, dsn)
        except BaseException:
            checked.close()
            raise
        pool = make_pool(dsn, name="cyclone-scan", pooled=pooled, first=checked)
        stopping = threading.Event()
        engine = Engine(
            compile_child=runs.child_compiler(registry),
            compile_schedule=runs.compiler_for(registry),
        )
        scanner = Scanner(
            pool,
            engine,
            interval=interval,
            max_reclaims={
                k: s.max_reclaims for k, s in registry.handlers() if s.max_reclaims is not None
            },
            default_max_reclaims=max_reclaims,
            stopping=stopping,
            owner="cyclone-scan",
            retention=retention,
        )
        try:
            if once:
                changed = scanner.scan_once()
                click.echo(f"scan pass done: {changed} rows changed")
            else:
                scanner.run()
        except KeyboardInterrupt:
            stopping.set()
        finally:
            pool.close()


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--read-only", is_flag=True, help="Refuse every write (cancel, signal, ...).")
@click.option("--token", envvar="CYCLONE_UI_TOKEN", help="Require this secret on every write.")
@click.option(
    "--read-url",
    envvar=ENV_READ_URL,
    default=None,
    help="Read every page from this read replica (its lag shown); actions go to --dsn.",
)
@imports
@click.pass_context
def ui(
    ctx: click.Context,
    host: str,
    port: int,
    read_only: bool,
    token: str | None,
    read_url: str | None,
    modules: tuple[str, ...],
) -> None:
    """Serve the web dashboard (loopback only unless --host says otherwise); --import the
    workflows' modules to fork runs from the run page; --read-url reads from a replica."""
    import_modules(modules)
    try:
        import uvicorn

        from cyclone_dsl.ui.app import create_app
    except ImportError:
        fail("the dashboard needs the 'ui' extra: pip install 'cyclone-dsl[ui]'")
    if read_url:
        check_read_url(read_url)
        check_migrated(read_url, pooled=ctx.obj["pooled"])
    with client_for(ctx) as client:
        app = create_app(client, read_only=read_only, token=token, read_dsn=read_url or None)
        notes = [
            " (read-only)" if read_only else "",
            " (pages read from --read-url)" * bool(read_url),
        ]
        click.echo(f"cyclone ui on http://{host}:{port}" + "".join(notes))
        uvicorn.run(app, host=host, port=port, log_level="warning")
