"""Arm and disarm the engine's failpoints in tests (see :mod:`cyclone_dsl.failpoints`)."""

from cyclone_dsl import failpoints as _failpoints
from cyclone_dsl.failpoints import POINTS, FailpointError, arm, disarm

__all__ = ["POINTS", "FailpointError", "arm", "armed", "disarm"]


def armed() -> list[str]:
    """The failpoints armed in this process, by name: a test should leave none behind."""
    return sorted(_failpoints._armed)
