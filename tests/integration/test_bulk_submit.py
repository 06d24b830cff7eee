"""submit_many and enqueue_many insert exactly the rows that one submit per input would."""

from __future__ import annotations

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cyclone_dsl import Client, step, wait_signal, workflow

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.text(max_size=8).filter(
        lambda s: "\x00" not in s and not any(0xD800 <= ord(c) <= 0xDFFF for c in s)
    ),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=4).filter(lambda s: "\x00" not in s), inner, max_size=3)
    ),
    max_leaves=6,
)


@step(name="bulk_one")
def one(x: object) -> object:
    return x


@step(name="bulk_pair")
def pair(a: object, b: object, c: object) -> object:
    return [a, b, c]


@workflow(name="bulk_flow")
def flow(x):  # type: ignore[no-untyped-def]
    first = one(x)  # the run input as the whole static input
    mixed = pair(first, x, "literal")  # the run input as one tuple slot, beside a literal
    gate = wait_signal("go")  # a root wait: activated in the submit transaction
    return one.named("last")([first, mixed], after=[gate])


#: Inputs as text, so that a JSON null and an SQL NULL differ (psycopg reads both as None).
ROWS = """
SELECT s.node, s.kind, s.state, s.input::text, s.input_from, s.queue, s.priority, s.max_attempts,
       s.signal_name, r.input::text AS run_input, r.workflow, r.def_version, r.result_node,
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
@given(inputs=st.lists(json_values, min_size=1, max_size=4))
def test_submit_many_matches_one_submit_per_input(
    client: Client, cyclone_dsn: str, inputs: list[object]
) -> None:
    bulk = client.submit_many(flow, inputs)  # type: ignore[arg-type]
    for value, handle in zip(inputs, bulk, strict=True):
        alone = client.submit(flow, value)  # type: ignore[arg-type]
        assert rows_of(cyclone_dsn, handle.id) == rows_of(cyclone_dsn, alone.id)
        assert client.get_run(handle.id).step("go").state == "waiting_signal"  # roots activated


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(inputs=st.lists(json_values, min_size=1, max_size=4))
def test_enqueue_many_matches_one_enqueue_per_input(
    client: Client, cyclone_dsn: str, inputs: list[object]
) -> None:
    bulk = client.enqueue_many(one, inputs, queue="bulk", priority=3)
    for value, handle in zip(inputs, bulk, strict=True):
        alone = client.enqueue(one, value, queue="bulk", priority=3)
        assert rows_of(cyclone_dsn, handle.id) == rows_of(cyclone_dsn, alone.id)
