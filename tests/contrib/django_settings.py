"""Django settings for the management-command tests (``--settings tests.contrib.django_settings``).

The database comes from ``$CYCLONE_TEST_DSN``; ``CYCLONE`` has no ``DSN``, so the
commands build it from ``DATABASES["default"]``.
"""

from __future__ import annotations

import os

from cyclone_dsl.contrib.django import database_settings

SECRET_KEY = "cyclone-tests"
USE_TZ = True
INSTALLED_APPS = ["cyclone_dsl.contrib.django"]
DATABASES = {"default": database_settings(os.environ["CYCLONE_TEST_DSN"])}
CYCLONE = {
    "MODULES": ["tests.contrib.shapes"],
    "QUEUES": ["default"],
    "CONCURRENCY": 2,
    "GRACE": 5.0,
}
