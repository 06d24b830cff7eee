"""Checks of arguments shared by the client and the worker, which cannot import each other."""

from __future__ import annotations

from cyclone_dsl.errors import InvalidArgument


def checked_flag(name: str, value: object) -> bool:
    """``value`` if it is a bool: a truthy string (``"no"``) must not pass for True."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be True or False, not {value!r}")
    return value
