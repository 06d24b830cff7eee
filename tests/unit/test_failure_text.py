"""The text of a handler's failure is built without raising, whatever the exception."""

from __future__ import annotations

import traceback

import pytest

from cyclone_dsl.worker import execute


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_an_exception_whose_str_raises_is_named_with_what_str_raised() -> None:
    assert execute.one_line(Unprintable()) == "Unprintable: <str() raised RuntimeError>"
    assert "Unprintable" in execute.stack_text(raised(Unprintable()))


def test_the_first_line_of_the_message_follows_the_type() -> None:
    assert execute.one_line(ValueError("  bad\nmore  ")) == "ValueError: bad"
    assert execute.one_line(ValueError()) == "ValueError"


def test_a_formatter_that_fails_gives_a_plain_frame_list(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(exc: BaseException) -> list[str]:
        # what CPython 3.11.0-3.11.7 raises when two threads parse code at once
        raise SystemError("AST constructor recursion depth mismatch (before=171, after=190)")

    monkeypatch.setattr(traceback, "format_exception", failing)
    text = execute.stack_text(raised(ValueError("boom")))
    assert text.startswith("Traceback (most recent call last):\n")
    assert "in raised\n" in text
    assert text.endswith("ValueError: boom\n")
