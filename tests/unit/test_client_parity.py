"""AsyncClient has every public method of Client, with the same signature, as a coroutine
(or, for a method that yields a stream, returning an async iterator)."""

from __future__ import annotations

import inspect

import pytest

from cyclone_dsl import AsyncClient, AsyncRunHandle, Client, RunHandle

#: How an async annotation is spelled where the sync one names a sync type.
ASYNC_SPELLING = {"Connection": "AsyncConnection", "RunHandle": "AsyncRunHandle"}
#: Methods that do no I/O, so they stay plain functions on the async client.
NOT_COROUTINES = {"handle"}
#: Methods that return a stream: ``Iterator[X]`` on the sync client, a plain function
#: returning ``AsyncIterator[X]`` on the async one (``async for``), which checks its
#: arguments when called.
STREAMS = {"events"}


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    }


def asyncified(annotation: object) -> object:
    if not isinstance(annotation, str):
        return annotation
    if annotation.startswith("Iterator["):
        annotation = f"Async{annotation}"
    for sync, spelled in ASYNC_SPELLING.items():
        annotation = annotation.replace(f"{sync}]", f"{spelled}]")
        if annotation == sync:
            annotation = spelled
    return annotation


SYNC = public_methods(Client)
ASYNC = public_methods(AsyncClient)


def test_the_async_client_has_every_method_and_no_other() -> None:
    assert sorted(ASYNC) == sorted(SYNC)


@pytest.mark.parametrize("name", sorted(SYNC))
def test_same_parameters_defaults_and_annotations(name: str) -> None:
    sync, other = SYNC[name], ASYNC[name]
    expected = [
        (p.name, p.kind, p.default, asyncified(p.annotation)) for p in sync.parameters.values()
    ]
    got = [(p.name, p.kind, p.default, p.annotation) for p in other.parameters.values()]
    assert got == expected
    assert other.return_annotation == asyncified(sync.return_annotation)


@pytest.mark.parametrize("name", sorted(SYNC))
def test_every_method_that_does_io_is_a_coroutine(name: str) -> None:
    method = getattr(AsyncClient, name)
    if name in STREAMS:
        assert not inspect.iscoroutinefunction(method)
        assert str(ASYNC[name].return_annotation).startswith("AsyncIterator[")
        return
    assert inspect.iscoroutinefunction(method) == (name not in NOT_COROUTINES)


def test_the_handles_match() -> None:
    sync_handle = public_methods(RunHandle)
    async_handle = public_methods(AsyncRunHandle)
    assert sorted(async_handle) == sorted(sync_handle)
    for name, signature in sync_handle.items():
        assert async_handle[name].parameters.keys() == signature.parameters.keys()
        if name in STREAMS:
            assert str(async_handle[name].return_annotation).startswith("AsyncIterator[")
            continue
        assert inspect.iscoroutinefunction(getattr(AsyncRunHandle, name))
