"""A worker's Prometheus metrics as the tests read them: scraped from its ``/metrics``
endpoint and parsed by prometheus_client's own parser."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cyclone_dsl import Worker

#: Every sample of a scrape: (name, sorted labels) -> value.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(port: int | None) -> Samples:
    """The metrics a worker serves on ``port`` now."""
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse(response.read().decode())


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def counts(samples: Samples, kind: str) -> dict[str, float]:
    """The step counters of one kind."""
    return {
        what: total(samples, f"cyclone_steps_{what}_total", kind=kind)
        for what in ("claimed", "completed", "retried", "failed", "fenced")
    }


def metered(start_worker: Callable[..., Worker], *objects: Any, **options: Any) -> Worker:
    """A worker (conftest's ``start_worker``) serving its metrics on a free local port."""
    return start_worker(*objects, metrics_port=0, metrics_host="127.0.0.1", **options)
