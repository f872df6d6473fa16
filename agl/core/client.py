"""A small typed client of the gateway, for the trainer, the controller and agents.

Every call is retried on connection errors and 5xx with exponential backoff, and on 429
(the gateway's per-attempt rate limit, which refuses a call before doing anything) after
the wait its ``Retry-After`` asks for. That is safe because each endpoint is idempotent,
and events get their ``event_id`` here, before the first try, so a retried POST appends
once.

``GatewayClient`` is synchronous, ``AsyncGatewayClient`` its asyncio twin; both send the
requests described by :class:`_Calls`, so they cannot disagree on the wire format.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx
import orjson
from pydantic import TypeAdapter

from agl.core.contracts.execution import PROXY_BASE_PATH
from agl.core.contracts.queries import RolloutRow, SummaryQuery, Transition
from agl.core.contracts.records import (
    Admission,
    Event,
    EventIn,
    ModelEndpoint,
    Rollout,
    RolloutSpec,
    Status,
    StatusPatch,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 60.0


def server_retry_after(response: httpx.Response) -> float | None:
    """The wait a 429/503 asks for: ``retry-after-ms``, else ``Retry-After`` in seconds
    (an HTTP date is not used), capped at a minute; None when absent or unreadable."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = response.headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            continue
        if seconds >= 0 and math.isfinite(seconds):
            return min(seconds, MAX_RETRY_AFTER_S)
    return None


class GatewayError(Exception):
    """The gateway refused a call; ``status`` and ``message`` are its answer."""

    def __init__(self, status: int, message: str, body: Any) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body

    @property
    def current(self) -> Rollout | None:
        """On a 409, the rollout as the gateway has it."""
        if isinstance(self.body, dict) and isinstance(self.body.get("current"), dict):
            return Rollout.model_validate(self.body["current"])
        return None


@dataclass(frozen=True)
class _Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[Any], T]
    json: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    unbounded_read: bool = False  # a pause waits as long as in-flight calls take


_ROLLOUTS = TypeAdapter(list[Rollout])
_EVENTS = TypeAdapter(list[Event])
_MODELS = TypeAdapter(list[ModelEndpoint])
_ROWS = TypeAdapter(list[RolloutRow])
_TRANSITIONS = TypeAdapter(list[Transition])


def _page(items: TypeAdapter[list[T]]) -> Callable[[Any], tuple[list[T], str | None]]:
    return lambda body: (items.validate_python(body["items"]), body.get("next_cursor"))


