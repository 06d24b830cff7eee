"""The strict JSON codec: the one place Python values become jsonb parameters.

Postgres ``jsonb`` rejects ``\\u0000`` and Python's :mod:`json` writes ``NaN``
and ``Infinity`` by default; both would wedge a run if they reached a write.
:func:`encode` refuses them (and every non-JSON type, non-string key, lone
surrogate and over-deep nesting) with :class:`~cyclone_dsl.errors.InvalidPayload`
naming the JSON path, and refuses an encoding over the byte limit with
:class:`~cyclone_dsl.errors.PayloadTooLarge`.
"""

from __future__ import annotations

import json
import math
import re
from typing import TypeAlias, TypeGuard

from cyclone_dsl.errors import InvalidPayload, PayloadTooLarge

JSONValue: TypeAlias = "None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]"

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
"""Default byte limit of one encoded payload (input, output or signal)."""

MAX_DEPTH = 256
"""Deepest nesting of lists and objects accepted in a payload."""

_MAX_INT = 2**63


#: Where a value is in a payload, built only when an error names it: the root path, or
#: (the container's place, an index or key).
_Place: TypeAlias = "str | tuple[_Place, int | str]"

#: A key longer than this is cut in an error's JSON path.
_PATH_KEY_CHARS = 200


def check(value: object, *, path: str = "$", depth: int = 0) -> None:
    """Raise :class:`InvalidPayload` unless ``value`` is strict JSON."""
    # Iterative walk: a 100,000-deep list must not blow the Python stack. Only containers
    # are stacked, with their place; scalars are checked where they are met, and no path
    # is built unless an error names it: a flat list of a million numbers costs no memory.
    if _is_leaf(value, path, None):
        return
    stack: list[tuple[object, _Place, int]] = [(value, path, depth)]
    while stack:
        item, place, level = stack.pop()
        if level >= MAX_DEPTH:
            raise InvalidPayload(_path(place), f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, list | tuple):
            for i, v in enumerate(item):
                if not _is_leaf(v, place, i):
                    stack.append((v, (place, i), level + 1))
        elif isinstance(item, dict):
            for key, v in item.items():
                if not isinstance(key, str):
                    raise InvalidPayload(_path(place), f"object key {_shown(key)} is not a string")
                _check_text(key, place, key)
                if not _is_leaf(v, place, key):
                    stack.append((v, (place, key), level + 1))
        else:
            raise InvalidPayload(_path(place), f"a {type(item).__name__} is not JSON")


def _is_leaf(item: object, parent: _Place, token: int | str | None) -> bool:
    """Whether ``item`` (at ``token`` in ``parent``; the root when None) is a JSON scalar,
    raising if it is one JSON cannot hold; False for a container or any other type, which
    the walk looks at next."""
    if item is None or isinstance(item, bool):
        return True
    if isinstance(item, int):
        if not -_MAX_INT <= item < _MAX_INT:
            raise InvalidPayload(_path(parent, token), "integer out of the 64-bit range")
        return True
    if isinstance(item, float):
        if not math.isfinite(item):
            raise InvalidPayload(_path(parent, token), f"{item!r} is not valid JSON")
        return True
    if isinstance(item, str):
        _check_text(item, parent, token)
        return True
    return False


def _path(place: _Place, token: int | str | None = None) -> str:
    """The JSON path of a place (or of ``token`` in it): ``$.items[3].name``; a key that
    is not printable (a NUL, a lone surrogate, a new line) is written as a JSON string in
    brackets, so the path itself is printable text any log or column takes."""
    if token is not None:
        place = (place, token)
    parts: list[str] = []
    while not isinstance(place, str):
        place, token = place
        if isinstance(token, int):
            parts.append(f"[{token}]")
        else:
            key = token if len(token) <= _PATH_KEY_CHARS else token[:_PATH_KEY_CHARS] + "…"
            parts.append(f".{key}" if key.isprintable() else f"[{json.dumps(key)}]")
    parts.append(place)
    return "".join(reversed(parts))


def _shown(key: object) -> str:
    try:
        return repr(key)
    except Exception:  # noqa: BLE001 - a user type's broken __repr__ must not hide the error
        return f"of type {type(key).__name__}"


