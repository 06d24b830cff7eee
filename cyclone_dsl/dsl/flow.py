"""Flow control declared on handlers and workflows: concurrency keys, rate limits, debounce.

A *key* says which runs share a limit. It is evaluated at submit, on the run
input, and is one of:

* ``None``: one key for everything the limit is declared on;
* a string: the name of a field of the run input (a JSON object), whose value
  (a string or an integer) is the key;
* a callable: called with the run input, returns the key (a string).

The limits are counted on the database (see :mod:`cyclone_dsl.engine.gates`), by
every worker of every deploy together.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs

from cyclone_dsl.durations import is_duration, refusal
from cyclone_dsl.errors import InvalidArgument
from cyclone_dsl.payload import MAX_NAME_BYTES, text_problem, utf8_size

#: How a limit's key is given: the whole scope (None), a field of the run input, or a callable.
KeySpec = str | Callable[[Any], object] | None

#: The longest key (bytes of UTF-8) a limit takes.
MAX_KEY_BYTES = 256

#: The largest limit: a limit is a slot row per unit per key, all made on the key's first use.
MAX_LIMIT = 100_000


def _check_key_spec(owner: str, key: object) -> None:
    if key is None or callable(key):
        return
    if not isinstance(key, str) or not key:
        raise InvalidArgument(
            f"{owner}: key must be None, a field name of the run input or a callable, not {key!r}"
        )


def _check_count(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LIMIT:
        raise InvalidArgument(
            f"{owner}: {name} must be an integer from 1 to {MAX_LIMIT}, not {value!r}"
        )


@attrs.frozen
class Concurrency:
    """At most ``limit`` at once per key.

    On a ``@step`` or ``@action``: steps of that kind and key running at once.
    On a ``@workflow``: runs of that workflow and key that have started and not
    ended; a run beyond the limit waits (its steps are not claimed) until a run
    of its key ends, in submit order. ``limit=None`` caps nothing and only
    makes claims take the keys' work in turn (a fair queue).
    """

    key: KeySpec = None
    limit: int | None = 1

    def __attrs_post_init__(self) -> None:
        _check_key_spec("Concurrency", self.key)
        _check_count("Concurrency", "limit", self.limit, optional=True)


@attrs.frozen
class RateLimit:
    """At most ``limit`` units started per ``per`` (a sliding window), per key.

    ``name`` names the budget (by default the kind of the step it is declared
    on): steps of several kinds that call one API share a budget by sharing a
    name. A step takes ``units`` units when it is claimed; a handler that
    learns its real cost while it runs (tokens) adds the rest with
    ``ctx.rate_limit_units``. A step over the limit is not failed and spends no
    attempt: it waits until the window has room.
    """

    limit: int
    per: timedelta
    key: KeySpec = None
    name: str | None = None
    units: int = 1

    def __attrs_post_init__(self) -> None:
        _check_key_spec("RateLimit", self.key)
        _check_count("RateLimit", "limit", self.limit)
        _check_count("RateLimit", "units", self.units)
        if not is_duration(self.per):
            raise InvalidArgument(refusal("RateLimit: per", self.per))
        if self.units > self.limit:
            raise InvalidArgument(
                f"RateLimit: units ({self.units}) over the limit ({self.limit}) could never start"
            )
        if self.name is not None and (
            wrong := text_problem("RateLimit: name", self.name, MAX_NAME_BYTES)
        ):
            raise InvalidArgument(wrong)


@attrs.frozen
class Debounce:
    """Collapse submits with the same key into one run.

    The first submit of a key creates the run, whose first steps wait
    ``delay``; each later submit of that key before they start moves the start
    to ``delay`` after itself and replaces the run's input with its own. The
    key is evaluated on the run input like a limit's (``None``: every submit of
    the workflow is one window).
    """

    delay: timedelta
    key: KeySpec = None

    def __attrs_post_init__(self) -> None:
        _check_key_spec("Debounce", self.key)
        if not is_duration(self.delay):
            raise InvalidArgument(refusal("Debounce: delay", self.delay))


def key_of(owner: str, key: KeySpec, run_input: object) -> str:
    """Evaluate a key on the run input; :class:`InvalidArgument` if it does not give one."""
    if key is None:
        return ""
    if callable(key):
        try:
            value = key(run_input)
        except Exception as exc:
            raise InvalidArgument(f"{owner}: the key function raised {exc!r}") from exc
        what = "the key function returned"
    else:
        if not isinstance(run_input, dict):
            raise InvalidArgument(
                f"{owner}: the key is the run input's field {key!r}, but the input is not "
                f"a JSON object: {type(run_input).__name__}"
            )
        if key not in run_input:
            raise InvalidArgument(f"{owner}: the run input has no field {key!r} (the key)")
        value = run_input[key]
        what = f"the run input's field {key!r} is"
    return checked_key(owner, value, what)


def checked_key(owner: str, value: object, what: str) -> str:
    """A limit's key as stored: a string (an int is taken as its digits) of 1 to
    ``MAX_KEY_BYTES`` bytes of UTF-8, without NUL; else :class:`InvalidArgument`."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InvalidArgument(f"{owner}: a key must be a string; {what} {value!r}")
    if isinstance(value, int) and value.bit_length() > MAX_KEY_BYTES * 4:
        # Past MAX_KEY_BYTES digits, and str() refuses ints past 4,300 of them.
        shown = f"an integer of {value.bit_length()} bits"
        text = ""
    else:
        text = str(value)
        shown = repr(value)
    size = utf8_size(text)
    if not text or "\x00" in text or size is None or size > MAX_KEY_BYTES:
        raise InvalidArgument(
            f"{owner}: a key must be a non-empty string of at most {MAX_KEY_BYTES} bytes "
            f"of UTF-8 without NUL; {what} {shown}"
        )
    return text
