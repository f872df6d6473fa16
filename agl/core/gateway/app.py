"""The API Gateway as an ASGI app (docs/design.md, "Gateway API"): the composition root.
It opens the store, builds the gateway's state in the lifespan, wires the API router and
the viewer's, answers every error in one shape, and puts the connection and body guards
and the fast lane in front of FastAPI."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp

from agl import ui
from agl.core.gateway.admission import AdmissionGate
from agl.core.gateway.asgi import INTERNAL_ERROR, BodyLimit, FastLane
from agl.core.gateway.auth import Keyring
from agl.core.gateway.config import GatewayConfig
from agl.core.gateway.connections import BodyTimeout, RefusalDelay
from agl.core.gateway.openapi import OpenApiExtras
from agl.core.gateway.proxy import RecordingProxy
from agl.core.gateway.ratelimit import AttemptRateLimit, RateLimit, SharedRateLimit
from agl.core.gateway.replicas import ReplicaGroup, Solo
from agl.core.gateway.routes import api_router
from agl.core.gateway.seeding import RequestSeeds
from agl.core.gateway.service import Gateway
from agl.core.gateway.store import SharedStore, open_store
from agl.core.gateway.upstream import RetryPolicy, Upstream
from agl.core.gateway.wire import describe
from agl.core.http_errors import ApiError, error_response
from agl.ui.session import Sessions

# What Starlette's own refusals (no such route, a method the route lacks) say.
_ROUTING_ERRORS = {404: "no route {method} {path}", 405: "method {method} is not allowed on {path}"}


def create_app(config: GatewayConfig, admin_token: str) -> ASGIApp:
    """The gateway as an ASGI app: FastAPI for the API, with the body timeout, the body
    limit and the fast lane in front of it (outside FastAPI's own middleware, which the
    hot routes skip)."""
    holder: dict[str, Gateway] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = open_store(
            config.store_url,
            fsync=config.fsync,
            password_file=config.store_password_file,
            lease_s=config.replica_lease_s,
        )
        await store.connect()
        secret = await store.set_meta_once("secret", secrets.token_hex(32))
        upstream = Upstream(
            RetryPolicy(config.upstream_retries, config.upstream_backoff_s),
            config.upstream_timeout_s,
            config.inference_key,
        )
        await upstream.start()
        seeds = RequestSeeds(config.sampling_seed) if config.sampling_seed >= 0 else None
        proxy = RecordingProxy(
            store, upstream, AdmissionGate(), seeds, int(config.prompt_cache_mb * 2**20)
        )
        proxy.router.load(await store.list_models())
        # Replicas share admission and the rate limit through their store; a gateway
        # alone keeps both in the process.
        admission: Solo | ReplicaGroup
        limit: RateLimit
        if isinstance(store, SharedStore):
            admission = ReplicaGroup(
                store, proxy, config.replica_heartbeat_s, config.replica_lease_s
            )
            limit = SharedRateLimit(store, config.attempt_rps, config.attempt_burst)
        else:
            admission = Solo(store, proxy)
            limit = AttemptRateLimit(config.attempt_rps, config.attempt_burst)
        await admission.start()  # paused, if the trainer paused it
        gateway = Gateway(
            store,
            Keyring(admin_token, bytes.fromhex(secret)),
            proxy,
            admission,
            limit,
            config.max_events_per_post,
        )
        holder["gateway"] = gateway
        sweeper = asyncio.create_task(gateway.sweep_timeouts(config.sweep_interval_s))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await admission.stop()
            await upstream.close()
            await store.close()

    docs = config.api_docs
    app = FastAPI(
        title="agl gateway",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    schema = OpenApiExtras()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = document.setdefault("components", {}).setdefault("schemas", {})
            components.update(schema.definitions)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def gw() -> Gateway:
        return holder["gateway"]

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, error: ApiError) -> Response:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> Response:
        return error_response(422, describe(list(error.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> Response:
        message = _ROUTING_ERRORS.get(error.status_code, "{detail}").format(
            detail=error.detail, method=request.method, path=request.url.path
        )
        return error_response(error.status_code, message, headers=error.headers)

    @app.exception_handler(Exception)
    async def on_unhandled_error(request: Request, error: Exception) -> Response:
        # Starlette logs the traceback after this answer; the client gets no traceback.
        return error_response(500, INTERNAL_ERROR)

    app.include_router(api_router(gw, schema))

    sessions = Sessions(admin_token, lifetime_s=config.ui_session_hours * 3600)
    folder = ui.find_run_folder(config.run_dir, config.ui_run)
    app.include_router(ui.router(lambda: gw().store, lambda: gw().keyring, sessions, folder))

    fast_lane = FastLane(app, gateway=lambda: holder["gateway"])
    limited = BodyLimit(
        fast_lane,
        max_bytes=int(config.max_body_mb * 2**20),
        budget_bytes=int(config.max_buffered_mb * 2**20),
    )
    delayed = RefusalDelay(limited, delay_s=config.refusal_delay_s)
    return BodyTimeout(delayed, timeout_s=config.body_timeout_s)
