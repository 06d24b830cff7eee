"""The dashboard's routes. Every write goes through :class:`~cyclone_dsl.Client`.

Safety: Jinja2 autoescapes every value (inputs, outputs and errors are
untrusted); forms carry a CSRF token that must match a SameSite=Strict
cookie; ``read_only`` refuses every write; ``token`` requires a shared secret
on every write.

With ``read_dsn``, pages and read-only endpoints read from a read replica
(:mod:`cyclone_dsl.ui.replica`) while every action still goes to ``client``.
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any
from urllib.parse import urlencode

import attrs
from jinja2 import Environment, PackageLoader, pass_context, select_autoescape
from jinja2.runtime import Context
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from cyclone_dsl.client.model import StepEvent
from cyclone_dsl.client.sync import Client
from cyclone_dsl.errors import CycloneError, DatabaseUnavailable, InvalidArgument, RunNotFound
from cyclone_dsl.states import ErrorKind, RunState, StepState
from cyclone_dsl.ui import bulk, fleet, humane, timeline
from cyclone_dsl.ui.chart import queue_chart
from cyclone_dsl.ui.graph import draw
from cyclone_dsl.ui.replica import Reading, Reads, ReplicaUnavailable
from cyclone_dsl.ui.throttle import Throttled

CSRF_COOKIE = "cyclone_csrf"
PAGE = 50
PREVIEW_CHARS = 2000


def _same_secret(expected: str, given: str) -> bool:
    """A constant-time comparison of two secrets; as bytes, since compare_digest refuses
    strings with non-ASCII characters (a token "pässwort" failed every write)."""
    return hmac.compare_digest(expected.encode("utf-8"), given.encode("utf-8"))


class _NoSuchRun(RunNotFound):
    """A run id in a URL that is not a number."""

    def __init__(self, given: str) -> None:
        self.run_id = -1
        CycloneError.__init__(self, f"no run has the id {given!r}: a run id is a number")


def _json(value: object) -> str:
    return json.dumps(value, indent=2, default=str, ensure_ascii=False)


def _preview(value: object) -> tuple[str, bool]:
    text = _json(value)
    return (text[:PREVIEW_CHARS], len(text) > PREVIEW_CHARS)


#: Error kinds the runs list filters by: the steps' and the attempt history's.
ERROR_KINDS = [k.value for k in ErrorKind if k is not ErrorKind.SKIPPED]


@pass_context
def _when(context: Context, value: datetime | None) -> Markup:
    return humane.when_html(value, context["now"])


def create_app(
    client: Client,
    *,
    read_only: bool = False,
    token: str | None = None,
    live_for: timedelta | None = None,
    read_dsn: str | None = None,
) -> Starlette:
    """The dashboard on ``client``. ``live_for``: how recent a worker's last beat must be
    for the fleet page to show it live (default: the engine's, 30 s). ``read_dsn``: a
    read replica that every page and read-only endpoint reads from (with its lag shown);
    actions still go to ``client``. The replica is first reached at the first page, so
    the app starts while it is down (its pages then say so)."""
    if token is not None and (not isinstance(token, str) or not token):
        # "" would be matched by a request that sends no token: writes left unprotected.
        raise InvalidArgument(f"token must be a non-empty string or None, not {token!r}")
    reads = Reads(client, read_dsn)

    def reading(request: Request) -> Reading:
        """What ``request`` reads from (asked once per request)."""
        found: Reading | None = getattr(request.state, "reading", None)
        if found is None:
            found = reads.begin(request.query_params.get("seen"))
            request.state.reading = found
        return found

    def reader(request: Request) -> Client:
        return reading(request).client

    polled_counts: Throttled[dict[str, int]] = Throttled(lambda client: client.run_counts())
    polled_stats: Throttled[dict[str, Any]] = Throttled(lambda client: client.stats())

    env = Environment(
        loader=PackageLoader("cyclone_dsl.ui", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    env.filters["preview"] = _preview
    env.filters["json"] = _json
    env.filters["when"] = _when
    env.filters["duration"] = humane.duration
    env.filters["exact"] = humane.exact
    env.globals["took"] = humane.took

    def render(request: Request, template: str, csrf: str, **context: Any) -> str:
        # Shown to the viewer as "3 min ago"; nothing is decided on this clock.
        context.setdefault("now", datetime.now(UTC))  # noqa: TID251
        return env.get_template(template).render(
            request=request,
            csrf=csrf,
            read_only=read_only,
            needs_token=token is not None,
            message=request.query_params.get("message"),
            replica=getattr(request.state, "reading", None),
            error=request.query_params.get("error"),
            **context,
        )

    def page(request: Request, template: str, **context: Any) -> HTMLResponse:
        csrf = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(24)
        counts = reader(request).run_counts()
        html = render(request, template, csrf, counts=counts, **context)
        response = HTMLResponse(html)
        response.set_cookie(CSRF_COOKIE, csrf, httponly=True, samesite="strict")
        return response

    def back(url: str, **query: str) -> RedirectResponse:
        seen = reads.position()
        if seen is not None:
            query["seen"] = seen  # the page waits for the replica to replay the action
        return RedirectResponse(f"{url}?{urlencode(query)}", status_code=303)

    async def guarded(request: Request) -> dict[str, str] | Response:
        """The form of a write request, or the refusal."""
        if read_only:
            return JSONResponse({"error": "this dashboard is read-only"}, status_code=403)
        form = {k: str(v) for k, v in (await request.form()).items()}
        cookie = request.cookies.get(CSRF_COOKIE, "")
        if not cookie or not _same_secret(cookie, form.get("csrf", "")):
            return JSONResponse({"error": "missing or wrong CSRF token"}, status_code=403)
        if token is not None:
            given = form.get("token") or request.headers.get("x-cyclone-token", "")
            if not _same_secret(token, given):
                return JSONResponse({"error": "missing or wrong token"}, status_code=401)
        return form

    def run_id_of(request: Request) -> int:
        given = request.path_params["run_id"]
        try:
            return int(given)
        except ValueError:
            raise _NoSuchRun(given) from None

    def runs(request: Request) -> HTMLResponse:
        filters = _run_filters(request)
        found = reader(request).list_runs(limit=PAGE, **filters)
        next_before = found[-1].id if len(found) == PAGE else None
        query = {k: v for k, v in request.query_params.items() if k not in ("before_id", "seen")}
        return page(
            request,
            "runs.html",
            runs=found,
            filters=request.query_params,
            next_query=urlencode({**query, "before_id": next_before}) if next_before else None,
            states=[s.value for s in RunState],
            error_kinds=ERROR_KINDS,
            bulk_fields=bulk.hidden_fields(request.query_params),
        )

    def run_context(request: Request) -> dict[str, Any]:
        run_id = run_id_of(request)
        client = reader(request)
        run = client.get_run(run_id)
        deps = client.dependencies(run_id)
        drill = request.query_params.get("items")
        shown = [s for s in run.steps if s.item_of is None or s.item_of == drill]
        # (completed, all) items of each fan-out node, counted once: per row, the page
        # walked every step of the run (a drill-down of 4,000 items took 26 s).
        items: dict[str, list[int]] = {}
        for s in run.steps:
            if s.item_of is not None:
                counted = items.setdefault(s.item_of, [0, 0])
                counted[0] += s.state is StepState.COMPLETED
                counted[1] += 1
        children = client.children_of(run_id)
        child_of = {c["parent_node_id"]: c["id"] for c in children}
        now = datetime.now(UTC)  # noqa: TID251 (drawn for the viewer)
        rows = timeline.build(run, deps, now, child_of)
        return {
            "now": now,
            "run": run,
            "svg": draw(run.steps, deps, run.id),
            "timeline": timeline.draw(run, rows, now),
            "attempts": {s.id: timeline.attempts(s, now) for s in shown},
            "steps": shown,
            "items": items,
            "deps": deps,
            "drill": drill,
            "signals": client.signals_of(run_id),
            "children": children,
            "reasons": client.why_waiting(run_id),
            **events_context(client.events_of(run_id, limit=EVENTS_READ)),
        }

    def run_page(request: Request) -> HTMLResponse:
        return page(request, "run.html", **run_context(request))

    def run_live(request: Request) -> HTMLResponse:
        """The run page's changing part, which its script fetches to stay current."""
        csrf = request.cookies.get(CSRF_COOKIE, "")
        html = render(request, "run_live.html", csrf, **run_context(request))
        return HTMLResponse(html, headers={"cache-control": "no-store"})

    def output(request: Request) -> Response:
        run = reader(request).get_run(run_id_of(request))
        try:
            step = run.step(request.path_params["node"])
        except KeyError:
            return JSONResponse({"error": "no such node"}, status_code=404)
        return Response(
            _json(step.output),
            media_type="application/json",
            headers={"content-disposition": f'attachment; filename="{run.id}.json"'},
        )

    async def steer(request: Request) -> Response:
        form = await guarded(request)
        if isinstance(form, Response):
            return form
        run_id = run_id_of(request)
        action = request.path_params["action"]
        url = f"/runs/{run_id}"
        try:
            if action == "signal":
                payload = json.loads(form.get("payload") or "null")
                delivery = await _threaded(client.signal, run_id, form.get("name", ""), payload)
                return back(url, message=f"signal {form.get('name')!r}: {delivery.value}")
            if action == "fork":
                node = form.get("node", "")
                forked = await _threaded(client.fork, run_id, node)
                return back(f"/runs/{forked.id}", message=f"forked from run {run_id} at {node!r}")
            if action == "retry":
                await _threaded(client.retry, run_id, form.get("node", ""))
            elif action in ("cancel", "pause", "resume"):
                await _threaded(getattr(client, action), run_id)
            else:
                return JSONResponse({"error": "unknown action"}, status_code=404)
        except json.JSONDecodeError as exc:
            return back(url, error=f"the payload is not valid JSON: {exc}")
        except RecursionError:
            return back(url, error="the payload is not valid JSON: it is nested too deeply")
        except CycloneError as exc:
            return back(url, error=str(exc).splitlines()[0])
        return back(url, message=f"{action}: done")

    def queues(request: Request) -> HTMLResponse:
        client = reader(request)
        stats = client.stats()
        return page(
            request,
            "queues.html",
            stats=stats,
            # The axis is drawn for the viewer; nothing is decided on this clock.
            chart=queue_chart(stats["queues"], datetime.now(UTC)),  # noqa: TID251
            workers=client.workers(),
        )

    def schedules(request: Request) -> HTMLResponse:
        return page(request, "schedules.html", schedules=reader(request).list_schedules())

    async def toggle_schedule(request: Request) -> Response:
        form = await guarded(request)
        if isinstance(form, Response):
            return form
        action = request.path_params["action"]
        if action not in ("enable", "disable"):
            return JSONResponse({"error": "unknown action"}, status_code=404)
        enabled = action == "enable"
        try:
            await _threaded(client.enable_schedule, request.path_params["schedule_id"], enabled)
        except CycloneError as exc:
            return back("/schedules", error=str(exc))
        return back("/schedules", message="enabled" if enabled else "disabled")

    def api_counts(request: Request) -> JSONResponse:
        # Polled by every open page every 2 s: shared (a page render reads its own).
        return JSONResponse(polled_counts.get(reader(request)))

    def api_stats(request: Request) -> JSONResponse:
        # Polled every 2 s by each open queues page (its chart): shared, as the counts.
        return JSONResponse(json.loads(_json(polled_stats.get(reader(request)))))

    def api_runs(request: Request) -> JSONResponse:
        found = reader(request).list_runs(limit=PAGE, **_run_filters(request))
        return JSONResponse(json.loads(_json([attrs.asdict(r) for r in found])))

    def api_run(request: Request) -> JSONResponse:
        run = reader(request).get_run(run_id_of(request))
        return JSONResponse(json.loads(_json(attrs.asdict(run))))

    gauges_registry: list[Any] = []  # built at the first scrape of /metrics
    scraped: list[Client] = [client]  # what the scrape in progress reads from

    def prometheus(request: Request) -> Response:
        """The database-wide gauges, in Prometheus's text format (the ``metrics`` extra)."""
        try:
            from cyclone_dsl.observability import metrics
        except ImportError:
            return PlainTextResponse(
                "/metrics needs prometheus_client: pip install 'cyclone-dsl[metrics]'\n",
                status_code=501,
            )
        scraped[:] = [reader(request)]
        if not gauges_registry:
            gauges_registry.append(metrics.database_registry(lambda: scraped[0].gauges()))
        body, content_type = metrics.exposition(gauges_registry[0], request.headers.get("accept"))
        return Response(body, media_type=content_type)

    def api_attempts(request: Request) -> JSONResponse:
        """Each step's attempts, in order, as the run page lists them: the attempt history,
        then the attempt the step row holds (completed, running or cancelled)."""
        run = reader(request).get_run(run_id_of(request))
        now = datetime.now(UTC)  # noqa: TID251 (a running attempt's end, for the viewer)
        listed = {
            s.node: [
                {
                    "number": a.number,
                    "label": a.label,
                    "outcome": a.outcome,
                    "worker": a.worker,
                    "started_at": a.ran.start,
                    "ended_at": None if a.outcome == "running" else a.ran.end,
                    "error": a.error,
                    "error_kind": a.error_kind,
                }
                for a in timeline.attempts(s, now)
                if a.ran is not None
            ]
            for s in run.steps
        }
        return JSONResponse(json.loads(_json(listed)))

    def home(request: Request) -> RedirectResponse:
        return RedirectResponse("/runs")

    async def not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": str(exc)}, status_code=404)

    async def bad_request(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": str(exc)}, status_code=400)

    async def unavailable(request: Request, exc: Exception) -> Response:
        """A page that cannot be read: the replica (or the database) is down."""
        if isinstance(exc, DatabaseUnavailable) and reads.replicated:
            reads.forget()  # the replica's client may hold dead connections
        text = one_line(str(exc)) or type(exc).__name__
        path = request.url.path
        if path.startswith(("/api/", "/metrics")) or path.endswith("/live"):
            return JSONResponse({"error": text}, status_code=503)
        html = env.get_template("unavailable.html").render(
            request=request,
            read_only=read_only,
            counts={},
            # Drawn for the viewer; nothing is decided on this clock.
            now=datetime.now(UTC),  # noqa: TID251
            problem=text,
        )
        return HTMLResponse(html, status_code=503)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            reads.close()

    static = resources.files("cyclone_dsl.ui").joinpath("static")
    return Starlette(
        routes=[
            Route("/", home),
            Route("/runs", runs),
            Route("/runs/{run_id}", run_page),
            Route("/runs/{run_id}/live", run_live),
            # :path: a node or schedule id may hold a "/" (the templates leave it as is).
            Route("/runs/{run_id}/steps/{node:path}/output.json", output),
            Route("/runs/{run_id}/{action}", steer, methods=["POST"]),
            Route("/queues", queues),
            Route("/schedules", schedules),
            Route("/schedules/{schedule_id:path}/{action}", toggle_schedule, methods=["POST"]),
            Route("/api/counts", api_counts),
            Route("/api/stats", api_stats),
            Route("/api/runs", api_runs),
            Route("/api/runs/{run_id}", api_run),
            Route("/metrics", prometheus),
            Route("/api/runs/{run_id}/attempts", api_attempts),
            *fleet.routes(reader, page, live_for),
            *bulk.routes(client, page, guarded, back),
            Mount("/static", StaticFiles(directory=str(static)), name="static"),
        ],
        exception_handlers={
            RunNotFound: not_found,
            InvalidArgument: bad_request,
            ValueError: bad_request,
            ReplicaUnavailable: unavailable,
            DatabaseUnavailable: unavailable,
        },
        lifespan=lifespan,
    )


#: Events the run page reads (from the first), and how many of the latest it lists.
EVENTS_READ = 500
EVENTS_SHOWN = 50


def events_context(events: list[StepEvent]) -> dict[str, Any]:
    """The run page's events: the latest ones listed, newest first; each node's latest
    progress (``ctx.progress``) for its bar; whether there were more than were read."""
    progress: dict[str, StepEvent] = {}
    for event in events:
        if event.kind == "progress":
            progress[event.node] = event
    return {
        "events": list(reversed(events[-EVENTS_SHOWN:])),
        "events_total": len(events),
        "events_more": len(events) >= EVENTS_READ,
        "progress": progress,
    }


def _run_filters(request: Request) -> dict[str, Any]:
    params = request.query_params

    def number(name: str) -> int | None:
        value = params.get(name)
        if not value:
            return None
        try:
            return int(value)
        except ValueError:
            raise InvalidArgument(f"{name} must be a number") from None

    def instant(name: str) -> datetime | None:
        value = params.get(name)
        if not value:
            return None
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidArgument(f"{name} must be an ISO date or time") from None
        if parsed.tzinfo is None:
            raise InvalidArgument(f"{name} needs a time zone (e.g. 2026-12-03T10:00+00:00)")
        return parsed

    return {
        "state": params.get("state") or None,
        "workflow": params.get("workflow") or None,
        "before_id": number("before_id"),
        "parent_run_id": number("parent"),
        "since": instant("since"),
        "until": instant("until"),
        "text": params.get("q") or None,
        "error_kind": params.get("error_kind") or None,
    }


def one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


async def _threaded(fn: Any, *args: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)
