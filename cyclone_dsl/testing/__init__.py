"""Test support for Cyclone users: schema fixtures, hypothesis strategies, and a movable clock."""

from cyclone_dsl.testing.clock import set_clock_shift, shifted_clock

__all__ = ["set_clock_shift", "shifted_clock"]
