"""The gateway's state and what every route shares: the store, the keys, the recording
proxy and its admission gate, the rate limit; who a request is and what it may do; the
hot routes' handlers (the fast lane and FastAPI both call them)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import Request
from starlette.responses import Response

from agl.core.contracts.execution import AGENT_LOG_EVENT, AGENT_LOG_EVENT_ID
from agl.core.contracts.records import Rollout, Status, StatusPatch
from agl.core.gateway.auth import Keyring, Principal, bearer
from agl.core.gateway.config import GatewayConfig
from agl.core.gateway.dialects import ANTHROPIC, Dialect
from agl.core.gateway.proxy import PROXY_EVENT_TYPES, RecordingProxy, dialect_error
from agl.core.gateway.ratelimit import AttemptRateLimit, RateLimit, RateLimited
from agl.core.gateway.replicas import ReplicaGroup, Solo
from agl.core.gateway.store.base import NotFound, Store
from agl.core.gateway.store.lifecycle import IllegalTransition
from agl.core.gateway.wire import json_response, parse_events
from agl.core.http_errors import ApiError

log = logging.getLogger(__name__)


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
    """State shared by the routes: store, keys, proxy, admission (this process's gate,
    alone or in step with the replicas sharing the store), rate limit."""

    def __init__(
        self,
        store: Store,
        keyring: Keyring,
        proxy: RecordingProxy,
        admission: Solo | ReplicaGroup,
        limit: RateLimit | None = None,
        max_events: int = GatewayConfig.max_events_per_post,
    ) -> None:
        self.store = store
        self.keyring = keyring
        self.proxy = proxy
        self.admission = admission
        self.limit = AttemptRateLimit(0.0, 1) if limit is None else limit
        self.max_events = max_events

    # -- auth ----------------------------------------------------------------------

    async def principal(self, request: Request) -> Principal:
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
            wait = await self.limit.admit((principal.rollout_id, principal.attempt))
            if wait:
                raise RateLimited(
                    f"too many calls from the key of rollout {principal.rollout_id!r} attempt "
                    f"{principal.attempt} (limit {self.limit.rate:g}/s, burst "
                    f"{self.limit.burst:g}); retry in {wait:.2f} s",
                    wait,
                )
        return principal

    async def admin(self, request: Request) -> None:
        if not (await self.principal(request)).admin:
            raise ApiError(403, "this endpoint needs the admin token")

    async def for_attempt(
        self, request: Request, rollout_id: str, attempt: int, *, report: bool = True
    ) -> Principal:
        """The principal, if it may act for the attempt: with its report key (or the
        admin token), or with its model key where ``report`` is False (the proxy)."""
        principal = await self.principal(request)
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
        principal = await self.principal(request)
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

    def rolloutjson_response(self, rollout: Rollout, admin: bool) -> dict[str, Any]:
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
                current=self.rolloutjson_response(rollout, admin=False),
            )
        return rollout

    async def patch(self, rollout_id: str, patch: StatusPatch, admin: bool) -> Response:
        try:
            rollout = await self.store.patch_rollout(rollout_id, patch, time.time())
        except NotFound as error:
            raise ApiError(404, str(error)) from None
        except IllegalTransition as error:
            raise ApiError(
                409, str(error), current=self.rolloutjson_response(error.current, admin)
            ) from None
        if rollout.status is not Status.RUNNING:
            self.proxy.forget(rollout_id)  # its endpoint's load drops, its calls' cache
        return json_response(self.rolloutjson_response(rollout, admin))

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
        principal = await self.for_attempt(request, rollout_id, attempt, report=False)
        rollout = await self.rollout(rollout_id)
        if rollout.status is not Status.RUNNING or attempt != rollout.attempt:
            raise ApiError(
                409,
                f"attempt {attempt} of rollout {rollout_id!r} is not running "
                f"(rollout is at attempt {rollout.attempt}, {rollout.status})",
                current=self.rolloutjson_response(rollout, principal.admin),
            )
        if mode != rollout.mode:
            raise ApiError(
                400, f"mode {mode!r} in the path does not match the rollout's mode {rollout.mode!r}"
            )

    async def post_events(self, request: Request, rollout_id: str, attempt: int) -> Response:
        principal = await self.for_attempt(request, rollout_id, attempt)
        body = parse_events(await request.body(), self.max_events)
        batch = body if isinstance(body, list) else [body]
        if not principal.admin and len(batch) > 1:
            await self.limit.spend((rollout_id, attempt), len(batch) - 1)  # the call took one
        await self.live_attempt(rollout_id, attempt, principal)
        if not principal.admin and (forged := {e.type for e in batch} & PROXY_EVENT_TYPES):
            # The trainer trains on these: only the proxy, which saw the model answer,
            # writes them. An agent posting one would be forging tokens and logprobs.
            raise ApiError(403, f"event type {sorted(forged)[0]!r} is written by the proxy only")
        if not principal.admin and any(
            e.type == AGENT_LOG_EVENT or e.event_id == AGENT_LOG_EVENT_ID for e in batch
        ):
            # What the pod printed, as its controller read it: an agent's own version, or
            # one taking its id first (a repeat is ignored), would hide the real one.
            raise ApiError(403, f"event {AGENT_LOG_EVENT!r} is written by the controller only")
        events = await self.store.append_events(rollout_id, attempt, batch, time.time())
        return json_response(events if isinstance(body, list) else events[0])

    async def sweep_timeouts(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                for r in await self.store.expire_running(time.time(), "attempt timed out"):
                    self.proxy.forget(r.rollout_id)
                    log.info(
                        "rollout %s attempt %d timed out after %.1f s",
                        r.rollout_id,
                        r.attempt,
                        r.timeout_s or 0.0,
                    )
            except Exception:
                log.exception("timeout sweep failed; retrying next interval")
