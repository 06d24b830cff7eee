"""``python manage.py cyclone_migrate``: create or upgrade Cyclone's tables.

On the database of :func:`cyclone_dsl.contrib.django.dsn` (its ``search_path``
decides the schema). Safe to run on every deploy: an up-to-date schema is left as is.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from cyclone_dsl.contrib.django import dsn
from cyclone_dsl.migrate import migrate_versions


class Command(BaseCommand):  # type: ignore[misc]  # Django ships no type hints
    help = "Apply Cyclone's pending schema migrations."

    def handle(self, *args: Any, **options: Any) -> None:
        versions = migrate_versions(dsn())
        self.stdout.write(
            f"cyclone schema version {versions.core}, extension version {versions.extension}"
        )
