"""Wait nodes: ``wait_signal``, ``wait_n``, ``wait_any`` and ``wait_timer``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence, Set
from datetime import timedelta
from typing import Any

from cyclone_dsl.dsl.builder import NodeRef, Ref, require_builder
from cyclone_dsl.dsl.signatures import After, OnSkip
from cyclone_dsl.durations import as_timedelta
from cyclone_dsl.graph.conditions import Condition
from cyclone_dsl.graph.model import WaitSpec
from cyclone_dsl.graph.rows import KIND_SIGNAL, KIND_TIMER
from cyclone_dsl.graph.validate import MAX_NODE_ID_BYTES


def _timeout(value: timedelta | float | None) -> Any:
    return None if value is None else as_timedelta(value)


def _id_of(name: object) -> str:
    """A wait's default node id; a name that is not a string is reported by validation."""
    return name if isinstance(name, str) else "signal"


def _any_id(names: tuple[Any, ...]) -> str:
    """wait_any's default node id: ``any_`` and its names, or, past the node id limit (long
    names, each valid), ``any_`` and a digest of them."""
    joined = "_".join(_id_of(n) for n in names)
    text = "any_" + joined
    if len(text.encode("utf-8", "surrogatepass")) <= MAX_NODE_ID_BYTES:
        return text
    return "any_" + hashlib.sha256(joined.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def wait_signal(
    name: str,
    *,
    timeout: timedelta | float | None = None,
    after: After = None,
    when: Condition | None = None,
    otherwise: NodeRef[object] | None = None,
    on_skip: OnSkip | None = None,
) -> NodeRef[Any]:
    """Wait for one signal ``name``; the node's output is its payload.

    With ``timeout``, the wait fails (error kind ``signal_timeout``) when no
    signal arrives in time, and ``on_dep_failure`` of its dependents applies.
    """
    builder = require_builder("wait_signal")
    spec = WaitSpec(signal_name=name, duration=_timeout(timeout))
    return builder.add(
        _id_of(name),
        KIND_SIGNAL,
        (),
        after=after,
        wait=spec,
        when=when,
        otherwise=otherwise,
        on_skip=on_skip,
    )


def wait_n(
    name: str,
    n: int,
    *,
    timeout: timedelta | float | None = None,
    after: After = None,
    when: Condition | None = None,
    otherwise: NodeRef[object] | None = None,
    on_skip: OnSkip | None = None,
) -> NodeRef[list[Any]]:
    """Wait for ``n`` signals ``name``; the output is the list of payloads in arrival order."""
    builder = require_builder("wait_n")
    given: object = n  # untyped callers may pass None: it would be a wait_signal's shape
    if given is None:
        builder.problems.append(
            (None, f"wait_n({name!r}, n) needs a count n; wait_signal({name!r}) waits for one")
        )
    spec = WaitSpec(signal_name=name, count=n, duration=_timeout(timeout))
    return builder.add(
        _id_of(name),
        KIND_SIGNAL,
        (),
        after=after,
        wait=spec,
        when=when,
        otherwise=otherwise,
        on_skip=on_skip,
    )


def wait_any(
    names: Sequence[str],
    *,
    timeout: timedelta | float | None = None,
    after: After = None,
    when: Condition | None = None,
    otherwise: NodeRef[object] | None = None,
    on_skip: OnSkip | None = None,
) -> NodeRef[dict[str, Any]]:
    """Wait for the first of several signals; the output is ``{"name": ..., "payload": ...}``."""
    builder = require_builder("wait_any")
    if isinstance(names, str):  # iterable: it would wait for one signal per character
        builder.problems.append(
            (
                None,
                f"wait_any takes a list of signal names: wait_any([{names!r}]), or "
                f"wait_signal({names!r}) for one, not wait_any({names!r})",
            )
        )
    given: object = names  # untyped callers may pass anything
    if isinstance(given, Set | Mapping) or not isinstance(given, Iterable | Ref):
        # A set's order changes with the process's hash seed, and the node id and
        # def_version follow the order: two processes would disagree on the definition.
        builder.problems.append(
            (None, f"wait_any takes a list (or tuple) of signal names, not {names!r}")
        )
        given = ()
    listed: tuple[Any, ...] = (given,) if isinstance(given, Ref | str) else tuple(given)
    spec = WaitSpec(signal_names=listed, duration=_timeout(timeout))
    default_id = _any_id(listed)
    return builder.add(
        default_id,
        KIND_SIGNAL,
        (),
        after=after,
        wait=spec,
        when=when,
        otherwise=otherwise,
        on_skip=on_skip,
    )


def wait_timer(
    length: timedelta | float,
    *,
    after: After = None,
    when: Condition | None = None,
    otherwise: NodeRef[object] | None = None,
    on_skip: OnSkip | None = None,
) -> NodeRef[None]:
    """Wait ``length`` (from activation); completed by the timer scanner, not by a worker."""
    builder = require_builder("wait_timer")
    spec = WaitSpec(duration=as_timedelta(length), timer=True)  # type: ignore[arg-type]
    return builder.add(
        "timer",
        KIND_TIMER,
        (),
        after=after,
        wait=spec,
        when=when,
        otherwise=otherwise,
        on_skip=on_skip,
    )
