"""A workflow with a join, a signal wait, a fan-out and a child run completes with the
worker and the client going through PgBouncer in transaction pooling mode: with LISTEN on
a direct connection (``listen_dsn``), and without LISTEN at all (polling, said once)."""

from __future__ import annotations

import logging

import pytest

from cyclone_dsl import Client, Worker
from tests.faults.test_load_and_kills import server_log_tail
from tests.pgbouncer import flows
from tests.pgbouncer.conftest import PgBouncer

POLLING_LINE = "no LISTEN connection"


@pytest.mark.parametrize("wake", ["listen", "poll"])
def test_workflow_completes_through_pgbouncer(
    wake: str,
    pooled_dsn: str,
    cyclone_dsn: str,
    cyclone_admin_dsn: str,
    pgbouncer: PgBouncer,
    alias: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cyclone.worker")
    log_before = len(server_log_tail(cyclone_admin_dsn))
    pgbouncer_log_before = len(pgbouncer.log_text())
    # With LISTEN, only wake-ups can move the runs along in time: the worker's poll
    # would come after a minute. Without, the worker polls often.
    listen_dsn, poll = (cyclone_dsn, 60.0) if wake == "listen" else ("", 0.1)
    with (
        Worker(
            pooled_dsn,
            [flows],
            pooled=True,
            listen_dsn=listen_dsn,
            poll_interval=poll,
            scan_interval=0.2,
            grace=5.0,
        ),
        Client(pooled_dsn, pooled=True, listen_dsn=listen_dsn) as client,
    ):
        handles = [client.submit(flows.outer, n) for n in (3, 4, 5, 6)]
        for handle in handles:
            client.signal(handle.id, "approved", {"by": "ana"})
        results = [handle.result(timeout=30) for handle in handles]
    assert results == [flows.expected(n, {"by": "ana"}) for n in (3, 4, 5, 6)]
    # It all went through PgBouncer...
    assert pgbouncer.stats(alias)["total_xact_count"] > 50
    # ...without a prepared statement living on one server session only, or a startup
    # parameter PgBouncer refuses.
    new_log = server_log_tail(cyclone_admin_dsn)[log_before:]
    assert "prepared statement" not in new_log
    assert "unsupported startup parameter" not in pgbouncer.log_text()[pgbouncer_log_before:]
    polling = [r for r in caplog.records if POLLING_LINE in r.getMessage()]
    assert len(polling) == (1 if wake == "poll" else 0)
