"""Named test hooks at the engine's commit points; inert unless armed.

A fault test arms a point to make a process die (``exit``, like a SIGKILL in
the middle of a transaction), freeze (``stop``: a SIGSTOP to itself, like a paused
VM, with its transaction left open) or raise (``raise``) exactly there, then
checks from the database that nothing was half written. Points are armed in
process with :func:`arm`, or for a subprocess with the environment variable
``CYCLONE_FAILPOINTS="child.after_insert=exit,fanout.after_expand=raise"``.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

POINTS = frozenset(
    {
        "claim.after_gate_look",
        "claim.between_queues",
        "complete.before_commit",
        "fail.before_commit",
        "child.after_insert",
        "fanout.after_expand",
        "schedule.after_fire_record",
        "scan.leader",
        "worker.before_start",
    }
)


class FailpointError(RuntimeError):
    """Raised by a failpoint armed with ``raise``."""


def _exit() -> None:
    os._exit(137)


def _stop() -> None:
    # To this thread (a kill() of the process lets it run on until another thread takes
    # the stop, and commit): a stop signal stops every thread of the process.
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _raise(name: str) -> Callable[[], None]:
    def action() -> None:
        raise FailpointError(f"failpoint {name} fired")

    return action


_armed: dict[str, Callable[[], None]] = {}


def arm(name: str, action: str | Callable[[], None]) -> None:
    if name not in POINTS:
        raise ValueError(f"unknown failpoint {name!r}; known: {sorted(POINTS)}")
    if callable(action):
        _armed[name] = action
    elif action == "exit":
        _armed[name] = _exit
    elif action == "stop":
        _armed[name] = _stop
    elif action == "raise":
        _armed[name] = _raise(name)
    else:
        raise ValueError(
            f"a failpoint action is 'exit', 'stop', 'raise' or a callable, not {action!r}"
        )


def disarm(name: str | None = None) -> None:
    if name is None:
        _armed.clear()
    else:
        _armed.pop(name, None)


def failpoint(name: str) -> None:
    """Fire the action armed for ``name``, if any (a dict lookup when none is)."""
    action = _armed.get(name)
    if action is not None:
        action()


def _arm_from_environment() -> None:
    for item in filter(None, os.environ.get("CYCLONE_FAILPOINTS", "").split(",")):
        name, _, action = item.partition("=")
        arm(name.strip(), action.strip() or "raise")


_arm_from_environment()