def _check_text(text: str, parent: _Place, token: int | str | None) -> None:
    if "\x00" in text:
        raise InvalidPayload(
            _path(parent, token), "contains a NUL character (\\u0000), which jsonb rejects"
        )
    if not text.isascii() and utf8_size(text) is None:
        raise InvalidPayload(_path(parent, token), "contains a lone surrogate")


def is_text(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a non-empty string a text column can store: without NUL (which
    PostgreSQL refuses) and with a UTF-8 form (a lone surrogate has none)."""
    return (
        isinstance(value, str)
        and value != ""
        and "\x00" not in value
        and utf8_size(value) is not None
    )


def utf8_size(text: str) -> int | None:
    """The bytes of ``text`` in UTF-8; None when it has none (a lone surrogate)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None


MAX_NAME_BYTES = 256
"""The longest name (bytes of UTF-8) of a step or action (its kind), a rate limit or a
worker. A btree entry holds at most 2,704 bytes, and names are indexed with keys of up to
256 bytes: a gated step's fair key joins its kind, its rate limit's name (by default the
kind again) and its workflow's name, each with a key; with the queue, about 2,100 bytes at
these limits."""

MAX_WORKFLOW_NAME_BYTES = 512
"""The longest name (bytes of UTF-8) of a workflow, and of a schedule id (by default its
target's name): a workflow's name is in a gated step's fair key once, a kind twice."""


def text_problem(what: str, value: object, max_bytes: int) -> str | None:
    """What is wrong with ``value`` as a name or key a text column stores and an index
    takes: a non-empty string (:func:`is_text`) of at most ``max_bytes`` bytes of UTF-8;
    None when nothing is."""
    if not isinstance(value, str) or not value:
        return f"{what} must be a non-empty string, not {value!r}"
    if "\x00" in value:
        return f"{what} must not contain NUL characters"
    size = utf8_size(value)
    if size is None:
        return f"{what} is not valid UTF-8 (it contains a lone surrogate): {value!r}"
    if size > max_bytes:
        return f"{what} is {size} bytes of UTF-8; the limit is {max_bytes}"
    return None


def encode(
    value: object, *, what: str = "payload", max_bytes: int | None = None, path: str = "$"
) -> str:
    """Check ``value`` and return its compact JSON text (``path``: where ``value`` is, for
    the error's JSON path: ``$[3]`` for the fourth input of a bulk call)."""
    check(value, path=path)
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    limit = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if limit and len(text) > limit // 4:  # cheap pre-check before counting UTF-8 bytes
        size = len(text.encode("utf-8"))
        if size > limit:
            raise PayloadTooLarge(what, size, limit)
    return text


def encoded_size(value: object) -> int:
    """The size in bytes of ``value`` as :func:`encode` writes it (compact UTF-8 JSON): the
    size every payload limit counts."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return len(text.encode("utf-8"))


#: Nineteen digits in a row: the shortest integer literal that may be beyond 64 bits.
_LONG_DIGITS = re.compile(r"\d{19}")
_LONG_DIGITS_BYTES = re.compile(rb"\d{19}")


def _int_within_64_bits(literal: str) -> int | float:
    value = int(literal)
    return value if -_MAX_INT <= value < _MAX_INT else float(literal)


def decode(text: str | bytes | None) -> JSONValue:
    """Decode JSON text read back from the database.

    ``jsonb`` keeps numbers as ``numeric`` and writes ``1e+20`` back as
    ``100000000000000000000``: an integer literal beyond the 64-bit range is read as
    the float it was written as (:func:`check` refuses such an integer, so no payload
    held one), else the next step would get an input it cannot pass on.
    """
    if text is None:
        return None
    if isinstance(text, bytes):
        plain = _LONG_DIGITS_BYTES.search(text) is None
    else:
        plain = _LONG_DIGITS.search(text) is None
    result: JSONValue = (
        json.loads(text) if plain else json.loads(text, parse_int=_int_within_64_bits)
    )
    return result


def sanitize_text(text: str, *, limit: int = 4000) -> str:
    """Make free text (an error message) safe for a ``text`` column and bounded."""
    cleaned = text.replace("\x00", "\\0").encode("utf-8", "replace").decode("utf-8")
    if len(cleaned) > limit:
        cleaned = cleaned[: limit - 15] + "… [truncated]"
    return cleaned
