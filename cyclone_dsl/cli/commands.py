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

from cyclone_dsl.cli.main import EXIT_FAILED, check_reachable, cli, database, emit, fail
from cyclone_dsl.cli.render import render_run
from cyclone_dsl.client.sync import Client
from cyclone_dsl.dsl.registry import Registry, default_registry
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.errors import RunFailed
from cyclone_dsl.payload import JSONValue


@contextmanager
def client_for(ctx: click.Context) -> Iterator[Client]:
    with database(ctx.obj["dsn"]) as dsn:
        check_reachable(dsn)
        with Client(dsn) as client:
            yield client


def parse_json(text: str | None, what: str) -> JSONValue:
    """JSON from the argument, or from a file with ``@path``."""
    if text is None:
        return None
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            fail(f"cannot read {what} file: {exc}")
    try:
        value: JSONValue = json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"{what} is not valid JSON: {exc}")
    return value


def import_modules(names: tuple[str, ...]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
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
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to --wait.")
@imports
@as_json
@click.pass_context
def submit(
    ctx: click.Context,
    workflow: str,
    input_text: str | None,
    key: str | None,
    wait: bool,
    timeout: float,
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
            emit({"run_id": handle.id, "created": handle.created}, as_json, str(handle.id))
            return
        deadline = time.monotonic() + timeout
        last = (-1, -1)
        while not client.get_run(handle.id).is_terminal:
            done, total = client.progress(handle.id)
            if (done, total) != last and not as_json:
                click.echo(f"run {handle.id}: {done}/{total} steps done", err=True)
                last = (done, total)
            if time.monotonic() > deadline:
                fail(f"run {handle.id} did not finish within {timeout}s", EXIT_FAILED)
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
@as_json
@click.pass_context
def runs(
    ctx: click.Context, state: str | None, workflow: str | None, limit: int, as_json: bool
) -> None:
    """List runs, newest first."""
    with client_for(ctx) as client:
        try:
            found = client.list_runs(state=state, workflow=workflow, limit=limit)
        except ValueError as exc:
            fail(str(exc))
        rows = [run_json(r) for r in found]
        lines = [
            f"{r.id:>8}  {r.state:<9}  {r.workflow:<30}  {r.created_at:%Y-%m-%d %H:%M:%S}"
            for r in found
        ]
        emit(rows, as_json, "\n".join(lines) if lines else "no runs")


@cli.command(name="run")
@click.argument("run_id", type=int)
@as_json
@click.pass_context
def show_run(ctx: click.Context, run_id: int, as_json: bool) -> None:
    """Show a run: every node with its state, attempt, timing and error, as a tree."""
    with client_for(ctx) as client:
        run = client.get_run(run_id)
        emit(run_json(run), as_json, render_run(run, client.dependencies(run_id)))


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


def _steer(ctx: click.Context, verb: str, run_id: int) -> None:
    with client_for(ctx) as client:
        getattr(client, verb)(run_id)
    click.echo(f"run {run_id}: {verb} done")


@cli.command()
@click.argument("run_id", type=int)
@click.pass_context
def cancel(ctx: click.Context, run_id: int) -> None:
    """Cancel a run and its child runs."""
    _steer(ctx, "cancel", run_id)


@cli.command()
@click.argument("run_id", type=int)
@click.pass_context
def pause(ctx: click.Context, run_id: int) -> None:
    """Pause a running run."""
    _steer(ctx, "pause", run_id)


@cli.command()
@click.argument("run_id", type=int)
@click.pass_context
def resume(ctx: click.Context, run_id: int) -> None:
    """Resume a paused run."""
    _steer(ctx, "resume", run_id)


@cli.command()
@click.argument("run_id", type=int)
@click.argument("node")
@click.pass_context
def retry(ctx: click.Context, run_id: int, node: str) -> None:
    """Retry a discarded or cancelled NODE of a run (fresh attempts)."""
    with client_for(ctx) as client:
        client.retry(run_id, node)
    click.echo(f"run {run_id}: node {node!r} will run again")


@cli.command()
@as_json
@click.pass_context
def schedules(ctx: click.Context, as_json: bool) -> None:
    """List cron schedules: next fire, last run, last error."""
    with client_for(ctx) as client:
        found = client.list_schedules()
    lines = [
        f"{s.id:<24} {s.cron_spec:<16} next {s.next_run_at:%Y-%m-%d %H:%M %Z}"
        f"  last run {s.last_run_id or '-'}"
        f"{'  DISABLED' if not s.enabled else ''}"
        f"{'  error: ' + s.last_error if s.last_error else ''}"
        for s in found
    ]
    emit([attrs.asdict(s) for s in found], as_json, "\n".join(lines) if lines else "no schedules")


@cli.command()
@as_json
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Queues and kinds: available, running, waiting, oldest available age, expired leases."""
    with client_for(ctx) as client:
        data = client.stats()
    lines = ["queue                available  running  waiting  oldest(s)  expired"]
    lines += [
        f"{q['queue']:<20} {q['available']:>9} {q['running']:>8} {q['waiting']:>8}"
        f" {q['oldest_available_s'] or 0:>10.1f} {q['expired_leases']:>8}"
        for q in data["queues"]
    ]
    if data["kinds"]:
        lines += ["", "kind                 state        steps  oldest(s)  expired"]
        lines += [
            f"{k['kind']:<20} {k['state']:<12} {k['count']:>6}"
            f" {k['oldest_available_s'] or 0:>10.1f} {k['expired_leases']:>8}"
            for k in data["kinds"]
        ]
    if data["unserved"]:
        lines += ["", "waiting for a worker that has their definition (see the versioning guide):"]
        lines += [
            f"  {u['steps']:>6} steps of {u['kind']!r} in queue {u['queue']!r}"
            + (
                ""
                if u["def_version"] == "standalone"
                else f" (workflow {u['workflow']!r} at {u['def_version']})"
            )
            + f", due since {u['oldest']:%Y-%m-%d %H:%M:%S %Z}"
            for u in data["unserved"]
        ]
    emit(data, as_json, "\n".join(lines))


@cli.command()
@as_json
@click.option("--all", "show_all", is_flag=True, help="Also workers that stopped or went silent.")
@click.pass_context
def workers(ctx: click.Context, as_json: bool, show_all: bool) -> None:
    """Live workers: where they run, their queues and the workflow versions they serve."""
    with client_for(ctx) as client:
        rows = [w for w in client.workers() if show_all or w["live"]]
    lines = []
    for w in rows:
        state = "live" if w["live"] else ("stopped" if w["stopped_at"] else "silent")
        lines.append(
            f"{w['id']}  [{state}]  queues {','.join(w['queues'])}  concurrency {w['concurrency']}"
            f"  last beat {w['heartbeat_at']:%H:%M:%S}  cyclone {w['package_version']}"
        )
        lines += [f"    {v['workflow']} {v['def_version']}" for v in w["versions"]]
        lines.append(f"    kinds: {', '.join(sorted(w['handlers']))}")
    emit(rows, as_json, "\n".join(lines) if lines else "no live workers")


@cli.command()
@click.option("--older-than", default=0.0, show_default=True, help="Seconds since the run ended.")
@click.option("--batch-size", default=1000, show_default=True)
@as_json
@click.pass_context
def purge(ctx: click.Context, older_than: float, batch_size: int, as_json: bool) -> None:
    """Delete terminal runs that ended more than --older-than seconds ago."""
    with client_for(ctx) as client:
        count = client.purge(older_than=timedelta(seconds=older_than), batch_size=batch_size)
    emit({"deleted": count}, as_json, f"deleted {count} runs")


@cli.command()
@imports
@click.option("--once", is_flag=True, help="One pass, then exit.")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between passes.")
@click.pass_context
def scan(ctx: click.Context, modules: tuple[str, ...], once: bool, interval: float) -> None:
    """Run the scanner alone: expired leases, timeouts, timers, deadlines, schedules, retention."""
    from cyclone_dsl.db.connect import make_pool
    from cyclone_dsl.dsl import runs
    from cyclone_dsl.engine import Engine
    from cyclone_dsl.worker.scanner import Scanner

    import_modules(modules)
    registry: Registry = default_registry()
    with database(ctx.obj["dsn"]) as dsn:
        pool = make_pool(dsn, name="cyclone-scan")
        stopping = threading.Event()
        engine = Engine(
            compile_child=runs.child_compiler(registry),
            compile_schedule=runs.compiler_for(registry),
        )
        scanner = Scanner(
            pool,
            engine,
            interval=interval,
            max_reclaims={k: s.max_reclaims for k, s in registry.handlers() if s.max_reclaims},
            default_max_reclaims=3,
            stopping=stopping,
            owner="cyclone-scan",
            retention=timedelta(days=7),
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
@click.option("--port", default=8080, show_default=True)
@click.option("--read-only", is_flag=True, help="Refuse every write (cancel, signal, ...).")
@click.option("--token", envvar="CYCLONE_UI_TOKEN", help="Require this secret on every write.")
@click.pass_context
def ui(ctx: click.Context, host: str, port: int, read_only: bool, token: str | None) -> None:
    """Serve the web dashboard (loopback only unless --host says otherwise)."""
    try:
        import uvicorn

        from cyclone_dsl.ui.app import create_app
    except ImportError:
        fail("the dashboard needs the 'ui' extra: pip install 'cyclone-dsl[ui]'")
    with client_for(ctx) as client:
        app = create_app(client, read_only=read_only, token=token)
        click.echo(f"cyclone ui on http://{host}:{port}" + (" (read-only)" if read_only else ""))
        uvicorn.run(app, host=host, port=port, log_level="warning")
