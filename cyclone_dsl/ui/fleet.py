"""The fleet page: the workers (live, stopped or gone), the work no live worker serves,
and the queues' throughput and latency over a chosen time range."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from cyclone_dsl.client.sync import Client
from cyclone_dsl.errors import InvalidArgument
from cyclone_dsl.ui.trend import trend_chart

#: The time ranges the charts offer, and the default.
RANGES = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
}
DEFAULT_RANGE = "1h"
#: Slices of a chart's time range.
SLICES = 30

Render = Callable[..., HTMLResponse]


def status(worker: Mapping[str, Any]) -> str:
    """``live``; ``stopped`` (it stopped gracefully); ``gone`` (its beats stopped: it was
    killed, froze or lost the database)."""
    if worker["live"]:
        return "live"
    return "stopped" if worker["stopped_at"] is not None else "gone"


def window_of(name: str | None) -> tuple[str, timedelta]:
    name = name or DEFAULT_RANGE
    if name not in RANGES:
        raise InvalidArgument(f"range must be one of {', '.join(RANGES)}")
    return name, RANGES[name]


def charts(rows: list[dict[str, Any]], window: timedelta) -> tuple[str, str]:
    """The throughput chart (steps per minute) and the latency chart (seconds waited
    once due, median and 95th percentile) of :meth:`Client.throughput`'s rows."""
    per_minute = 60 / (window.total_seconds() / max(len(rows), 1))
    # The database's clock ends the window; datetime.now only stands in for no rows.
    until = rows[0]["until"] if rows else datetime.now(UTC)  # noqa: TID251
    rates = [
        {"started": r["started"] * per_minute, "completed": r["completed"] * per_minute}
        for r in rows
    ]
    throughput = trend_chart(
        chart_id="throughput",
        title="Throughput: steps started per minute",
        unit="steps per minute",
        values=rates,
        series=(("started", "started", "#1565c0"), ("completed", "of them completed", "#2e7d32")),
        until=until,
        window=window,
    )
    latency = trend_chart(
        chart_id="latency",
        title="Latency: seconds a due step waited for a worker",
        unit="seconds",
        values=rows,
        series=(
            ("wait_p50_s", "median", "#6a1b9a"),
            ("wait_p95_s", "95th percentile", "#ef6c00"),
        ),
        until=until,
        window=window,
    )
    return throughput, latency


def routes(
    reader: Callable[[Request], Client], render: Render, live_for: timedelta | None
) -> list[Route]:
    """``/fleet`` and ``/api/workers``, read from ``reader(request)`` (the primary's client
    or a replica's) and rendered with the app's ``render(request, template, **context)``."""

    def fleet(request: Request) -> HTMLResponse:
        name, window = window_of(request.query_params.get("range"))
        client = reader(request)
        workers = client.workers(live_for=live_for)
        for worker in workers:
            worker["status"] = status(worker)
        throughput, latency = charts(client.throughput(window=window, buckets=SLICES), window)
        return render(
            request,
            "fleet.html",
            workers=workers,
            unserved=client.stats(live_for=live_for)["unserved"],
            throughput=throughput,
            latency=latency,
            ranges=list(RANGES),
            range=name,
        )

    def api_workers(request: Request) -> Response:
        workers = reader(request).workers(live_for=live_for)
        for worker in workers:
            worker["status"] = status(worker)
        return JSONResponse(json.loads(json.dumps(workers, default=str)))

    return [Route("/fleet", fleet), Route("/api/workers", api_workers)]
