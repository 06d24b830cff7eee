"""``python manage.py cyclone_worker [MODULE ...]``: a Cyclone worker in the Django project.

The modules (dotted names) are imported after Django is set up, so their handlers
can use the ORM. Defaults come from ``settings.CYCLONE`` (``MODULES``, ``QUEUES``,
``CONCURRENCY``, ``GRACE``) and the DSN from :func:`cyclone_dsl.contrib.django.dsn`.
It runs until SIGTERM or SIGINT, then stops gracefully and exits 0.
"""

from __future__ import annotations

import importlib
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from cyclone_dsl.contrib.django import cyclone_settings, dsn
from cyclone_dsl.worker.worker import Worker


class Command(BaseCommand):  # type: ignore[misc]  # Django ships no type hints
    help = "Run a Cyclone worker for the handlers of MODULES until SIGTERM or SIGINT."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "modules",
            nargs="*",
            help="Dotted module names whose workflows and steps it runs "
            "(default: CYCLONE['MODULES']).",
        )
        parser.add_argument(
            "--queues", help="Comma-separated queues to serve (default: CYCLONE['QUEUES'])."
        )
        parser.add_argument(
            "--concurrency", type=int, help="Handlers at once (default: CYCLONE['CONCURRENCY'])."
        )
        parser.add_argument(
            "--grace", type=float, help="Seconds to finish on SIGTERM (default: CYCLONE['GRACE'])."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        conf = cyclone_settings()
        names: list[str] = list(options["modules"] or conf["MODULES"])
        if not names:
            raise CommandError("name the modules to serve, or set CYCLONE['MODULES']")
        loaded = []
        for name in names:
            try:
                loaded.append(importlib.import_module(name))
            except ImportError as exc:
                raise CommandError(f"cannot import {name!r}: {exc}") from exc
        queues = (
            [q.strip() for q in options["queues"].split(",") if q.strip()]
            if options["queues"]
            else list(conf["QUEUES"])
        )
        worker = Worker(
            dsn(),
            loaded,
            queues=queues,
            concurrency=options["concurrency"] or int(conf["CONCURRENCY"]),
            grace=options["grace"] if options["grace"] is not None else float(conf["GRACE"]),
        )
        self.stdout.write(f"cyclone worker {worker.id}: queues {', '.join(queues)}")
        self.stdout.flush()
        worker.run()
        self.stdout.write(f"cyclone worker {worker.id}: stopped")
