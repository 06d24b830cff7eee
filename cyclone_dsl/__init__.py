"""Cyclone: durable workflows for Python whose only infrastructure is PostgreSQL."""

from cyclone_dsl._version import __version__

__all__ = ["__version__"]
