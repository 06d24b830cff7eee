"""``--read-url``: the read-only commands and the dashboard read from a read replica.

At start the replica must answer (else one ``cyclone:`` line, exit 1, as for ``--dsn``);
a server that is not a standby only gets a warning (it may be a pooler in front of the
primary, or a logical replica); a replica that is behind says how far on stderr.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click

from cyclone_dsl.cli.main import database
from cyclone_dsl.client.sync import Client
from cyclone_dsl.db.connect import ENV_READ_URL
from cyclone_dsl.db.replica import StandbyStatus, check_standby
from cyclone_dsl.errors import DatabaseUnavailable

read_url_option = click.option(
    "--read-url",
    envvar=ENV_READ_URL,
    default=None,
    help="Read from this read replica (a streaming standby of the --dsn database); "
    "writes still go to --dsn.",
)


def check_read_url(url: str) -> StandbyStatus:
    """The replica's status; a one-line error if it cannot be reached, a warning on stderr
    if it is not a standby."""
    try:
        status = check_standby(url, name="cyclone-cli")
    except DatabaseUnavailable as exc:
        raise DatabaseUnavailable(f"--read-url: {exc}", exc.cause) from exc
    if not status.in_recovery:
        click.echo(
            "cyclone: warning: --read-url is not a standby (pg_is_in_recovery() is false): "
            "reading from it anyway (fine for a pooler in front of the primary; if it is "
            "the primary itself, leave --read-url out)",
            err=True,
        )
    return status


@contextmanager
def reading_client(ctx: click.Context, read_url: str | None) -> Iterator[Client]:
    """A client on the replica (``read_url``), or on the database when there is none."""
    if not read_url:
        with database(ctx.obj["dsn"]) as dsn:
            listen = ctx.obj["listen_url"] or ""
            with Client(dsn, pooled=ctx.obj["pooled"], listen_dsn=listen) as client:
                yield client
        return
    status = check_read_url(read_url)
    if status.in_recovery and status.behind:
        click.echo(f"cyclone: reading from a {status.describe()}", err=True)
    with Client(read_url, pooled=ctx.obj["pooled"]) as client:
        yield client
