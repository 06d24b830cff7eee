"""submit() sends its definition's template and the run input, and the insert puts the
input where the graph uses it: the rows are exactly those of the run compiled in Python
(what submit_tx, children and schedules insert), JSON null and SQL NULL alike."""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings

from cyclone_dsl import Client, PayloadTooLarge, step, workflow
from cyclone_dsl.payload import DEFAULT_MAX_BYTES
from tests.integration.test_bulk_submit import json_values


@step(name="tpl_one")
def one(x: object) -> object:
    return x


@step(name="tpl_pair")
def pair(a: object, b: object, c: object) -> object:
    return [a, b, c]


@workflow(name="tpl_flow")
def flow(x):  # type: ignore[no-untyped-def]
    first = one(x)  # the run input as the whole static input
    mixed = pair(first, x, "literal")  # the run input as one tuple slot, beside a literal
    twice = pair.named("twice")(x, x, None)  # the run input in two slots of one input
    return one.named("last")([first, mixed, twice])


#: Every column a submit writes, as text (``null`` and SQL NULL differ here).
ROWS = """
SELECT s.node, s.kind, s.state, s.input::text, s.input IS NULL, s.input_from, s.queue,
       s.priority, s.max_attempts, s.timeout, s.retention, s.unique_key, s.sequence_key,
       r.input::text AS run_input, r.input IS NULL, r.workflow, r.def_version, r.result_node,
       r.has_fan_out, r.submit_key,
       (SELECT array_agg(d.dep_node || ':' || d.dep_type ORDER BY d.dep_node)
        FROM cyclone_deps AS d WHERE d.run_id = s.run_id AND d.node = s.node) AS deps,
       (SELECT array_agg(i.slot || ':' || i.dep_node || ':' || i.assembly_mode ORDER BY i.slot)
        FROM cyclone_step_inputs AS i WHERE i.run_id = s.run_id AND i.node = s.node) AS slots
FROM cyclone_steps AS s JOIN cyclone_runs AS r ON r.id = s.run_id
WHERE s.run_id = %s
ORDER BY s.node
"""


def rows_of(dsn: str, run_id: int) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(ROWS, (run_id,)).fetchall()


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=json_values)
def test_submit_writes_the_rows_of_the_compiled_run(
    client: Client, cyclone_dsn: str, value: object
) -> None:
    sent = client.submit(flow, value)  # type: ignore[arg-type]
    with psycopg.connect(cyclone_dsn) as conn:
        compiled = client.submit_tx(conn, flow, value)  # type: ignore[arg-type]
    rows = rows_of(cyclone_dsn, sent.id)
    assert rows == rows_of(cyclone_dsn, compiled.id)
    assert len(rows) == 4


def test_a_step_input_over_the_limit_is_refused_naming_the_step(
    client: Client, cyclone_dsn: str
) -> None:
    """The run input fits, but a step holding it twice would not: refused before any write,
    as when the run is compiled in Python."""
    value = "x" * (DEFAULT_MAX_BYTES // 2 + 1024)
    with pytest.raises(PayloadTooLarge) as caught:
        client.submit(flow, value)  # type: ignore[arg-type]
    assert "twice" in str(caught.value)
    with psycopg.connect(cyclone_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM cyclone_runs").fetchone() == (0,)
