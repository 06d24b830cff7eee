"""``cyclone demo``: migrate, start a worker in this process, run the flagship, show it."""

from __future__ import annotations

import json
import time

import click

from cyclone_dsl.cli import flagship
from cyclone_dsl.cli.render import render_run
from cyclone_dsl.client.sync import Client
from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.errors import RunFailed
from cyclone_dsl.migrate import migrate
from cyclone_dsl.states import StepState
from cyclone_dsl.worker.worker import Worker

TIMEOUT_S = 120


def progress_bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // total if total else 0
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} steps"


def run_demo(dsn: str) -> int:
    """Run the flagship workflow end to end; return the process exit code."""
    click.echo(f"==> database ready (schema version {migrate(dsn)})")
    registry = Registry.from_objects([flagship])
    with (
        Worker(dsn, registry=registry, concurrency=8, lease=10, poll_interval=0.5),
        Client(dsn, registry=registry) as client,
    ):
        click.echo("==> worker started; submitting the flagship workflow 'demo_order'")
        handle = client.submit(flagship.demo_order, "order-1001")
        started = time.monotonic()
        last: tuple[int, int] = (-1, -1)
        approved = False
        while True:
            run = client.get_run(handle.id)
            done, total = client.progress(handle.id)
            if (done, total) != last:
                click.echo(f"    {progress_bar(done, total)}")
                last = (done, total)
            if not approved and run.step("approved").state is StepState.WAITING_SIGNAL:
                click.echo("==> the run waits for a manager's approval: sending signal 'approved'")
                client.signal(handle.id, "approved", {"by": "manager@example.com"})
                approved = True
            if run.is_terminal:
                break
            if time.monotonic() - started > TIMEOUT_S:
                click.echo(f"the run did not finish within {TIMEOUT_S} s", err=True)
                return 1
            time.sleep(0.1)
        click.echo(render_run(client.get_run(handle.id), client.dependencies(handle.id)))
        try:
            result = handle.result(timeout=5)
        except RunFailed as exc:
            click.echo(f"==> run failed: {exc}", err=True)
            return 1
        click.echo(f"==> result: {json.dumps(result, indent=2)}")
        click.echo(f"==> finished in {time.monotonic() - started:.2f}s")
    return 0
