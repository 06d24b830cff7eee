"""Numbers through jsonb: a float written as jsonb comes back as a value the next step can
pass on, on every connection the engine reads with, and the user's own reads keep
psycopg's loaders.

``jsonb`` keeps numbers as ``numeric``: ``1e+20`` comes back as the literal
``100000000000000000000``, which Python's :mod:`json` reads as an int beyond 64 bits, an
int the strict codec refuses as a step's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cyclone_dsl import Client, StepContext, Worker, step, wait_signal, workflow
from cyclone_dsl.db.connect import make_pool
from cyclone_dsl.payload import JSONValue, encode

StartWorker = Callable[..., Worker]

finite_floats = st.floats(allow_nan=False, allow_infinity=False)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | int64
    | finite_floats
    | st.text(max_size=5).filter(lambda s: "\x00" not in s),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=5).filter(lambda s: "\x00" not in s), inner, max_size=4)
    ),
    max_leaves=12,
)


def _same(a: object, b: object) -> bool:
    """Equal as JSON numbers are: ``1e18 == 10**18``, but a float never comes back beyond
    the 64-bit range as an int."""
    if isinstance(a, float) and isinstance(b, int) and not isinstance(b, bool):
        return -(2**63) <= b < 2**63 and float(b) == a
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@pytest.fixture(scope="module")
def engine_connection(cyclone_admin_dsn: str) -> Any:
    pool = make_pool(cyclone_admin_dsn, name="json-numbers", max_size=1)
    with pool.connection() as conn:
        yield conn
    pool.close()


@given(value=json_values)
def test_every_json_value_reads_back_from_jsonb_as_written(
    engine_connection: psycopg.Connection[Any], value: JSONValue
) -> None:
    (back,) = engine_connection.execute("SELECT %s::jsonb", (encode(value),)).fetchone()
    assert _same(value, back), (value, back)
    encode(back)  # and the engine would accept it as a step's output


@pytest.mark.parametrize("literal", ["1e19", "-1e19", "9.3e18", "1.5e300", "-2.5e25"])
def test_a_big_float_reads_back_as_a_float(
    engine_connection: psycopg.Connection[Any], literal: str
) -> None:
    for cast in ("jsonb", "json"):
        (back,) = engine_connection.execute(
            f"SELECT %s::{cast}", (encode([float(literal)]),)
        ).fetchone()
        assert back == [float(literal)]
        assert isinstance(back[0], float)


@step(name="jn_scale")
def scale(x: float) -> dict[str, Any]:
    return {"values": [x * 1e10, -x * 1e12, 7], "nested": {"big": x * 1e290}}


@step(name="jn_pass_on")
def pass_on(value: object) -> object:
    return value


@workflow(name="jn_scale_then_pass_on")
def scale_then_pass_on(x):  # type: ignore[no-untyped-def]
    return pass_on(scale(x))


def test_big_float_outputs_pass_through_a_chain(client: Client, start_worker: StartWorker) -> None:
    start_worker(scale_then_pass_on)
    result = client.submit(scale_then_pass_on, 1e10).result(timeout=10)
    assert result == {"values": [1e20, -1e22, 7], "nested": {"big": 1e10 * 1e290}}
    assert isinstance(result["values"][0], float)  # type: ignore[index]


@workflow(name="jn_signal_then_pass_on")
def signal_then_pass_on(_: None):  # type: ignore[no-untyped-def]
    return pass_on(wait_signal("amount"))


def test_a_big_float_in_a_signal_reaches_the_next_step(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(signal_then_pass_on)
    handle = client.submit(signal_then_pass_on, None)
    client.signal(handle.id, "amount", {"amount": 2.5e25})
    assert handle.result(timeout=10) == {"amount": 2.5e25}


@step(name="jn_reads_own_jsonb", transactional=True)
def reads_own_jsonb(x: float, *, ctx: StepContext) -> list[Any]:
    (own,) = ctx.connection.execute("SELECT '100000000000000000000'::jsonb").fetchone()
    return [type(own).__name__, own == 10**20, x]


@workflow(name="jn_reads_own_jsonb_flow")
def reads_own_jsonb_flow(x):  # type: ignore[no-untyped-def]
    return reads_own_jsonb(x)


def test_a_transactional_handlers_own_reads_keep_psycopgs_loaders(
    client: Client, start_worker: StartWorker
) -> None:
    """The engine reads its rows with its loader on that connection; the user's reads are
    psycopg's, an int beyond 64 bits included."""
    start_worker(reads_own_jsonb_flow)
    result = client.submit(reads_own_jsonb_flow, 1e20).result(timeout=10)
    assert result == ["int", True, 1e20]


def test_submit_tx_on_the_applications_connection_reads_big_floats(
    client: Client, start_worker: StartWorker, cyclone_dsn: str
) -> None:
    start_worker(scale_then_pass_on)
    with psycopg.connect(cyclone_dsn) as conn:
        handle = client.submit_tx(conn, scale_then_pass_on, 1e15)
    assert handle.result(timeout=10)["values"][0] == 1e25  # type: ignore[index]
