"""A first workflow: two steps in parallel, joined by a third."""

from __future__ import annotations

from cyclone_dsl import Client, NodeRef, Ref, Worker, embedded_database, migrate, step, workflow


@step
def greet(name: str) -> str:
    return f"Hello, {name}"


@step
def shout(name: str) -> str:
    return name.upper() + "!"


@step
def combine(greeting: str, shouted: str) -> str:
    return f"{greeting} ({shouted})"


@workflow
def hello(name: Ref[str]) -> NodeRef[str]:
    return combine(greet(name), shout(name))


def main() -> None:
    with embedded_database() as dsn:
        migrate(dsn)
        with Worker(dsn, [greet, shout, combine]), Client(dsn) as client:
            handle = client.submit(hello, "Ada")
            print(handle.result(timeout=30))


if __name__ == "__main__":
    main()
