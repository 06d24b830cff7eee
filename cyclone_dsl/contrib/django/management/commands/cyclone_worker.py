"""``python manage.py cyclone_worker [MODULE ...]``: a Cyclone worker in the Django project.

The modules (dotted names) are imported after Django is set up, so their handlers
can use the ORM. Defaults come from ``settings.CYCLONE`` (``MODULES``, ``QUEUES``,
``CONCURRENCY``, ``GRACE``) and the DSN from :func:`cyclone_dsl.contrib.django.dsn`.
It runs until SIGTERM or SIGINT, then stops gracefully and exits 0.
"""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

from django.core.management.base import BaseCommand, CommandError

from cyclone_dsl.contrib.django import cyclone_settings, dsn
from cyclone_dsl.errors import CycloneError
from cyclone_dsl.worker.worker import Worker

T = TypeVar("T")


def pick(given: T | None, configured: T) -> T:
    """The command-line value if one was given (``0`` included), else the setting."""
    return configured if given is None else given


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
            "--concurrency",
            type=int,
            help="Handlers at once (default: CYCLONE['CONCURRENCY'], else adaptive).",
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
        try:
            worker = Worker(
                dsn(),
                loaded,
                queues=queues,
                concurrency=pick(options["concurrency"], conf["CONCURRENCY"]),
                grace=pick(options["grace"], float(conf["GRACE"])),
            )
            self.stdout.write(f"cyclone worker {worker.id}: queues {', '.join(queues)}")
            self.stdout.flush()
            worker.run()
        except CycloneError as exc:  # a bad option, an unreachable database: one line
            raise CommandError(str(exc).splitlines()[0] if str(exc) else repr(exc)) from exc
        self.stdout.write(f"cyclone worker {worker.id}: stopped")
