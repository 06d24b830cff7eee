"""Bulk actions on the runs list: cancel, retry or resume every run a filter matches.

Two steps, as the CLI does: ``/bulk/preview`` counts the matching runs (a dry run) and
asks to confirm that count; ``/bulk/apply`` acts, in the client's batches, and reports
what it did. The filter is the runs list's own (workflow, state, error kind, created
since/until); the text and parent filters have no bulk counterpart and are refused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from cyclone_dsl.client.bulk import BulkResult
from cyclone_dsl.client.sync import Client
from cyclone_dsl.engine.bulk import RunFilter
from cyclone_dsl.errors import CycloneError, InvalidArgument

#: The bulk actions, each with the client method that does it.
ACTIONS = ("cancel", "retry", "resume")
#: The runs list's filter fields a bulk action takes over.
FIELDS = ("workflow", "state", "error_kind", "since", "until")

Page = Callable[..., HTMLResponse]
Guarded = Callable[[Request], Awaitable["dict[str, str] | Response"]]
Back = Callable[..., RedirectResponse]


def run_filter(form: Mapping[str, str]) -> RunFilter:
    """The :class:`RunFilter` of a bulk form (InvalidArgument on anything it cannot take)."""
    for unsupported, what in (("q", "text"), ("parent", "parent run")):
        if form.get(unsupported):
            raise InvalidArgument(
                f"bulk actions do not filter by {what}: clear that filter (they take "
                "workflow, state, error kind and time range)"
            )

    def instant(name: str) -> datetime | None:
        value = form.get(name)
        if not value:
            return None
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            raise InvalidArgument(f"{name} must be an ISO date or time") from None

    if not any(form.get(k) for k in FIELDS):
        raise InvalidArgument(
            "a bulk action needs a filter (workflow, state, error kind or time range): "
            "it never acts on every run from the dashboard"
        )
    return RunFilter(
        workflows=form.get("workflow") or (),
        states=form.get("state") or (),
        error_kinds=form.get("error_kind") or (),
        since=instant("since"),
        until=instant("until"),
    )


def apply(client: Client, action: str, where: RunFilter, *, dry_run: bool) -> BulkResult:
    if action not in ACTIONS:
        raise InvalidArgument(f"unknown bulk action {action!r}: one of {', '.join(ACTIONS)}")
    method: Callable[..., BulkResult] = getattr(client, f"{action}_many")
    return method(where, dry_run=dry_run)


def summary(result: BulkResult) -> str:
    text = f"{result.action}: {result.acted} of {result.matched} matching runs"
    if result.skipped:
        first = "; ".join(f"run {run_id}: {why}" for run_id, why in result.skipped_runs[:3])
        text += f", {result.skipped} skipped ({first})"
    return text


def routes(client: Client, page: Page, guarded: Guarded, back: Back) -> list[Route]:
    """``/bulk/preview`` (the count, to confirm) and ``/bulk/apply`` (the action)."""
    from starlette.concurrency import run_in_threadpool

    async def preview(request: Request) -> Response:
        form = await guarded(request)
        if isinstance(form, Response):
            return form
        filters = {k: form[k] for k in FIELDS if form.get(k)}
        action = form.get("action", "")
        try:
            where = run_filter(form)
            counted = await run_in_threadpool(apply, client, action, where, dry_run=True)
        except CycloneError as exc:
            return back("/runs", error=str(exc).splitlines()[0])
        return page(request, "bulk_confirm.html", action=action, filters=filters, found=counted)

    async def apply_route(request: Request) -> Response:
        form = await guarded(request)
        if isinstance(form, Response):
            return form
        filters = {k: form[k] for k in FIELDS if form.get(k)}
        try:
            done = await run_in_threadpool(
                apply, client, form.get("action", ""), run_filter(form), dry_run=False
            )
        except CycloneError as exc:
            return back("/runs", error=str(exc).splitlines()[0])
        return back("/runs", message=summary(done), **filters)

    return [
        Route("/bulk/preview", preview, methods=["POST"]),
        Route("/bulk/apply", apply_route, methods=["POST"]),
    ]


def hidden_fields(filters: Mapping[str, Any]) -> dict[str, str]:
    """The filter fields a bulk form carries (the ones set)."""
    return {k: str(filters[k]) for k in FIELDS if filters.get(k)}
