"""The ``cyclone`` command line."""

from __future__ import annotations


def main() -> None:
    raise SystemExit("cyclone: not implemented yet")
