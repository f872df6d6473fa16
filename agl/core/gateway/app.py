"""The API Gateway: rollout API, recording proxy and admission gate (DESIGN.md, "Gateway API").

Routes parse bodies with the pydantic records themselves and answer with orjson, so a
bad input always meets one readable 4xx (never FastAPI's default 500 path) and large
event payloads are not walked twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import from_json
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agl import ui
from agl.core.contracts.queries import (
    HISTORY_SINCE,
    EventQuery,
    RolloutQuery,
    RolloutRow,
    SortKey,
    SummaryQuery,
    Transition,
)
from agl.core.contracts.records import (
    TERMINAL,
    Admission,
    AdmissionIn,
    EventIn,
    Mode,
    ModelEndpoint,
    Rollout,
    RolloutSpec,
    Status,
    StatusPatch,
)
from agl.core.gateway.admission import AdmissionGate
from agl.core.gateway.auth import Keyring, Principal, bearer
from agl.core.gateway.connections import BodyTimeout, RefusalDelay
from agl.core.gateway.dialects import ANTHROPIC, RESPONSES, Dialect
from agl.core.gateway.errors import ApiError, error_response
from agl.core.gateway.proxy import PROXY_EVENT_TYPES, RecordingProxy, dialect_error
from agl.core.gateway.query import query_int, whole_number
from agl.core.gateway.store import open_store
from agl.core.gateway.store.base import NotFound, Store
from agl.core.gateway.store.lifecycle import IllegalTransition
from agl.core.gateway.upstream import RetryPolicy, Upstream
from agl.core.run.cli import check_port
from agl.ui.session import Sessions

log = logging.getLogger(__name__)

MAX_PAGE = 1000
MAX_EVENT_PAGE = 10_000

INTERNAL_ERROR = "internal error; see the gateway log"
# What Starlette's own refusals (no such route, a method the route lacks) say.
_ROUTING_ERRORS = {404: "no route {method} {path}", 405: "method {method} is not allowed on {path}"}


MIN_SECRET_CHARS = 16


@dataclass
class GatewayConfig:
    """Options of ``python -m agl.gateway key=value ...``.

    ``host`` is loopback unless told otherwise. Binding anything else (``0.0.0.0``,
    ``::``, a LAN address, a host name other than ``localhost``) needs *a secret
    configured*: an admin token given explicitly, by ``AGL_ADMIN_TOKEN`` or by
    ``admin_token_file`` (say a mounted Secret), of at least 16 characters. The token
    the gateway makes for itself in ``run_dir/admin_token`` is fine on loopback, but
    nobody chose it for a network, so it does not count. The attempt keys' signing
    secret needs no setting: it is 32 random bytes made once and kept in the store (the
    same store, the same keys after a restart), never derived from the admin token.

    ``attempt_rps`` / ``attempt_burst``: a token bucket per attempt key over everything
    that key can call (proxy, events, reading its rollout, finishing its attempt); a call
    over it gets 429 with ``Retry-After``. ``attempt_rps=0`` turns the limit off. The
    admin token is never limited. An event batch counts as its number of events, and
    one POST holds at most ``max_events_per_post`` of them (413 past it, nothing stored),
    so no request holds the event loop for long.

    ``header_timeout_s`` / ``body_timeout_s``: a request whose headers are not all in
    that long after its first byte (or the connection's opening), or whose body goes that
    long without a byte while the gateway reads it, gets 408 and its connection closed
    (:mod:`agl.core.gateway.connections`). ``refusal_delay_s``: how late a 401, 403, 413 or 429
    is answered (0: at once), so that refusals cost a client time, not the gateway CPU.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    run_dir: str = "runs/gateway"
    store: str = ""  # a store URL; default: run_dir/gateway.db
    max_body_mb: float = 32.0
    # All request bodies in flight together (BodyLimit): past it a chunk gets 503.
    max_buffered_mb: float = 256.0
    upstream_retries: int = 3
    upstream_backoff_s: float = 0.1
    upstream_timeout_s: float = 600.0
    sweep_interval_s: float = 1.0
    fsync: bool = False  # also survive power loss, not only kill -9 (an fsync per commit)
    access_log: bool = False
    log_level: str = "info"
    admin_token_file: str = ""  # read the admin token from this file instead
    attempt_rps: float = 50.0  # calls per second per attempt key, sustained (0: no limit)
    attempt_burst: int = 100  # calls per attempt key above the rate before 429s start
    max_events_per_post: int = 1000
    # The run folder the viewer (/ui) reads: config (merge, advantage, tokenizer) and
    # agent logs. Default: run_dir's parent when it holds a config.yaml.
    ui_run: str = ""
    ui_session_hours: float = 12.0  # a viewer login lasts this long (then log in again)
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # A refusal (401, 403, 413, 429) is answered this late (agl/core/gateway/connections.py,
    # RefusalDelay): a client looping on refusals waits instead of taking the CPU.
    refusal_delay_s: float = 1.0
    # FastAPI's /docs and /redoc: off by default, because they load Swagger UI's and
    # ReDoc's scripts from a CDN onto the gateway's origin. /openapi.json is always served.
    api_docs: bool = False

    def __post_init__(self) -> None:
        check_port(self.port)
        for name in ("ui_session_hours", "header_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.refusal_delay_s < 0:
            raise ValueError(f"refusal_delay_s={self.refusal_delay_s} must be 0 (off) or more")
        if self.max_body_mb <= 0:
            raise ValueError(f"max_body_mb={self.max_body_mb} must be positive")
        if self.max_buffered_mb < self.max_body_mb:
            raise ValueError(
                f"max_buffered_mb={self.max_buffered_mb} must be at least max_body_mb "
                f"({self.max_body_mb}): one body must fit"
            )
        if self.attempt_rps < 0:
            raise ValueError(f"attempt_rps={self.attempt_rps} must be 0 (no limit) or positive")
        if self.attempt_burst < 1:
            raise ValueError(f"attempt_burst={self.attempt_burst} must be at least 1")
        if self.max_events_per_post < 1:
            raise ValueError(f"max_events_per_post={self.max_events_per_post} must be at least 1")

    @property
    def store_url(self) -> str:
        return self.store or str(Path(self.run_dir) / "gateway.db")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the gateway on this machine. A host name other than
    ``localhost`` is not trusted to resolve to loopback."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_refusal(config: GatewayConfig, token_source: str, token: str) -> str | None:
    """Why the gateway must not start on ``config.host`` with this admin token, or None."""
    if is_loopback(config.host):
        return None
    if token_source not in ("AGL_ADMIN_TOKEN", "admin_token_file"):
        return (
            f"refusing to listen on {config.host} (not loopback) without a secret configured: "
            "set AGL_ADMIN_TOKEN or admin_token_file=PATH (e.g. `openssl rand -hex 32`), "
            "or keep host=127.0.0.1"
        )
    if len(token) < MIN_SECRET_CHARS:
        return (
            f"refusing to listen on {config.host} (not loopback): the admin token from "
            f"{token_source} has {len(token)} characters, fewer than {MIN_SECRET_CHARS} "
            "(make one with `openssl rand -hex 32`)"
        )
    return None


class AttemptRateLimit:
    """A token bucket per attempt: ``burst`` tokens at once, then ``rate`` a second.

    A call is admitted while its bucket holds a token and spends one; an event batch then
    spends one more per further event (``charge``), which may leave the bucket in debt:
    a batch at the events cap still passes, and the attempt's next calls wait until the
    debt is paid back, so events, not requests, are what the rate bounds.

    Buckets live in least-recently-used order; one idle long enough to have refilled
    (``burst / rate`` seconds, 2 s by default, longer for one in debt) is the same as no
    bucket and is dropped on the next call, so memory follows the attempts active in the
    last few seconds, with ``max_buckets`` as a hard cap under a flood of distinct
    attempts. A finished attempt's bucket simply expires that way."""

    def __init__(
        self,
        rate: float,
        burst: int,
        max_buckets: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_buckets = max_buckets
        self.clock = clock
        self._buckets: OrderedDict[tuple[str, int], tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: tuple[str, int]) -> float:
        """Spend one token of ``key``'s bucket: 0.0 if the call is admitted, else the
        seconds until it would be."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        tokens = self._tokens(key, now)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        return wait

    def charge(self, key: tuple[str, int], cost: float) -> None:
        """Spend ``cost`` more tokens of an admitted call, into debt if need be."""
        if self.rate <= 0 or cost <= 0:
            return
        now = self.clock()
        self._buckets[key] = (self._tokens(key, now) - cost, now)

    def _tokens(self, key: tuple[str, int], now: float) -> float:
        """What ``key``'s bucket holds now, taken out of the LRU order to be put back."""
        bucket = self._buckets.pop(key, None)
        self._expire(now)
        if bucket is None:
            return self.burst
        return min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)

    def _expire(self, now: float) -> None:
        """Drop the buckets that have refilled, oldest first, and make room for one."""
        buckets = self._buckets
        while buckets:
            key, (tokens, last) = next(iter(buckets.items()))
            refilled = now - last >= (self.burst - min(tokens, 0.0)) / self.rate
            if not refilled and len(buckets) < self.max_buckets:
                return
            del buckets[key]


class RateLimited(ApiError):
    """429 with ``Retry-After`` (whole seconds, as HTTP has it) and ``retry-after-ms``
    (which the openai client prefers), OpenAI's ``rate_limit_error`` type."""

    def __init__(self, message: str, wait_s: float) -> None:
        super().__init__(
            429,
            message,
            code="rate_limit_exceeded",
            headers={
                "Retry-After": str(max(1, math.ceil(wait_s))),
                "retry-after-ms": str(max(1, math.ceil(wait_s * 1000))),
            },
            retry_after_s=round(wait_s, 3),
        )
        self.wait_s = wait_s


_SPECS = TypeAdapter(list[RolloutSpec])
_PATCH = TypeAdapter(StatusPatch)
_EVENTS = TypeAdapter(EventIn | list[EventIn])
_MODELS = TypeAdapter(list[ModelEndpoint])
_ADMISSION = TypeAdapter(AdmissionIn)

# Integer query parameters, as SQLite binds them (a larger one was a 500, not a 4xx).
_Int64 = query_int()
_Attempt = query_int(ge=1)
_Offset = query_int(ge=0)
_SummaryLimit = query_int(ge=0, le=MAX_PAGE)


class _SummaryParams(BaseModel):
    """The query string of ``GET /api/summaries``, read by hand (a bad value is a 400 in
    the gateway's error shape) and declared in the OpenAPI document from this model."""

    model_config = ConfigDict(extra="ignore")

    status: str | None = Field(default=None, description="comma list; may also repeat")
    mode: Mode | None = None
    group_id: str | None = None
    step: _Int64 | None = Field(
        default=None,
        description="metadata.step (validation), else metadata.batch + 1 (training)",
    )
    min_reward: float | None = Field(default=None, allow_inf_nan=False)
    max_reward: float | None = Field(default=None, allow_inf_nan=False)
    sort: SortKey = SortKey.CREATED
    desc: bool = False
    offset: _Offset = 0
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


T = TypeVar("T")


def _parse(adapter: TypeAdapter[T], body: bytes) -> T:
    if not body:
        raise ApiError(400, "request body is empty; it must be JSON")
    try:
        return adapter.validate_json(body)
    except ValidationError as error:
        raise ApiError(422, _describe(error.errors())) from None


def _parse_events(body: bytes, cap: int) -> EventIn | list[EventIn]:
    """An events body, counted before it is validated: validating and storing 100,000
    events held the event loop, and so every other call, for seconds."""
    try:
        parsed = from_json(body, allow_inf_nan=False)
    except ValueError:
        return _parse(_EVENTS, body)  # which says what is wrong with it, as for any body
    if isinstance(parsed, list) and len(parsed) > cap:
        raise ApiError(
            413,
            f"{len(parsed)} events in one POST, over the limit of {cap} "
            "(max_events_per_post): send them in smaller batches",
        )
    try:
        return _EVENTS.validate_python(parsed)
    except ValidationError as error:
        raise ApiError(422, _describe(error.errors())) from None


def _describe(errors: list[Any]) -> str:
    parts = []
    for e in errors[:5]:
        where = ".".join(str(p) for p in e.get("loc", ())) or "body"
        parts.append(f"{where}: {e.get('msg')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more


def _json(payload: Any, status: int = 200) -> Response:
    return Response(
        orjson.dumps(payload, default=_plain), status_code=status, media_type="application/json"
    )


def _plain(value: Any) -> Any:
    if hasattr(value, "__dict__"):
        return vars(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


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


ADMISSION_META = "admission"  # the gate's last requested state, restored at start
PROXY = "/proxy/rollout/{rollout_id}/attempt/{attempt}/mode/{mode}"
PROXY_CHAT = PROXY + "/openai/v1/chat/completions"
PROXY_COMPLETIONS = PROXY + "/openai/v1/completions"
PROXY_RESPONSES = PROXY + "/openai/v1/responses"
PROXY_MESSAGES = PROXY + "/anthropic/v1/messages"
PROXY_COUNT_TOKENS = PROXY_MESSAGES + "/count_tokens"
EVENTS = "/api/rollouts/{rollout_id}/attempt/{attempt}/events"
# The API a harness speaks, by the proxy path's tail: None is chat completions itself.
DIALECTS: dict[str, Dialect | None] = {
    "openai/v1/chat/completions": None,
    "openai/v1/responses": RESPONSES,
    "anthropic/v1/messages": ANTHROPIC,
}
COMPLETIONS_TAIL = "openai/v1/completions"  # text completions: no dialect, its own handler
_PROXY_CALL = re.compile(
    r"^/proxy/rollout/([^/]+)/attempt/(\d+)/mode/([^/]+)/("
    + "|".join(re.escape(tail) for tail in [*DIALECTS, COMPLETIONS_TAIL])
    + ")$"
)
_EVENTS_PATH = re.compile(r"^/api/rollouts/([^/]+)/attempt/(\d+)/events$")


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
            if match := _PROXY_CALL.match(path):
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
            if match := _EVENTS_PATH.match(path):
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


def reporter(principal: Principal) -> None:
    """Refuse a model key where the report key is needed: the model's tools hold the
    model key (it is the agent's ``OPENAI_API_KEY``), so it must not set the reward."""
    if not principal.reports:
        raise ApiError(
            403,
            "this is the attempt's model key: it calls the model only; events, the "
            "attempt's status and the rollout need its report key (agl.agent holds it)",
        )


class Gateway:
    """State shared by the routes: store, keys, proxy, admission gate."""

    def __init__(
        self,
        store: Store,
        keyring: Keyring,
        proxy: RecordingProxy,
        limit: AttemptRateLimit | None = None,
        max_events: int = GatewayConfig.max_events_per_post,
    ) -> None:
        self.store = store
        self.keyring = keyring
        self.proxy = proxy
        self.gate = proxy.gate
        self.limit = AttemptRateLimit(0.0, 1) if limit is None else limit  # it has a len()
        self.max_events = max_events

    # -- auth ----------------------------------------------------------------------

    def principal(self, request: Request) -> Principal:
        # OpenAI SDKs send "Authorization: Bearer", Anthropic's "x-api-key", Azure's "api-key".
        token = (
            bearer(request.headers.get("authorization"))
            or request.headers.get("x-api-key")
            or request.headers.get("api-key")
        )
        if not token:
            raise ApiError(
                401, "missing key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
            )
        principal = self.keyring.identify(token)
        if principal is None:
            raise ApiError(401, "invalid token")
        if not principal.admin:
            assert principal.rollout_id is not None and principal.attempt is not None
            wait = self.limit.take((principal.rollout_id, principal.attempt))
            if wait:
                raise RateLimited(
                    f"too many calls from the key of rollout {principal.rollout_id!r} attempt "
                    f"{principal.attempt} (limit {self.limit.rate:g}/s, burst "
                    f"{self.limit.burst:g}); retry in {wait:.2f} s",
                    wait,
                )
        return principal

    def admin(self, request: Request) -> None:
        if not self.principal(request).admin:
            raise ApiError(403, "this endpoint needs the admin token")

    def for_attempt(
        self, request: Request, rollout_id: str, attempt: int, *, report: bool = True
    ) -> Principal:
        """The principal, if it may act for the attempt: with its report key (or the
        admin token), or with its model key where ``report`` is False (the proxy)."""
        principal = self.principal(request)
        if not principal.may_act_for(rollout_id, attempt):
            raise ApiError(
                403, f"this key is not valid for rollout {rollout_id!r} attempt {attempt}"
            )
        if report:
            reporter(principal)
        return principal

    async def readable(self, request: Request, rollout_id: str) -> tuple[Principal, Rollout]:
        """The request's principal and the rollout, if it may read it: the admin any
        rollout, an attempt's report key its own while its attempt is the current one. A key is
        refused before the lookup, so that another rollout answers the same 403 whether it
        exists or not: no key can learn which rollouts there are."""
        principal = self.principal(request)
        if not principal.admin and principal.rollout_id != rollout_id:
            raise ApiError(403, f"this key is not valid for rollout {rollout_id!r}")
        reporter(principal)
        rollout = await self.rollout(rollout_id)
        if not principal.may_act_for(rollout_id, rollout.attempt):
            raise ApiError(
                403,
                f"this key's attempt {principal.attempt} of rollout {rollout_id!r} is over "
                f"(the rollout is at attempt {rollout.attempt})",
            )
        return principal, rollout

    # -- records -------------------------------------------------------------------

    def rollout_json(self, rollout: Rollout, admin: bool) -> dict[str, Any]:
        record = vars(rollout).copy()
        record["attempt_key"] = record["report_key"] = None
        if admin:
            record["attempt_key"] = self.keyring.attempt_key(rollout.rollout_id, rollout.attempt)
            record["report_key"] = self.keyring.report_key(rollout.rollout_id, rollout.attempt)
        return record

    async def rollout(self, rollout_id: str) -> Rollout:
        rollout = await self.store.get_rollout(rollout_id)
        if rollout is None:
            raise ApiError(404, f"rollout {rollout_id!r} does not exist")
        return rollout

    async def live_attempt(self, rollout_id: str, attempt: int, principal: Principal) -> Rollout:
        """The rollout, if ``attempt`` may still act: agents only on their current, running
        attempt; the admin on any attempt that exists."""
        rollout = await self.rollout(rollout_id)
        if attempt > rollout.attempt:
            raise ApiError(
                404, f"rollout {rollout_id!r} has no attempt {attempt} (current: {rollout.attempt})"
            )
        if not principal.admin and (
            attempt != rollout.attempt or rollout.status is not Status.RUNNING
        ):
            raise ApiError(
                409,
                f"attempt {attempt} of rollout {rollout_id!r} is not running "
                f"(rollout is at attempt {rollout.attempt}, {rollout.status})",
                current=self.rollout_json(rollout, admin=False),
            )
        return rollout

    async def patch(self, rollout_id: str, patch: StatusPatch, admin: bool) -> Response:
        try:
            rollout = await self.store.patch_rollout(rollout_id, patch, time.time())
        except NotFound as error:
            raise ApiError(404, str(error)) from None
        except IllegalTransition as error:
            raise ApiError(
                409, str(error), current=self.rollout_json(error.current, admin)
            ) from None
        return _json(self.rollout_json(rollout, admin))

    # -- the hot routes (also served by FastLane) -----------------------------------

    async def proxy_call(
        self,
        request: Request,
        rollout_id: str,
        attempt: int,
        mode: str,
        dialect: Dialect | None = None,
    ) -> Response:
        """A harness's model call, in chat completions or in another API (``dialect``),
        whose errors then come in that API's shape."""
        try:
            await self._check_live(request, rollout_id, attempt, mode)
            return await self.proxy.chat(rollout_id, attempt, mode, await request.body(), dialect)
        except ApiError as error:
            if dialect is None:
                raise
            return dialect_error(dialect, error)

    async def proxy_completions(
        self, request: Request, rollout_id: str, attempt: int, mode: str
    ) -> Response:
        """A harness's text completion (``/v1/completions``); errors in OpenAI's shape."""
        await self._check_live(request, rollout_id, attempt, mode)
        return await self.proxy.completions(rollout_id, attempt, mode, await request.body())

    async def count_tokens(
        self, request: Request, rollout_id: str, attempt: int, mode: str
    ) -> Response:
        """Anthropic's ``count_tokens``: the prompt's length in the rollout's endpoint's
        tokens. Nothing is sampled, so nothing is recorded."""
        try:
            await self._check_live(request, rollout_id, attempt, mode)
            return await self.proxy.count_tokens(rollout_id, await request.body())
        except ApiError as error:
            return dialect_error(ANTHROPIC, error)

    async def _check_live(self, request: Request, rollout_id: str, attempt: int, mode: str) -> None:
        principal = self.for_attempt(request, rollout_id, attempt, report=False)
        rollout = await self.rollout(rollout_id)
        if rollout.status is not Status.RUNNING or attempt != rollout.attempt:
            raise ApiError(
                409,
                f"attempt {attempt} of rollout {rollout_id!r} is not running "
                f"(rollout is at attempt {rollout.attempt}, {rollout.status})",
                current=self.rollout_json(rollout, principal.admin),
            )
        if mode != rollout.mode:
            raise ApiError(
                400, f"mode {mode!r} in the path does not match the rollout's mode {rollout.mode!r}"
            )

    async def post_events(self, request: Request, rollout_id: str, attempt: int) -> Response:
        principal = self.for_attempt(request, rollout_id, attempt)
        body = _parse_events(await request.body(), self.max_events)
        batch = body if isinstance(body, list) else [body]
        if not principal.admin:
            self.limit.charge((rollout_id, attempt), len(batch) - 1)  # the call took one
        await self.live_attempt(rollout_id, attempt, principal)
        if not principal.admin and (forged := {e.type for e in batch} & PROXY_EVENT_TYPES):
            # The trainer trains on these: only the proxy, which saw the model answer,
            # writes them. An agent posting one would be forging tokens and logprobs.
            raise ApiError(403, f"event type {sorted(forged)[0]!r} is written by the proxy only")
        events = await self.store.append_events(rollout_id, attempt, batch, time.time())
        return _json(events if isinstance(body, list) else events[0])

    async def sweep_timeouts(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                for r in await self.store.expire_running(time.time(), "attempt timed out"):
                    log.info(
                        "rollout %s attempt %d timed out after %.1f s",
                        r.rollout_id,
                        r.attempt,
                        r.timeout_s or 0.0,
                    )
            except Exception:
                log.exception("timeout sweep failed; retrying next interval")


def create_app(config: GatewayConfig, admin_token: str) -> ASGIApp:
    """The gateway as an ASGI app: FastAPI for the API, with the body timeout, the body
    limit and the fast lane in front of it (outside FastAPI's own middleware, which the
    hot routes skip)."""
    holder: dict[str, Gateway] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = open_store(config.store_url, fsync=config.fsync)
        secret = await store.set_meta_once("secret", secrets.token_hex(32))
        upstream = Upstream(
            RetryPolicy(config.upstream_retries, config.upstream_backoff_s),
            config.upstream_timeout_s,
        )
        await upstream.start()
        proxy = RecordingProxy(store, upstream, AdmissionGate())
        proxy.router.load(await store.list_models())
        # A gateway restarted while the trainer updates weights keeps calls out until the
        # trainer resumes admission, as the one that died did.
        if await store.get_meta(ADMISSION_META) == "paused":
            await proxy.gate.pause()
        gateway = Gateway(
            store,
            Keyring(admin_token, bytes.fromhex(secret)),
            proxy,
            AttemptRateLimit(config.attempt_rps, config.attempt_burst),
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
            await upstream.close()
            await store.close()

    docs = config.api_docs
    app = FastAPI(
        title="agl gateway",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    definitions: dict[str, Any] = {}  # the request bodies' models, for components.schemas

    def body(adapter: TypeAdapter[Any]) -> dict[str, Any]:
        return _body(adapter, definitions)

    def query(model: type[BaseModel]) -> dict[str, Any]:
        return _query(model, definitions)

    def returns(adapter: TypeAdapter[Any]) -> dict[str, Any]:
        return _returns(adapter, definitions)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def gw() -> Gateway:
        return holder["gateway"]

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, error: ApiError) -> Response:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> Response:
        return error_response(422, _describe(list(error.errors())))

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

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"status": "ok"})

    # -- rollouts ------------------------------------------------------------------

    @app.post("/api/rollouts", openapi_extra=body(_SPECS))
    async def create_rollouts(request: Request) -> Response:
        g = gw()
        g.admin(request)
        specs = _parse(_SPECS, await request.body())
        rollouts = await g.store.create_rollouts(specs, time.time())
        return _json([g.rollout_json(r, admin=True) for r in rollouts])

    @app.get("/api/rollouts")
    async def list_rollouts(
        request: Request,
        status: str | None = None,
        mode: str | None = None,
        group_id: str | None = None,
        cursor: str | None = None,
        limit: _Int64 = 100,
    ) -> Response:
        g = gw()
        g.admin(request)
        statuses = _statuses(request.query_params.getlist("status"))
        if not 1 <= limit <= MAX_PAGE:
            raise ApiError(422, f"limit must be between 1 and {MAX_PAGE}")
        query = RolloutQuery(statuses, mode, group_id, _cursor(cursor), limit)
        rollouts, next_cursor = await g.store.list_rollouts(query)
        return _json(
            {
                "items": [g.rollout_json(r, admin=True) for r in rollouts],
                "next_cursor": None if next_cursor is None else str(next_cursor),
            }
        )

    @app.get("/api/rollouts/{rollout_id}")
    async def get_rollout(request: Request, rollout_id: str) -> Response:
        g = gw()
        principal, rollout = await g.readable(request, rollout_id)
        return _json(g.rollout_json(rollout, principal.admin))

    @app.patch("/api/rollouts/{rollout_id}", openapi_extra=body(_PATCH))
    async def patch_rollout(request: Request, rollout_id: str) -> Response:
        g = gw()
        g.admin(request)
        return await g.patch(rollout_id, _parse(_PATCH, await request.body()), admin=True)

    @app.patch("/api/rollouts/{rollout_id}/attempt/{attempt}", openapi_extra=body(_PATCH))
    async def patch_attempt(request: Request, rollout_id: str, attempt: int) -> Response:
        g = gw()
        principal = g.for_attempt(request, rollout_id, attempt)
        patch = _parse(_PATCH, await request.body())
        if patch.attempt not in (None, attempt):
            raise ApiError(422, f"body names attempt {patch.attempt} but the path {attempt}")
        if not principal.admin and patch.status not in TERMINAL:
            raise ApiError(403, "an agent may only set its attempt to succeeded or failed")
        patch = patch.model_copy(update={"attempt": attempt})
        return await g.patch(rollout_id, patch, principal.admin)

    # -- events --------------------------------------------------------------------

    @app.get("/api/rollouts/{rollout_id}/events")
    async def get_events(
        request: Request,
        rollout_id: str,
        attempt: _Attempt | None = None,
        type: str | None = None,
        cursor: str | None = None,
        limit: _Int64 = 1000,
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
        return _json({"items": events, "next_cursor": next_cursor})

    # -- what the viewer reads: summaries and status history ------------------------

    @app.get(
        "/api/summaries",
        openapi_extra={**query(_SummaryParams), **returns(TypeAdapter(_SummaryPage))},
    )
    async def get_summaries(request: Request) -> Response:
        g = gw()
        g.admin(request)
        rows, total = await g.store.query_rollouts(_summary_query(request))
        items = [
            {"rollout": g.rollout_json(row.rollout, admin=True), "summary": row.summary}
            for row in rows
        ]
        return _json({"total": total, "items": items})

    @app.get("/api/rollouts/{rollout_id}/transitions", openapi_extra=returns(TypeAdapter(_History)))
    async def get_transitions(request: Request, rollout_id: str) -> Response:
        g = gw()
        g.admin(request)
        rollout = await g.rollout(rollout_id)
        since = await g.store.get_meta(HISTORY_SINCE)
        complete = since is None or rollout.created_at >= float(since)
        return _json({"items": await g.store.transitions(rollout_id), "complete": complete})

    # -- models and admission ------------------------------------------------------

    @app.post("/api/models", openapi_extra=body(_MODELS))
    async def post_models(request: Request) -> Response:
        g = gw()
        g.admin(request)
        await g.store.put_models(_parse(_MODELS, await request.body()))
        models = await g.store.list_models()
        g.proxy.router.load(models)
        return _json([m.model_dump() for m in models])

    @app.get("/api/models")
    async def get_models(request: Request) -> Response:
        g = gw()
        g.admin(request)
        return _json([m.model_dump() for m in await g.store.list_models()])

    @app.delete("/api/models")
    async def delete_models(request: Request, model: str | None = None) -> Response:
        g = gw()
        g.admin(request)
        deleted = await g.store.delete_models(model)
        g.proxy.router.load(await g.store.list_models())
        return _json({"deleted": deleted})

    @app.post("/api/admission", openapi_extra=body(_ADMISSION))
    async def post_admission(request: Request) -> Response:
        g = gw()
        g.admin(request)
        wanted = _parse(_ADMISSION, await request.body())
        await g.store.set_meta(ADMISSION_META, wanted.state)
        drained = True
        if wanted.state == "paused":
            drained = await g.gate.pause(wanted.timeout_s)
        else:
            g.gate.resume()
        return _json(_admission(g.gate, drained).model_dump())

    @app.get("/api/admission")
    async def get_admission(request: Request) -> Response:
        g = gw()
        g.admin(request)
        return _json(_admission(g.gate, g.gate.in_flight == 0).model_dump())

    # -- proxy ---------------------------------------------------------------------

    @app.post(PROXY_CHAT)
    async def proxy_chat(request: Request, rollout_id: str, attempt: int, mode: str) -> Response:
        return await gw().proxy_call(request, rollout_id, attempt, mode)

    @app.post(PROXY_COMPLETIONS)
    async def proxy_completions(
        request: Request, rollout_id: str, attempt: int, mode: str
    ) -> Response:
        return await gw().proxy_completions(request, rollout_id, attempt, mode)

    @app.post(PROXY_RESPONSES)
    async def proxy_responses(
        request: Request, rollout_id: str, attempt: int, mode: str
    ) -> Response:
        return await gw().proxy_call(request, rollout_id, attempt, mode, RESPONSES)

    @app.post(PROXY_MESSAGES)
    async def proxy_messages(
        request: Request, rollout_id: str, attempt: int, mode: str
    ) -> Response:
        return await gw().proxy_call(request, rollout_id, attempt, mode, ANTHROPIC)

    @app.post(PROXY_COUNT_TOKENS)
    async def proxy_count_tokens(
        request: Request, rollout_id: str, attempt: int, mode: str
    ) -> Response:
        return await gw().count_tokens(request, rollout_id, attempt, mode)

    @app.post(EVENTS, openapi_extra=body(_EVENTS))
    async def post_events(request: Request, rollout_id: str, attempt: int) -> Response:
        return await gw().post_events(request, rollout_id, attempt)

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


def _admission(gate: AdmissionGate, drained: bool) -> Admission:
    return Admission(
        state="paused" if gate.paused else "running",
        in_flight=gate.in_flight,
        waiting=gate.waiting,
        drained=drained,
    )


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
        raise ApiError(400, _describe(error.errors())) from None
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


def _body(adapter: TypeAdapter[Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """A request body for OpenAPI: the models it refers to go to ``definitions`` (the
    document's ``components.schemas``), where its references point."""
    schema = adapter.json_schema(ref_template="#/components/schemas/{model}")
    definitions.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _query(model: type[BaseModel], definitions: dict[str, Any]) -> dict[str, Any]:
    """A route's query parameters for OpenAPI, from the model its handler reads them with
    (the handler takes none from FastAPI, so FastAPI declares none)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    definitions.update(schema.pop("$defs", {}))
    required = set(schema.get("required", ()))
    parameters = []
    for name, field in schema["properties"].items():
        parameter = {"name": name, "in": "query", "required": name in required, "schema": field}
        if "description" in field:
            parameter["description"] = field["description"]
        parameters.append(parameter)
    return {"parameters": parameters}


def _returns(adapter: TypeAdapter[Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """A route's 200 answer for OpenAPI (the routes answer with orjson, not a model)."""
    schema = adapter.json_schema(ref_template="#/components/schemas/{model}")
    definitions.update(schema.pop("$defs", {}))
    content = {"application/json": {"schema": schema}}
    return {"responses": {"200": {"description": "Successful Response", "content": content}}}
