"""What runs in front of FastAPI, as plain ASGI: the body limit (per request and for all
bodies in flight) and the fast lane for the two hot routes."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agl.core.gateway.paths import COMPLETIONS_TAIL, DIALECTS, EVENTS_PATH, PROXY_CALL
from agl.core.http_errors import ApiError, error_response

if TYPE_CHECKING:
    from agl.core.gateway.service import Gateway

log = logging.getLogger(__name__)

INTERNAL_ERROR = "internal error; see the gateway log"


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` is refused with 413, whether it
    announces its length or streams in chunks; and the bodies of all requests in
    flight together hold at most ``budget_bytes`` (a chunk past it: 503 with
    Retry-After), so that many big uploads at once cannot pin the gateway's memory,
    each one within its own limit (100 streamed 33 MiB bodies once took it to 3.2 GiB)."""

    def __init__(self, app: ASGIApp, max_bytes: int, budget_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.budget_bytes = budget_bytes
        self.held = 0  # body bytes received by requests not yet answered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await error_response(413, self._message())(scope, receive, send)
                return
        seen = 0
        answered = False

        async def released_send(message: Message) -> None:
            # Answered: what the body held is let go now, not when the app returns (a
            # refusal's answer may be held back a while: RefusalDelay).
            nonlocal seen, answered
            if message["type"] == "http.response.start" and not answered:
                answered = True
                self.held -= seen
                seen = 0
            await send(message)

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            size = len(message.get("body", b""))
            if seen + size > self.max_bytes:
                raise ApiError(413, self._message())
            if self.budget_bytes is not None and self.held + size > self.budget_bytes:
                raise ApiError(
                    503,
                    f"the gateway holds {self.held} bytes of request bodies in flight, its "
                    f"budget is {self.budget_bytes} (max_buffered_mb); retry shortly",
                    type="server_busy",
                    headers={"Retry-After": "1"},
                )
            if not answered:
                seen += size
                self.held += size
            return message

        try:
            await self.app(scope, limited, released_send)
        finally:
            self.held -= seen

    def _message(self) -> str:
        return f"request body is larger than the limit of {self.max_bytes} bytes"


class FastLane:
    """ASGI: serves the two hot routes, proxied chat calls and event POSTs, ahead of
    FastAPI's middleware and dependency machinery, which costs about as much CPU per call
    as the proxy's own work. Anything else, including a hot path that does not parse
    (say a non-numeric attempt), goes on to FastAPI, where the same handlers are
    declared for the OpenAPI schema and the error messages."""

    def __init__(self, app: ASGIApp, gateway: Callable[[], Gateway]) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if match := PROXY_CALL.match(path):
                rollout_id, attempt, mode, tail = match.groups()
                await self._serve(
                    scope,
                    receive,
                    send,
                    lambda request: (
                        self.gateway().proxy_completions(request, rollout_id, int(attempt), mode)
                        if tail == COMPLETIONS_TAIL
                        else self.gateway().proxy_call(
                            request, rollout_id, int(attempt), mode, DIALECTS[tail]
                        )
                    ),
                )
                return
            if match := EVENTS_PATH.match(path):
                rollout_id, attempt = match.groups()
                await self._serve(
                    scope,
                    receive,
                    send,
                    lambda request: self.gateway().post_events(request, rollout_id, int(attempt)),
                )
                return
        await self.app(scope, receive, send)

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        handler: Callable[[Request], Awaitable[Response]],
    ) -> None:
        try:
            response = await handler(Request(scope, receive))
        except ApiError as error:
            response = error.response()
        except ClientDisconnect:
            # The client went away mid-body: no one to answer, nothing was done.
            log.info("client left during its request body on %s", scope["path"])
            return
        except Exception:
            log.exception("unhandled error on %s", scope["path"])
            response = error_response(500, INTERNAL_ERROR)
        await response(scope, receive, send)
