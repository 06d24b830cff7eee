"""Workflows the CLI tests submit by module:name."""

from __future__ import annotations

import threading

from cyclone_dsl import Concurrency, child, for_each, step, wait_signal, workflow


@step(name="cli_add")
def add(x: int) -> int:
    return x + 1


@workflow(name="cli_flow")
def flow(x):  # type: ignore[no-untyped-def]
    return add(x)


@workflow(name="cli_waiting")
def waiting(x):  # type: ignore[no-untyped-def]
    return add(wait_signal("go"))


@step(name="cli_item")
def item(x: int) -> int:
    return x


@step(name="cli_list")
def make_list(n: int) -> list[int]:
    return list(range(n))


@workflow(name="cli_fan_out")
def fan_out(n):  # type: ignore[no-untyped-def]
    return for_each(item, over=make_list(n))


@workflow(name="cli_parent")
def parent(x):  # type: ignore[no-untyped-def]
    return child(waiting, x)


#: Set to let the keyed steps finish.
release = threading.Event()


@step(name="cli_keyed", concurrency=Concurrency(key="tenant", limit=1))
def keyed(job: dict[str, str]) -> str:
    release.wait(30)
    return job["tenant"]


@workflow(name="cli_chained")
def chained(x):  # type: ignore[no-untyped-def]
    return add(add(x))