class _Calls:
    """The gateway's API as request descriptions; pure, shared by both clients."""

    @staticmethod
    def create_rollouts(specs: Iterable[RolloutSpec | dict[str, Any]]) -> _Call[list[Rollout]]:
        body = [RolloutSpec.model_validate(s).model_dump(mode="json") for s in specs]
        return _Call("POST", "/api/rollouts", _ROLLOUTS.validate_python, json=body)

    @staticmethod
    def get_rollout(rollout_id: str) -> _Call[Rollout]:
        return _Call("GET", f"/api/rollouts/{rollout_id}", Rollout.model_validate)

    @staticmethod
    def list_rollouts(
        status: Status | Sequence[Status] | None,
        mode: str | None,
        group_id: str | None,
        cursor: str | None,
        limit: int,
    ) -> _Call[tuple[list[Rollout], str | None]]:
        statuses = [status] if isinstance(status, str) else list(status or ())
        params = {
            "status": ",".join(statuses) or None,
            "mode": mode,
            "group_id": group_id,
            "cursor": cursor,
            "limit": limit,
        }
        return _Call(
            "GET",
            "/api/rollouts",
            _page(_ROLLOUTS),
            params={k: v for k, v in params.items() if v is not None},
        )

    @staticmethod
    def patch_rollout(rollout_id: str, patch: StatusPatch) -> _Call[Rollout]:
        return _Call(
            "PATCH",
            f"/api/rollouts/{rollout_id}",
            Rollout.model_validate,
            json=patch.model_dump(mode="json", exclude_none=True),
        )

    @staticmethod
    def patch_attempt(rollout_id: str, attempt: int, patch: StatusPatch) -> _Call[Rollout]:
        return _Call(
            "PATCH",
            f"/api/rollouts/{rollout_id}/attempt/{attempt}",
            Rollout.model_validate,
            json=patch.model_dump(mode="json", exclude_none=True),
        )

    @staticmethod
    def post_events(rollout_id: str, attempt: int, events: Sequence[EventIn]) -> _Call[list[Event]]:
        body = [
            {**e.model_dump(mode="json"), "event_id": e.event_id or uuid.uuid4().hex}
            for e in events
        ]
        return _Call(
            "POST",
            f"/api/rollouts/{rollout_id}/attempt/{attempt}/events",
            _EVENTS.validate_python,
            json=body,
        )

    @staticmethod
    def get_events(
        rollout_id: str, attempt: int | None, type: str | None, cursor: str | None
    ) -> _Call[tuple[list[Event], str | None]]:
        params = {"attempt": attempt, "type": type, "cursor": cursor, "limit": 10_000}
        return _Call(
            "GET",
            f"/api/rollouts/{rollout_id}/events",
            _page(_EVENTS),
            params={k: v for k, v in params.items() if v is not None},
        )

    @staticmethod
    def summaries(query: SummaryQuery | None) -> _Call[tuple[list[RolloutRow], int]]:
        query = query or SummaryQuery()
        params = {
            "status": ",".join(sorted(query.statuses)) or None,
            "mode": query.mode,
            "group_id": query.group_id,
            "step": query.step,
            "min_reward": query.min_reward,
            "max_reward": query.max_reward,
            "sort": query.sort.value,
            "desc": "true" if query.descending else "false",
            "offset": query.offset,
            "limit": query.limit,
        }
        return _Call(
            "GET",
            "/api/summaries",
            lambda body: (_ROWS.validate_python(body["items"]), int(body["total"])),
            params={k: v for k, v in params.items() if v is not None},
        )

    @staticmethod
    def transitions(rollout_id: str) -> _Call[tuple[list[Transition], bool]]:
        return _Call(
            "GET",
            f"/api/rollouts/{rollout_id}/transitions",
            lambda body: (_TRANSITIONS.validate_python(body["items"]), bool(body["complete"])),
        )

    @staticmethod
    def register_models(
        models: Iterable[ModelEndpoint | dict[str, Any]],
    ) -> _Call[list[ModelEndpoint]]:
        body = [ModelEndpoint.model_validate(m).model_dump() for m in models]
        return _Call("POST", "/api/models", _MODELS.validate_python, json=body)

    @staticmethod
    def list_models() -> _Call[list[ModelEndpoint]]:
        return _Call("GET", "/api/models", _MODELS.validate_python)

    @staticmethod
    def delete_models(model: str | None) -> _Call[int]:
        params = {} if model is None else {"model": model}
        return _Call("DELETE", "/api/models", lambda body: int(body["deleted"]), params=params)

    @staticmethod
    def set_admission(
        state: str, timeout_s: float | None, client_timeout_s: float
    ) -> _Call[Admission]:
        body = {"state": state, **({} if timeout_s is None else {"timeout_s": timeout_s})}
        return _Call(
            "POST",
            "/api/admission",
            Admission.model_validate,
            json=body,
            timeout_s=None if timeout_s is None else timeout_s + client_timeout_s,
            unbounded_read=state == "paused" and timeout_s is None,
        )

    @staticmethod
    def admission() -> _Call[Admission]:
        return _Call("GET", "/api/admission", Admission.model_validate)


def proxy_base_url(gateway_url: str, rollout_id: str, attempt: int, mode: str = "train") -> str:
    """The OpenAI base URL an agent uses for one attempt (its API key: the attempt key)."""
    path = PROXY_BASE_PATH.format(rollout_id=rollout_id, attempt=attempt, mode=mode)
    return gateway_url.rstrip("/") + path


