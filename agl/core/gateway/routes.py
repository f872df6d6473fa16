"""The gateway's HTTP API as one router: rollouts, events, what the viewer reads
(summaries, status history), models, admission, and the proxy routes (which the fast
lane serves ahead of FastAPI; declared here for the OpenAPI document and the error
messages). Every handler authenticates through :class:`~agl.core.gateway.service.Gateway`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.responses import Response

from agl.core.contracts.queries import (
    HISTORY_SINCE,
    EventQuery,
    RolloutQuery,
    RolloutRow,
    SortKey,
    SummaryQuery,
    Transition,
)
from agl.core.contracts.records import TERMINAL, Mode, Status
from agl.core.gateway.dialects import ANTHROPIC, RESPONSES
from agl.core.gateway.openapi import OpenApiExtras
from agl.core.gateway.paths import (
    EVENTS,
    PROXY_CHAT,
    PROXY_COMPLETIONS,
    PROXY_COUNT_TOKENS,
    PROXY_MESSAGES,
    PROXY_RESPONSES,
)
from agl.core.gateway.query import ASCII_DIGITS, Int64, Natural64, Positive64, whole_number
from agl.core.gateway.service import Gateway
from agl.core.gateway.wire import (
    ADMISSION,
    EVENTS_BODY,
    MODELS,
    PATCH,
    SPECS,
    describe,
    json_response,
    parse,
)
from agl.core.http_errors import ApiError

MAX_PAGE = 1000
MAX_EVENT_PAGE = 10_000

# Integer query parameters, as SQLite binds them (a larger one was a 500, not a 4xx).
_SummaryLimit = Annotated[int, Field(ge=0, le=MAX_PAGE), ASCII_DIGITS]


class _SummaryParams(BaseModel):
    """The query string of ``GET /api/summaries``, read by hand (a bad value is a 400 in
    the gateway's error shape) and declared in the OpenAPI document from this model."""

    model_config = ConfigDict(extra="ignore")

    status: str | None = Field(default=None, description="comma list; may also repeat")
    mode: Mode | None = None
    group_id: str | None = None
    step: Int64 | None = Field(
        default=None,
        description="metadata.step (validation), else metadata.batch + 1 (training)",
    )
    min_reward: float | None = Field(default=None, allow_inf_nan=False)
    max_reward: float | None = Field(default=None, allow_inf_nan=False)
    sort: SortKey = SortKey.CREATED
    desc: bool = False
    offset: Natural64 = 0
    limit: _SummaryLimit = Field(default=100, description="0: the total alone")


class _SummaryPage(BaseModel):
    """The answer of ``GET /api/summaries``, for the OpenAPI document: each rollout as an
    admin reads it, with its current attempt's summary (null before its first event)."""

    total: int
    items: list[RolloutRow]


class _History(BaseModel):
    """The answer of ``GET /api/rollouts/{id}/transitions``, for the OpenAPI document.
    ``complete`` is false for a rollout made before its store recorded status changes."""

    items: list[Transition]
    complete: bool


def api_router(gw: Callable[[], Gateway], schema: OpenApiExtras) -> APIRouter:
    """The API's routes over the gateway ``gw()`` answers (made in the app's lifespan)."""
    router = APIRouter()

    @router.get("/healthz")
    async def healthz() -> Response:
        return json_response({"status": "ok"})

    # -- rollouts ------------------------------------------------------------------

    @router.post("/api/rollouts", openapi_extra=schema.body(SPECS))
    async def create_rollouts(request: Request) -> Response:
        g = gw()
        await g.admin(request)
        specs = parse(SPECS, await request.body())
        rollouts = await g.store.create_rollouts(specs, time.time())
        return json_response([g.rolloutjson_response(r, admin=True) for r in rollouts])

    @router.get("/api/rollouts")
    async def list_rollouts(
        request: Request,
        status: str | None = None,
        mode: str | None = None,
        group_id: str | None = None,
        cursor: str | None = None,
        limit: Int64 = 100,
    ) -> Response:
        g = gw()
        await g.admin(request)
        statuses = _statuses(request.query_params.getlist("status"))
        if not 1 <= limit <= MAX_PAGE:
            raise ApiError(422, f"limit must be between 1 and {MAX_PAGE}")
        query = RolloutQuery(statuses, mode, group_id, _cursor(cursor), limit)
        rollouts, next_cursor = await g.store.list_rollouts(query)
        return json_response(
            {
                "items": [g.rolloutjson_response(r, admin=True) for r in rollouts],
                "next_cursor": None if next_cursor is None else str(next_cursor),
            }
        )

    @router.get("/api/rollouts/{rollout_id}")
    async def get_rollout(request: Request, rollout_id: str) -> Response:
        g = gw()
        principal, rollout = await g.readable(request, rollout_id)
        return json_response(g.rolloutjson_response(rollout, principal.admin))

    @router.patch("/api/rollouts/{rollout_id}", openapi_extra=schema.body(PATCH))
    async def patch_rollout(request: Request, rollout_id: str) -> Response:
        g = gw()
        await g.admin(request)
        return await g.patch(rollout_id, parse(PATCH, await request.body()), admin=True)

    @router.patch("/api/rollouts/{rollout_id}/attempt/{attempt}", openapi_extra=schema.body(PATCH))
    async def patch_attempt(request: Request, rollout_id: str, attempt: int) -> Response:
        g = gw()
        principal = await g.for_attempt(request, rollout_id, attempt)
        patch = parse(PATCH, await request.body())
        if patch.attempt not in (None, attempt):
            raise ApiError(422, f"body names attempt {patch.attempt} but the path {attempt}")
        if not principal.admin and patch.status not in TERMINAL:
            raise ApiError(403, "an agent may only set its attempt to succeeded or failed")
        patch = patch.model_copy(update={"attempt": attempt})
        return await g.patch(rollout_id, patch, principal.admin)

    # -- events --------------------------------------------------------------------

    @router.get("/api/rollouts/{rollout_id}/events")
    async def get_events(
        request: Request,
        rollout_id: str,
        attempt: Positive64 | None = None,
        type: str | None = None,
        cursor: str | None = None,
        limit: Int64 = 1000,
    ) -> Response:
        g = gw()
        principal, _ = await g.readable(request, rollout_id)
        if not principal.admin:
            # An attempt reads its own events only, not those of the attempts before it.
            if attempt not in (None, principal.attempt):
                raise ApiError(
                    403,
                    f"this key reads the events of its own attempt ({principal.attempt}) only, "
                    f"not of attempt {attempt}",
                    param="attempt",
                )
            attempt = principal.attempt
        if not 1 <= limit <= MAX_EVENT_PAGE:
            raise ApiError(422, f"limit must be between 1 and {MAX_EVENT_PAGE}")
        events = await g.store.list_events(
            rollout_id, EventQuery(attempt, type, _cursor(cursor), limit)
        )
        next_cursor = str(events[-1].sequence) if len(events) == limit else None
        return json_response({"items": events, "next_cursor": next_cursor})

    # -- what the viewer reads: summaries and status history ------------------------

    @router.get(
        "/api/summaries",
        openapi_extra={**schema.query(_SummaryParams), **schema.returns(TypeAdapter(_SummaryPage))},
    )
    async def get_summaries(request: Request) -> Response:
        g = gw()
        await g.admin(request)
        rows, total = await g.store.query_rollouts(_summary_query(request))
        items = [
            {"rollout": g.rolloutjson_response(row.rollout, admin=True), "summary": row.summary}
            for row in rows
        ]
        return json_response({"total": total, "items": items})

    @router.get(
        "/api/rollouts/{rollout_id}/transitions",
        openapi_extra=schema.returns(TypeAdapter(_History)),
    )
    async def get_transitions(request: Request, rollout_id: str) -> Response:
        g = gw()
        await g.admin(request)
        rollout = await g.rollout(rollout_id)
        since = await g.store.get_meta(HISTORY_SINCE)
        complete = since is None or rollout.created_at >= float(since)
        return json_response({"items": await g.store.transitions(rollout_id), "complete": complete})

    # -- models and admission ------------------------------------------------------

    @router.post("/api/models", openapi_extra=schema.body(MODELS))
    async def post_models(request: Request) -> Response:
        g = gw()
        await g.admin(request)
        endpoints = parse(MODELS, await request.body())
        await g.store.put_models(endpoints)
        models = await g.store.list_models()
        g.proxy.router.load(models)
        return json_response([m.model_dump() for m in models])

    @router.get("/api/models")
    async def get_models(request: Request) -> Response:
        g = gw()
        await g.admin(request)
        return json_response([m.model_dump() for m in await g.store.list_models()])

    @router.delete("/api/models")
    async def delete_models(request: Request, model: str | None = None) -> Response:
        g = gw()
        await g.admin(request)
        deleted = await g.store.delete_models(model)
        g.proxy.router.load(await g.store.list_models())
        return json_response({"deleted": deleted})

    @router.post("/api/admission", openapi_extra=schema.body(ADMISSION))
    async def post_admission(request: Request) -> Response:
        g = gw()
        await g.admin(request)
        wanted = parse(ADMISSION, await request.body())
        admission = await g.admission.set(wanted.state, wanted.timeout_s)
        return json_response(admission.model_dump())

    @router.get("/api/admission")
    async def get_admission(request: Request) -> Response:
        g = gw()
        await g.admin(request)
        return json_response((await g.admission.status()).model_dump())

    # -- proxy ---------------------------------------------------------------------

    @router.post(PROXY_CHAT)
    async def proxy_chat(request: Request, rollout_id: str, attempt: int, mode: str) -> Response:
        return await gw().proxy_call(request, rollout_id, attempt, mode)

    @router.post(PROXY_COMPLETIONS)
    async def proxy_completions(
        request: Request, rollout_id: str, attempt: int, mode: str
    ) -> Response:
        return await gw().proxy_completions(request, rollout_id, attempt, mode)

    @router.post(PROXY_RESPONSES)
    async def proxy_responses(
        request: Request, rollout_id: str, attempt: int, mode: str
    ) -> Response:
        return await gw().proxy_call(request, rollout_id, attempt, mode, RESPONSES)

    @router.post(PROXY_MESSAGES)
    async def proxy_messages(
        request: Request, rollout_id: str, attempt: int, mode: str
    ) -> Response:
        return await gw().proxy_call(request, rollout_id, attempt, mode, ANTHROPIC)

    @router.post(PROXY_COUNT_TOKENS)
    async def proxy_count_tokens(
        request: Request, rollout_id: str, attempt: int, mode: str
    ) -> Response:
        return await gw().count_tokens(request, rollout_id, attempt, mode)

    @router.post(EVENTS, openapi_extra=schema.body(EVENTS_BODY))
    async def post_events(request: Request, rollout_id: str, attempt: int) -> Response:
        return await gw().post_events(request, rollout_id, attempt)

    return router


def _statuses(values: list[str]) -> frozenset[Status]:
    names = [v for value in values for v in value.split(",") if v]
    try:
        return frozenset(Status(n) for n in names)
    except ValueError:
        allowed = ", ".join(s.value for s in Status)
        raise ApiError(422, f"unknown status in {names}; use one of: {allowed}") from None


def _cursor(cursor: str | None) -> int:
    if cursor is None or cursor == "":
        return 0
    try:
        return whole_number(cursor)
    except ValueError:
        raise ApiError(422, f"cursor {cursor[:40]!r} is not one this gateway handed out") from None


def _summary_query(request: Request) -> SummaryQuery:
    """The store query a ``GET /api/summaries`` asks for; a bad value is a 400 that names
    it (not FastAPI's 422: the route reads its parameters itself)."""
    try:
        params = _SummaryParams.model_validate(dict(request.query_params))
        statuses = _statuses(request.query_params.getlist("status"))
    except ValidationError as error:
        raise ApiError(400, describe(error.errors())) from None
    except ApiError as error:
        raise ApiError(400, error.message) from None
    return SummaryQuery(
        statuses=statuses,
        mode=params.mode,
        group_id=params.group_id,
        step=params.step,
        min_reward=params.min_reward,
        max_reward=params.max_reward,
        sort=params.sort,
        descending=params.desc,
        offset=params.offset,
        limit=params.limit,
    )
