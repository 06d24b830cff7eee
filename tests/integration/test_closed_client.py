"""A closed client refuses every call with ClientClosed, saying so (not a lost connection)."""

from __future__ import annotations

import asyncio

import pytest

from cyclone_dsl import AsyncClient, Client, ClientClosed, step


@step(name="closed_work")
def work(x: object) -> object:
    return x


def test_a_closed_client_says_it_is_closed(cyclone_dsn: str) -> None:
    client = Client(cyclone_dsn)
    handle = client.enqueue(work, 1)
    client.close()
    with pytest.raises(ClientClosed, match="closed"):
        client.get_run(handle.id)
    with pytest.raises(ClientClosed):
        client.enqueue(work, 2)
    with pytest.raises(ClientClosed):
        client.cancel(handle.id)
    with pytest.raises(ClientClosed):
        handle.result(timeout=1)
    client.close()  # closing twice is fine


def test_an_async_client_used_after_its_block_says_it_is_closed(cyclone_dsn: str) -> None:
    async def check() -> None:
        async with AsyncClient(cyclone_dsn) as client:
            handle = await client.enqueue(work, 1)
        with pytest.raises(ClientClosed):
            await client.get_run(handle.id)
        with pytest.raises(ClientClosed):
            await client.enqueue(work, 2)
        with pytest.raises(ClientClosed):
            await handle.result(timeout=1)

    asyncio.run(check())
