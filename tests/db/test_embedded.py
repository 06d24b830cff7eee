"""The embedded server: started in a project-local folder, shared, reused, stopped cleanly."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import psycopg
import pytest

from cyclone_dsl.db import embedded
from cyclone_dsl.db.embedded import EmbeddedServer, embedded_database
from tests.waiting import wait_until


def test_start_reuse_and_stop(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "pg")
    url = server.start()
    assert server.started_here
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    again = EmbeddedServer(tmp_path / "pg")
    assert again.start() == url
    assert not again.started_here  # reused, not started twice
    server.stop()
    assert not server.is_running()
    assert (tmp_path / "pg" / "PG_VERSION").exists()  # the folder is kept for the next run


DURABILITY = (
    "SELECT current_setting('fsync'), current_setting('synchronous_commit'), "
    "current_setting('full_page_writes')"
)


def test_a_server_for_test_data_is_started_without_durability_and_does_not_keep_it(
    tmp_path: Path,
) -> None:
    fast = EmbeddedServer(tmp_path / "pg", durable=False)
    url = fast.start()
    try:
        with psycopg.connect(url) as conn:
            assert conn.execute(DURABILITY).fetchone() == ("off", "off", "off")
    finally:
        fast.stop()
    durable = EmbeddedServer(tmp_path / "pg")  # the next start: nothing was written down
    url = durable.start()
    try:
        with psycopg.connect(url) as conn:
            assert conn.execute(DURABILITY).fetchone() == ("on", "on", "on")
    finally:
        durable.stop()


def test_the_last_user_stops_the_shared_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(embedded.ENV_URL, raising=False)
    monkeypatch.setenv(embedded.ENV_DATA_DIR, str(tmp_path / "shared"))
    with embedded_database() as outer, embedded_database() as inner:
        assert outer == inner
    assert not EmbeddedServer(tmp_path / "shared").is_running()


def test_the_url_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(embedded.ENV_URL, "postgresql://example/db")
    with embedded_database() as url:
        assert url == "postgresql://example/db"


@pytest.mark.skipif(shutil.which("pg_ctl") is None, reason="no pg_ctl on PATH")
def test_falls_back_to_pg_ctl_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    server = EmbeddedServer(tmp_path / "fallback")
    assert "pgserver" not in str(server._bin)
    url = server.start()
    try:
        with psycopg.connect(url) as conn:
            version = conn.execute("SHOW server_version").fetchone()
        assert version is not None
    finally:
        server.stop()


def test_a_start_during_a_shutdown_waits_for_it_and_starts_again(tmp_path: Path) -> None:
    """A process that starts using the server while the last one leaves (its stop still
    waiting for sessions or for the shutdown checkpoint) gets a server that takes
    connections, not one that answers "the database system is shutting down"."""
    server = EmbeddedServer(tmp_path / "pg")
    url = server.start()
    holder = psycopg.connect(url)  # a smart shutdown waits for this session
    server.stop("smart", wait=False)
    wait_until(server.is_stopping, what="the server to begin its shutdown")
    threading.Timer(1.0, holder.close).start()
    try:
        again = EmbeddedServer(tmp_path / "pg")
        assert again.start() == url
        assert again.started_here
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.stop()
