"""cyclone_dsl.contrib.django: runs submitted in ``transaction.atomic()``, settings, commands.

Django's settings are process-wide: this module configures them once (module fixture)
and puts them back unconfigured at the end; each test points Django's connection at its
own schema. The management commands run in subprocesses with
``tests.contrib.django_settings``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from cyclone_dsl import (
    LATEST_EXTENSION_VERSION,
    LATEST_SCHEMA_VERSION,
    Client,
    InvalidArgument,
    Worker,
)
from cyclone_dsl.contrib.django import (
    close_client,
    dsn,
    enqueue_tx,
    get_client,
    submit_once_tx,
    submit_tx,
)
from cyclone_dsl.migrate import versions
from cyclone_dsl.testing.failpoints import arm, disarm
from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path
from tests.contrib.shapes import SHAPES, WORKFLOWS, check_activated, counts, work

ROOT = Path(__file__).resolve().parents[2]


class Refused(Exception):
    pass


@pytest.fixture(scope="module")
def django_settings(cyclone_admin_dsn: str) -> Iterator[None]:
    import django
    from django.conf import settings
    from django.db import connections
    from django.utils.functional import empty

    from cyclone_dsl.contrib.django import database_settings

    assert not settings.configured, "another test configured Django in this process"
    settings.configure(
        INSTALLED_APPS=["cyclone_dsl.contrib.django"],
        DATABASES={"default": database_settings(cyclone_admin_dsn)},
        USE_TZ=True,
    )
    django.setup()
    yield
    connections.close_all()
    close_client()
    settings._wrapped = empty  # unconfigured again, as before this module


@pytest.fixture
def db(django_settings: None, app_dsn: str) -> Iterator[None]:
    """Django's ``default`` connection on this test's schemas (Cyclone's and the app's)."""
    from django.db import connections

    wrapper = connections["default"]
    wrapper.close()
    saved = dict(wrapper.settings_dict["OPTIONS"])
    wrapper.settings_dict["OPTIONS"] = {**saved, "options": conninfo_to_dict(app_dsn)["options"]}
    close_client()
    yield
    wrapper.close()
    wrapper.settings_dict["OPTIONS"] = saved
    close_client()


def insert_order(sku: str) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO orders (sku, qty) VALUES (%s, 1)", [sku])


Submit = Callable[[Any, Any], int]

METHODS: dict[str, Submit] = {
    "submit_tx": lambda wf, value: submit_tx(wf, value).id,
    "submit_once_tx": lambda wf, value: submit_once_tx(wf, value, key=f"order-{wf.name}").id,
}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_run_exists_iff_the_atomic_block_commits(
    db: None, app_dsn: str, client: Client, shape: str, method: str
) -> None:
    from django.db import transaction

    wf, value = SHAPES[shape].workflow, SHAPES[shape].input
    submit = METHODS[method]

    def refuse() -> None:
        with transaction.atomic():
            insert_order("refused")
            submit(wf, value)
            raise Refused

    with pytest.raises(Refused):
        refuse()
    assert counts(app_dsn) == (0, 0), "a rolled-back block left its order or its run"

    with transaction.atomic():
        insert_order("placed")
        run_id = submit(wf, value)
        assert counts(app_dsn) == (0, 0), "visible before the block commits"
    assert counts(app_dsn) == (1, SHAPES[shape].runs)
    check_activated(client, run_id, shape)


def test_an_inner_block_that_rolls_back_takes_its_run_with_it(
    db: None, app_dsn: str, client: Client
) -> None:
    from django.db import transaction

    def refuse_inside() -> None:
        with transaction.atomic():  # a savepoint
            insert_order("dropped")
            submit_tx(SHAPES["wait"].workflow, SHAPES["wait"].input)
            raise Refused

    with transaction.atomic():
        insert_order("kept")
        kept = submit_tx(SHAPES["step"].workflow, SHAPES["step"].input)
        with pytest.raises(Refused):
            refuse_inside()
    assert counts(app_dsn) == (1, 1)
    check_activated(client, kept.id, "step")


def test_outside_an_atomic_block_the_submit_commits_on_its_own(
    db: None, app_dsn: str, client: Client
) -> None:
    handle = submit_tx(SHAPES["step"].workflow, SHAPES["step"].input)
    assert counts(app_dsn) == (0, 1)
    check_activated(client, handle.id, "step")


def test_a_worker_completes_a_committed_run(db: None, start_worker: Callable[..., Worker]) -> None:
    from django.db import transaction

    start_worker(*WORKFLOWS)
    with transaction.atomic():
        insert_order("sku-1")
        handle = submit_tx(SHAPES["step"].workflow, SHAPES["step"].input)
    assert handle.result(timeout=20) == "order 1 done"


def test_enqueue_tx(db: None, app_dsn: str, client: Client) -> None:
    from django.db import transaction

    def refuse() -> None:
        with transaction.atomic():
            insert_order("refused")
            enqueue_tx(work, {"order_id": 1}, unique_key="o-1")
            raise Refused

    with pytest.raises(Refused):
        refuse()
    assert counts(app_dsn) == (0, 0)
    with transaction.atomic():
        insert_order("placed")
        first = enqueue_tx(work, {"order_id": 1}, unique_key="o-1", queue="orders")
        again = enqueue_tx(work, {"order_id": 1}, unique_key="o-1")
    assert first.created and not again.created and again.id == first.id
    assert counts(app_dsn) == (1, 1)
    assert client.get_run(first.id).step("fw_work").queue == "orders"


def test_djangos_connection_is_left_as_django_configured_it(db: None, app_dsn: str) -> None:
    """Django reads jsonb as text and timestamptz in its zone; while the engine runs, its
    loaders are psycopg's, and Django's are back afterwards, also when the submit fails
    half-way (its savepoint rolls back; the block goes on and commits)."""
    from django.db import connection, transaction

    def djangos_view() -> tuple[object, object]:
        with connection.cursor() as cursor:
            cursor.execute("""SELECT '{"a": 1}'::jsonb, '2030-01-02 03:04:05+00'::timestamptz""")
            row = cursor.fetchone()
        return row[0], row[1].tzinfo

    before = djangos_view()
    assert before[0] == '{"a": 1}'
    with transaction.atomic():
        submit_tx(SHAPES["child"].workflow, SHAPES["child"].input)
        assert djangos_view() == before
        arm("child.after_insert", "raise")
        try:
            with pytest.raises(RuntimeError):
                submit_tx(SHAPES["child"].workflow, SHAPES["child"].input)
        finally:
            disarm()
        assert djangos_view() == before
        insert_order("placed")
    assert counts(app_dsn) == (1, 2)


def test_settings(db: None, cyclone_dsn: str, app_dsn: str) -> None:
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings
    from django.utils.connection import ConnectionDoesNotExist

    assert conninfo_to_dict(dsn())["options"] == conninfo_to_dict(app_dsn)["options"]
    from_databases = get_client()
    assert get_client() is from_databases
    assert from_databases.dsn == dsn()
    with override_settings(CYCLONE={"DSN": cyclone_dsn, "POOL_SIZE": 2}):
        assert dsn() == cyclone_dsn
        assert get_client().dsn == cyclone_dsn
    assert get_client() is not from_databases
    assert get_client().dsn == dsn()
    with (
        override_settings(CYCLONE={"QUEUE": ["a"]}),
        pytest.raises(ImproperlyConfigured, match="QUEUE"),
    ):
        dsn()
    with override_settings(CYCLONE={"DATABASE": "other"}), pytest.raises(ConnectionDoesNotExist):
        submit_tx(SHAPES["step"].workflow, SHAPES["step"].input)


def test_a_bad_input_raises_before_anything_is_written(db: None, app_dsn: str) -> None:
    from django.db import transaction

    with transaction.atomic():
        insert_order("placed")
        with pytest.raises(InvalidArgument):
            submit_once_tx(SHAPES["step"].workflow, SHAPES["step"].input, key="")
    assert counts(app_dsn) == (1, 0)


# -- the management commands, in subprocesses ----------------------------------------------


def manage(*args: str, dsn: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "django", *args, "--settings", "tests.contrib.django_settings"],
        cwd=ROOT,
        env={**os.environ, "CYCLONE_TEST_DSN": dsn, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_worker_command_runs_submitted_runs_and_stops_on_sigterm(
    app_dsn: str, client: Client
) -> None:
    worker = manage("cyclone_worker", dsn=app_dsn)
    try:
        handle = client.submit(SHAPES["step"].workflow, SHAPES["step"].input)
        try:
            result = handle.result(timeout=30)
        except TimeoutError:
            worker.kill()
            out, err = worker.communicate()
            pytest.fail(f"the worker did not run the step: {out}{err}")
        assert result == "order 1 done"
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 0, out + err
    assert "stopped" in out, out + err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tests.contrib.no_such_module"], "cannot import 'tests.contrib.no_such_module'"),
        (
            ["--concurrency", "0"],
            "CommandError: concurrency must be an integer from 1 to 2147483647, not 0",
        ),
    ],
)
def test_the_worker_command_says_what_is_wrong(app_dsn: str, args: list[str], message: str) -> None:
    command = manage("cyclone_worker", *args, dsn=app_dsn)
    _, err = command.communicate(timeout=60)
    assert command.returncode == 1
    assert message in err
    assert "Traceback" not in err


def test_the_migrate_command_creates_cyclones_tables(cyclone_admin_dsn: str) -> None:
    schema = create_schema(cyclone_admin_dsn, migrated=False)
    try:
        target = with_search_path(cyclone_admin_dsn, schema)
        command = manage("cyclone_migrate", dsn=target)
        out, err = command.communicate(timeout=60)
        assert command.returncode == 0, out + err
        assert versions(target) == (LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION)
        with psycopg.connect(target) as conn:
            assert conn.execute("SELECT count(*) FROM cyclone_runs").fetchone() == (0,)
    finally:
        drop_schema(cyclone_admin_dsn, schema)
