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
from cyclone_dsl.worker.worker import Worker


def progress_bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // total if total else 0
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} steps"


def run_demo(dsn: str) -> int:
    click.echo(f"==> migrating the database (schema version {migrate(dsn)})")
    registry = Registry.from_objects([flagship])
    with (
        Worker(dsn, registry=registry, concurrency=8, lease=10),
        Client(dsn, registry=registry) as client,
    ):
        click.echo("==> worker started; submitting the flagship workflow 'demo_order'")
        handle = client.submit(flagship.demo_order, "order-1001")
        started = time.monotonic()
        last = (-1, -1)
        while True:
            done, total = client.progress(handle.id)
            if (done, total) != last:
                click.echo(f"    {progress_bar(done, total)}")
                last = (done, total)
            if client.get_run(handle.id).is_terminal:
                break
            if time.monotonic() - started > 120:
                click.echo("the run did not finish within 120 s", err=True)
                return 1
            time.sleep(0.1)
        run = client.get_run(handle.id)
        click.echo(render_run(run, client.dependencies(handle.id)))
        try:
            result = handle.result(timeout=5)
        except RunFailed as exc:
            click.echo(f"==> run failed: {exc}", err=True)
            return 1
        click.echo(f"==> result: {json.dumps(result)}")
        click.echo(f"==> finished in {time.monotonic() - started:.2f}s")
    return 0
