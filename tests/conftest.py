"""Shared fixtures: every test gets a fresh migrated schema (see cyclone_dsl.testing)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "full", deadline=None, max_examples=500, suppress_health_check=list(HealthCheck)
)
settings.load_profile(os.environ.get("CYCLONE_HYPOTHESIS_PROFILE", "ci"))