def fast_http_client(connections: int = 100, timeout_s: float = 600.0) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` on aiohttp's transport: same API (the ``openai`` client
    takes it as ``http_client``), a fraction of the CPU per request. httpx's own pool
    scans every open connection on each request; with hundreds of agents in one process
    that made the agents, not the model, the bottleneck of a training run."""
    from httpx_aiohttp import HttpxAiohttpClient

    return HttpxAiohttpClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


def _reward(value: float) -> EventIn:
    return EventIn(type="reward", data={"value": float(value)})


# Backoff doubles from ``backoff_s`` up to 5 s: 8 tries wait ~12 s in all, longer than a
# gateway takes to come back after a crash (ChildGateway restarts it on its store).
RETRIES = 8


class _Base:
    def __init__(
        self, base_url: str, token: str, timeout_s: float, retries: int, backoff_s: float
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._headers = {"Authorization": f"Bearer {token}"}

    def _timeout(self, call: _Call[Any]) -> httpx.Timeout:
        if call.unbounded_read:
            return httpx.Timeout(self.timeout_s, read=None)
        return httpx.Timeout(call.timeout_s or self.timeout_s)

    def _outcome(self, call: _Call[T], response: httpx.Response) -> T:
        try:
            # orjson: twice as fast as httpx's json.loads on a list page of 256 rollouts,
            # which the trainer reads several times a second while a step runs.
            body = orjson.loads(response.content)
        except orjson.JSONDecodeError:  # not JSON (an empty or plain-text body)
            body = response.text
        if response.is_success:
            return call.parse(body)
        message = body
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = body["error"].get("message", body)
        raise GatewayError(response.status_code, str(message), body)

    def _retry_after(
        self, call: _Call[Any], attempt: int, outcome: httpx.Response | Exception
    ) -> float | None:
        """Seconds to wait before retrying ``call``, or None when ``outcome`` is final."""
        if isinstance(outcome, httpx.Response) and outcome.status_code not in RETRY_STATUSES:
            return None
        if attempt >= self.retries:
            return None
        what = outcome.status_code if isinstance(outcome, httpx.Response) else repr(outcome)
        log.warning("gateway %s %s: %s; retrying", call.method, call.path, what)
        asked = server_retry_after(outcome) if isinstance(outcome, httpx.Response) else None
        if asked is not None:  # the gateway's rate limit says when: wait that, a bit more
            return asked * (1.0 + random.random() / 10)
        return min(self.backoff_s * 2**attempt, 5.0) * (0.5 + random.random() / 2)

    def _request(self, call: _Call[Any]) -> dict[str, Any]:
        return {
            "method": call.method,
            "url": self.base_url + call.path,
            "headers": self._headers,
            "json": call.json,
            "params": call.params,
            "timeout": self._timeout(call),
        }


class GatewayClient(_Base):
    def __init__(
        self,
        base_url: str,
        token: str,
        timeout_s: float = 30.0,
        retries: int = RETRIES,
        backoff_s: float = 0.1,
    ) -> None:
        super().__init__(base_url, token, timeout_s, retries, backoff_s)
        self._http = httpx.Client()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, call: _Call[T]) -> T:
        for attempt in itertools.count():
            try:
                outcome: httpx.Response | Exception = self._http.request(**self._request(call))
            except httpx.TransportError as error:
                outcome = error
            delay = self._retry_after(call, attempt, outcome)
            if delay is None:
                if isinstance(outcome, Exception):
                    raise outcome
                return self._outcome(call, outcome)
            time.sleep(delay)
        raise AssertionError("unreachable")

    def create_rollouts(self, specs: Iterable[RolloutSpec | dict[str, Any]]) -> list[Rollout]:
        return self._send(_Calls.create_rollouts(specs))

    def get_rollout(self, rollout_id: str) -> Rollout:
        return self._send(_Calls.get_rollout(rollout_id))

    def list_rollouts(
        self,
        status: Status | Sequence[Status] | None = None,
        mode: str | None = None,
        group_id: str | None = None,
        page_size: int = 500,
    ) -> list[Rollout]:
        """Every matching rollout, following the cursor to the end."""
        out: list[Rollout] = []
        cursor: str | None = None
        while True:
            page, cursor = self._send(
                _Calls.list_rollouts(status, mode, group_id, cursor, page_size)
            )
            out.extend(page)
            if cursor is None:
                return out

    def patch_rollout(
        self,
        rollout_id: str,
        status: Status | str,
        attempt: int | None = None,
        error: str | None = None,
    ) -> Rollout:
        patch = StatusPatch(status=Status(status), attempt=attempt, error=error)
        return self._send(_Calls.patch_rollout(rollout_id, patch))

    def patch_attempt(
        self, rollout_id: str, attempt: int, status: Status | str, error: str | None = None
    ) -> Rollout:
        patch = StatusPatch(status=Status(status), error=error)
        return self._send(_Calls.patch_attempt(rollout_id, attempt, patch))

    def post_events(self, rollout_id: str, attempt: int, events: Sequence[EventIn]) -> list[Event]:
        return self._send(_Calls.post_events(rollout_id, attempt, events))

    def post_event(
        self, rollout_id: str, attempt: int, type: str, data: Any, event_id: str | None = None
    ) -> Event:
        event = EventIn(event_id=event_id, type=type, data=data)
        return self.post_events(rollout_id, attempt, [event])[0]

    def post_reward(self, rollout_id: str, attempt: int, value: float) -> Event:
        return self.post_events(rollout_id, attempt, [_reward(value)])[0]

    def get_events(
        self, rollout_id: str, attempt: int | None = None, type: str | None = None
    ) -> list[Event]:
        out: list[Event] = []
        cursor: str | None = None
        while True:
            page, cursor = self._send(_Calls.get_events(rollout_id, attempt, type, cursor))
            out.extend(page)
            if cursor is None:
                return out

    def summaries(self, query: SummaryQuery | None = None) -> tuple[list[RolloutRow], int]:
        """One page of rollouts with their current attempt's summary, filtered and sorted
        by the store (``query.limit`` at most 1,000; no query: the first 50 in creation
        order), and how many match in all. Page on with ``query.offset``."""
        return self._send(_Calls.summaries(query))

    def transitions(self, rollout_id: str) -> tuple[list[Transition], bool]:
        """The rollout's status changes in order, and whether the store recorded them all
        (False for a rollout made before it kept them: its creation, start and end are
        then only in its record)."""
        return self._send(_Calls.transitions(rollout_id))

    def register_models(
        self, models: Iterable[ModelEndpoint | dict[str, Any]]
    ) -> list[ModelEndpoint]:
        return self._send(_Calls.register_models(models))

    def list_models(self) -> list[ModelEndpoint]:
        return self._send(_Calls.list_models())

    def delete_models(self, model: str | None = None) -> int:
        return self._send(_Calls.delete_models(model))

    def pause(self, timeout_s: float | None = None) -> Admission:
        """Close the admission gate; returns once in-flight calls are done."""
        return self._send(_Calls.set_admission("paused", timeout_s, self.timeout_s))

    def resume(self) -> Admission:
        return self._send(_Calls.set_admission("running", None, self.timeout_s))

    def admission(self) -> Admission:
        return self._send(_Calls.admission())


class AsyncGatewayClient(_Base):
    def __init__(
        self,
        base_url: str,
        token: str,
        timeout_s: float = 30.0,
        retries: int = RETRIES,
        backoff_s: float = 0.1,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        """``http``: a connection pool to share (the caller closes it). Agents in one
        worker process share one, since a new ``httpx`` client costs ~80 ms of CPU
        (it loads the CA store) and keeps its own connections."""
        super().__init__(base_url, token, timeout_s, retries, backoff_s)
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient()

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncGatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _send(self, call: _Call[T]) -> T:
        for attempt in itertools.count():
            try:
                outcome: httpx.Response | Exception = await self._http.request(
                    **self._request(call)
                )
            except httpx.TransportError as error:
                outcome = error
            delay = self._retry_after(call, attempt, outcome)
            if delay is None:
                if isinstance(outcome, Exception):
                    raise outcome
                return self._outcome(call, outcome)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def create_rollouts(self, specs: Iterable[RolloutSpec | dict[str, Any]]) -> list[Rollout]:
        return await self._send(_Calls.create_rollouts(specs))

    async def get_rollout(self, rollout_id: str) -> Rollout:
        return await self._send(_Calls.get_rollout(rollout_id))

    async def list_rollouts_page(
        self,
        status: Status | Sequence[Status] | None = None,
        mode: str | None = None,
        group_id: str | None = None,
        cursor: str | None = None,
        limit: int = 500,
    ) -> tuple[list[Rollout], str | None]:
        """One page (oldest first) and the cursor of the next, None at the end."""
        return await self._send(_Calls.list_rollouts(status, mode, group_id, cursor, limit))

    async def list_rollouts(
        self,
        status: Status | Sequence[Status] | None = None,
        mode: str | None = None,
        group_id: str | None = None,
        page_size: int = 500,
    ) -> list[Rollout]:
        out: list[Rollout] = []
        cursor: str | None = None
        while True:
            page, cursor = await self._send(
                _Calls.list_rollouts(status, mode, group_id, cursor, page_size)
            )
            out.extend(page)
            if cursor is None:
                return out

    async def patch_rollout(
        self,
        rollout_id: str,
        status: Status | str,
        attempt: int | None = None,
        error: str | None = None,
    ) -> Rollout:
        patch = StatusPatch(status=Status(status), attempt=attempt, error=error)
        return await self._send(_Calls.patch_rollout(rollout_id, patch))

    async def patch_attempt(
        self, rollout_id: str, attempt: int, status: Status | str, error: str | None = None
    ) -> Rollout:
        patch = StatusPatch(status=Status(status), error=error)
        return await self._send(_Calls.patch_attempt(rollout_id, attempt, patch))

    async def post_events(
        self, rollout_id: str, attempt: int, events: Sequence[EventIn]
    ) -> list[Event]:
        return await self._send(_Calls.post_events(rollout_id, attempt, events))

    async def post_reward(self, rollout_id: str, attempt: int, value: float) -> Event:
        return (await self.post_events(rollout_id, attempt, [_reward(value)]))[0]

    async def get_events(
        self, rollout_id: str, attempt: int | None = None, type: str | None = None
    ) -> list[Event]:
        out: list[Event] = []
        cursor: str | None = None
        while True:
            page, cursor = await self._send(_Calls.get_events(rollout_id, attempt, type, cursor))
            out.extend(page)
            if cursor is None:
                return out

    async def summaries(self, query: SummaryQuery | None = None) -> tuple[list[RolloutRow], int]:
        """As :meth:`GatewayClient.summaries`."""
        return await self._send(_Calls.summaries(query))

    async def transitions(self, rollout_id: str) -> tuple[list[Transition], bool]:
        """As :meth:`GatewayClient.transitions`."""
        return await self._send(_Calls.transitions(rollout_id))

    async def register_models(
        self, models: Iterable[ModelEndpoint | dict[str, Any]]
    ) -> list[ModelEndpoint]:
        return await self._send(_Calls.register_models(models))

    async def delete_models(self, model: str | None = None) -> int:
        return await self._send(_Calls.delete_models(model))

    async def pause(self, timeout_s: float | None = None) -> Admission:
        return await self._send(_Calls.set_admission("paused", timeout_s, self.timeout_s))

    async def resume(self) -> Admission:
        return await self._send(_Calls.set_admission("running", None, self.timeout_s))

    async def admission(self) -> Admission:
        return await self._send(_Calls.admission())
