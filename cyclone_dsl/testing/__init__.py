"""Test support for Cyclone users: schema fixtures and hypothesis strategies."""
