"""A DSN through PgBouncer given without ``pooled=True``: the start-up check fails at once,
saying so, instead of a pool waiting out its timeout on connections PgBouncer refuses
(it rejects the ``options`` startup parameter a direct connection sends)."""

from __future__ import annotations

import time

import pytest

from cyclone_dsl import Client, DatabaseUnavailable, Worker
from tests.pgbouncer import flows


@pytest.mark.parametrize("start", ["client", "worker"])
def test_a_pgbouncer_dsn_without_pooled_fails_at_once_naming_the_fix(
    start: str, pooled_dsn: str
) -> None:
    def begin() -> object:
        if start == "client":
            return Client(pooled_dsn, pooled=False)
        return Worker(pooled_dsn, [flows], pooled=False, grace=1.0).start()

    began = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as caught:
        begin()
    assert time.monotonic() - began < 5  # the pool's wait would be 30 s
    assert caught.value.cause == "unsupported_parameter"
    message = str(caught.value)
    assert "unsupported startup parameter" in message
    assert "pooled=True" in message and "CYCLONE_POOLED" in message
