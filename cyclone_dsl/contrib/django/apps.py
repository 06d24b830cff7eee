"""The Django app: ``INSTALLED_APPS = [..., "cyclone_dsl.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class CycloneConfig(AppConfig):  # type: ignore[misc]  # Django ships no type hints
    name = "cyclone_dsl.contrib.django"
    label = "cyclone"
    verbose_name = "Cyclone workflows"
