"""Arm and disarm the engine's failpoints in tests (see :mod:`cyclone_dsl.failpoints`)."""

from cyclone_dsl.failpoints import POINTS, FailpointError, arm, disarm

__all__ = ["POINTS", "FailpointError", "arm", "disarm"]
