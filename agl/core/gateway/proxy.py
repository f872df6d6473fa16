"""The recording proxy: forward a harness's chat call, record what the model sampled.

The forwarded request asks the endpoint for vLLM's ``logprobs`` and ``return_token_ids``;
the answer keeps those for the ``model_request`` event and goes back to the harness as a
plain OpenAI answer. The sampling fields (``agl.core.contracts.sampling``) and the rule for
what text the ids become (``agl.core.contracts.text_rule``) are resolved, forwarded
explicitly and recorded with each call, one ``model_request`` per choice with its index.
Text completions (``/v1/completions``) go the same way, recorded in
the same layout with the prompt instead of messages: vLLM puts their ids on each choice
and their logprobs completions-style (``token_logprobs``). A call is acknowledged (its
last byte sent) only after its event is stored, so nothing the harness received is
missing from the record.

A call's CPU does not grow with its context: the answer's prompt ids stay bytes
(:mod:`agl.core.gateway.answer_ids`), and a prompt that extends an earlier call of its
attempt (:mod:`agl.core.gateway.prompt_chain`: the last calls of each attempt, kept in
this process) is compared with that call's as bytes; only the ids after it are parsed
and checked, and the event is stored by what it adds
(:mod:`agl.core.gateway.store.prompt_delta`). Any other prompt is parsed, checked and
stored whole, as is every call of an attempt this process has not seen yet.

The bytes sent are stored with the event as a pending answer until all of them are with
the kernel. When the gateway dies in between, the harness never saw an answer the
record holds; its retry of the same request (byte-identical, as OpenAI clients resend)
from the same attempt, to the same API, gets those bytes again from the next gateway
process instead of a second sample, so the call is recorded once. Within one process an
identical request is a new call: a harness may sample the same prompt twice on purpose.
Replicas sharing a store replay only a dead replica's answers: a retry that reaches one
replica while another, alive, still holds the answer waits until it is delivered (then
the retry is a new call) or its holder dies (``SharedStore.claim_answer``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp.http_exceptions import HttpProcessingError
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from agl.core.contracts.call_validity import MAX_TOKEN_ID, invalid_reason, token_ids
from agl.core.contracts.records import (
    MAX_JSON_DEPTH,
    MODEL_REQUEST,
    MODEL_REQUEST_FAILED,
    EventIn,
    ModelEndpoint,
    parse_storable,
)
from agl.core.contracts.samples import Sampling
from agl.core.contracts.sampling import (
    SamplingError,
    forwarded_sampling,
    requested_sampling,
    sampling_record,
)
from agl.core.contracts.text_rule import (
    TextRule,
    TextRuleError,
    requested_text_rule,
    text_rule_record,
)
from agl.core.gateway.admission import AdmissionGate, Ticket
from agl.core.gateway.answer_ids import RawIds, parse_answer
from agl.core.gateway.dialects import ANTHROPIC, Dialect, DialectError, StreamTranslator
from agl.core.gateway.prompt_chain import Link, PromptChain
from agl.core.gateway.router import Router
from agl.core.gateway.seeding import RequestSeeds
from agl.core.gateway.store.base import PendingAnswer, Store
from agl.core.gateway.store.prompt_delta import PromptBase, input_key
from agl.core.gateway.upstream import Upstream, UpstreamUnavailable
from agl.core.http_errors import ApiError, json_error, upstream_error

log = logging.getLogger(__name__)

PROXY_EVENT_TYPES = frozenset({MODEL_REQUEST, MODEL_REQUEST_FAILED})

# vLLM's additions to an OpenAI answer; the harness gets the answer without them.
_EXTRA_TOP = ("prompt_token_ids", "prompt_logprobs", "prompt_text", "kv_transfer_params")
_EXTRA_CHOICE = ("token_ids", "prompt_token_ids", "prompt_logprobs")


@dataclass
class _Choice:
    """What one choice of a streamed answer added up to."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: object = None  # vLLM's: the stop string (or stop token id) that ended it
    prompt_ids: RawIds | list[int] | None = None  # a text completion's, on its first chunk

    def add(self, choice: dict[str, Any]) -> None:
        self.token_ids.extend(choice.get("token_ids") or ())
        self.logprobs.extend(_logprobs(choice))
        if choice.get("prompt_token_ids") is not None:
            self.prompt_ids = choice["prompt_token_ids"]
        if isinstance(choice.get("text"), str):  # a text completion's chunk
            self.text.append(choice["text"])
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"delta.content is {type(content).__name__}, not a string")
        if content:
            self.text.append(content)
        for call in delta.get("tool_calls") or ():
            slot = self.tool_calls.setdefault(
                _index(call, "a tool call"),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call.get("id"):
                slot["id"] = call["id"]
            function = call.get("function") or {}
            slot["function"]["name"] += function.get("name") or ""
            slot["function"]["arguments"] += function.get("arguments") or ""
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        if choice.get("stop_reason") is not None:
            self.stop_reason = choice["stop_reason"]

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return message


def _index(item: dict[str, Any], what: str) -> int:
    """A streamed choice's or tool call's ``index``: the record sorts them by it, so one
    that is not an integer makes the stream malformed (not a crash once it is over)."""
    index = item.get("index", 0)
    if type(index) is not int:
        raise ValueError(f"{what} has index {index!r:.40}, not an integer")
    return index


def _logprobs(choice: dict[str, Any]) -> list[Any]:
    """The sampled tokens' logprobs as the endpoint gave them, chat-style
    (``content[].logprob``) or completions-style (``token_logprobs``); whatever is
    malformed here makes the call invalid for training (``invalid_reason``), not a failed
    call."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return []
    content = logprobs.get("content")
    if isinstance(content, list):
        return [entry.get("logprob") if isinstance(entry, dict) else None for entry in content]
    values = logprobs.get("token_logprobs")
    return list(values) if isinstance(values, list) else []


def _answer_message(choice: dict[str, Any]) -> dict[str, Any]:
    """A unary choice's message; a text completion's text is its content."""
    if isinstance(choice.get("text"), str):
        return {"role": "assistant", "content": choice["text"]}
    return choice.get("message") or {}


@dataclass(frozen=True)
class _ChatApi:
    """The harness speaks chat completions: answers go back as the endpoint gave them,
    less vLLM's additions (and the logprobs, unless the harness asked for them)."""

    request: dict[str, Any]

    name = "chat"
    path = "/chat/completions"

    def forwarded(self) -> dict[str, Any]:
        """vLLM's additions that make an answer recordable."""
        return {"logprobs": True, "return_token_ids": True}

    @property
    def keep_logprobs(self) -> bool:
        return bool(self.request.get("logprobs"))

    def answer(self, answer: dict[str, Any]) -> bytes:
        return orjson.dumps(_for_harness(self.request, answer, self.keep_logprobs))

    def stream(self) -> _ChatStream:
        return _ChatStream(self.request, self.keep_logprobs)

    def error(self, error: ApiError) -> Response:
        return error.response()


@dataclass(frozen=True)
class _TextApi(_ChatApi):
    """The harness asks for a text completion (``/v1/completions``): as chat, but
    ``logprobs`` is a number of top logprobs, and 0 asks for the sampled token's."""

    name = "completions"
    path = "/completions"

    def forwarded(self) -> dict[str, Any]:
        asked = self.request.get("logprobs")
        return {"logprobs": 0 if asked is None else asked, "return_token_ids": True}

    @property
    def keep_logprobs(self) -> bool:
        return self.request.get("logprobs") is not None


@dataclass(frozen=True)
class _ChatStream:
    request: dict[str, Any]
    keep_logprobs: bool

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        answer = _for_harness(self.request, chunk, self.keep_logprobs)
        return [b"data: " + orjson.dumps(answer) + b"\n\n"]

    def finish(self) -> list[bytes]:
        return [b"data: [DONE]\n\n"]

    def fail(self, status: int, message: str) -> list[bytes] | None:
        return None  # no error event in chat streams: the connection is cut short instead


@dataclass(frozen=True)
class _DialectApi:
    """The harness speaks another API (Responses, Anthropic Messages): its request became
    one chat request; answers and errors are translated back into its own shapes."""

    dialect: Dialect
    request: dict[str, Any]  # as the harness sent it

    path = "/chat/completions"

    @property
    def name(self) -> str:
        return self.dialect.name

    def forwarded(self) -> dict[str, Any]:
        return {"logprobs": True, "return_token_ids": True}

    def answer(self, answer: dict[str, Any]) -> bytes:
        return orjson.dumps(self.dialect.from_chat(answer, self.request))

    def stream(self) -> StreamTranslator:
        return self.dialect.stream(self.request)

    def error(self, error: ApiError) -> Response:
        return dialect_error(self.dialect, error)


def _for_harness(
    request: dict[str, Any], answer: dict[str, Any], keep_logprobs: bool
) -> dict[str, Any]:
    for key in _EXTRA_TOP:
        answer.pop(key, None)
    for choice in answer.get("choices") or ():
        for key in _EXTRA_CHOICE:
            choice.pop(key, None)
        if not keep_logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    if isinstance(request.get("model"), str):
        answer["model"] = request["model"]
    return answer


def dialect_error(dialect: Dialect, error: ApiError) -> Response:
    """``error`` in the shape of the API the harness spoke, with its headers (a 429's
    Retry-After) and its fields beside ``error`` (a 409's ``current``)."""
    body = dialect.error_body(error.status, error.message, error.param, error.code)
    return json_error(error.status, {**body, **error.extra}, error.headers)


_Api = _ChatApi | _TextApi | _DialectApi


@dataclass(frozen=True)
class CallContext:
    rollout_id: str
    attempt: int
    mode: str
    endpoint: ModelEndpoint
    request: dict[str, Any]  # the request the endpoint gets (before our additions)
    request_hash: bytes
    started: float
    api: _Api
    sampling: Sampling
    text_rule: TextRule
    seed: object  # as forwarded: the harness's own, the gateway's, or None

    def recorded_input(self) -> dict[str, Any]:
        """What the model was given, for monitoring: a chat's messages, or a text
        completion's prompt (its token ids are recorded either way)."""
        if isinstance(self.api, _TextApi):
            return {"prompt": self.request.get("prompt")}
        return {"messages": self.request["messages"]}


class RecordingProxy:
    def __init__(
        self,
        store: Store,
        upstream: Upstream,
        gate: AdmissionGate,
        seeds: RequestSeeds | None = None,
        prompt_cache_bytes: int = 256 << 20,
    ) -> None:
        self.store = store
        self.upstream = upstream
        self.gate = gate
        # None: requests without a seed of their own go unseeded to the engine.
        self.seeds = seeds
        self.router = Router()
        # Each attempt's recent calls: a prompt that extends one is parsed, checked and
        # stored by what it adds (agl.core.gateway.prompt_chain).
        self.chain = PromptChain(prompt_cache_bytes)
        # Pending answers of another boot belong to a process that died (see the module).
        self.boot = uuid.uuid4().hex

    def forget(self, rollout_id: str) -> None:
        """``rollout_id`` stopped running: its endpoint's load drops, its calls are
        bases no more."""
        self.router.forget(rollout_id)
        self.chain.forget(rollout_id)

    async def chat(
        self,
        rollout_id: str,
        attempt: int,
        mode: str,
        body: bytes,
        dialect: Dialect | None = None,
    ) -> Response:
        """Forward one call and record it. With a ``dialect`` the body is that API's
        request, translated to one chat request and its answer (and errors) back."""
        original = _request_of(body)
        api: _Api = _ChatApi(original)
        request = original
        if dialect is not None:
            api = _DialectApi(dialect, original)
            try:
                request = dialect.to_chat(original)
            except DialectError as error:
                return api.error(error)
        if not isinstance(request.get("messages"), list):
            raise ApiError(400, "a chat completion needs a JSON object with a 'messages' list")
        return await self._call(rollout_id, attempt, mode, body, api, request)

    async def completions(self, rollout_id: str, attempt: int, mode: str, body: bytes) -> Response:
        """Forward one text completion (``/v1/completions``) and record it."""
        request = _request_of(body)
        prompt = request.get("prompt")
        if not isinstance(prompt, str | list) or not prompt:
            raise ApiError(400, "a text completion needs a 'prompt': a string or token ids")
        if request.get("echo"):
            # vLLM would answer the prompt's logprobs with the sampled ones, which no
            # longer line up with the sampled ids: the call could not be trained on.
            raise ApiError(400, "'echo' is not supported through the recording proxy")
        return await self._call(rollout_id, attempt, mode, body, _TextApi(request), request)

    async def count_tokens(self, rollout_id: str, body: bytes) -> Response:
        """Anthropic's ``/v1/messages/count_tokens``: the request's prompt, as its messages
        call would send it, counted by the rollout's endpoint (vLLM's ``/tokenize``, at
        the server's root). Answers ``{"input_tokens": n}``; nothing is recorded."""
        try:
            request = ANTHROPIC.count_tokens_request(_request_of(body))
        except DialectError as error:
            return dialect_error(ANTHROPIC, error)
        endpoint = self.router.pick(request.get("model"), rollout_id)
        query = {**request, "model": endpoint.model}
        query.setdefault("add_generation_prompt", True)
        url = endpoint.endpoint.rstrip("/").removesuffix("/v1") + "/tokenize"
        try:
            upstream = await self.upstream.open(url, orjson.dumps(query))
        except UpstreamUnavailable as error:
            return dialect_error(ANTHROPIC, _unreachable(error))
        async with upstream:
            payload = await upstream.read()
        if upstream.status != 200:
            failed = upstream_error(upstream.status, payload, "the endpoint's /tokenize")
            return dialect_error(ANTHROPIC, failed)
        try:
            count = orjson.loads(payload)["count"]
        except _MALFORMED:  # orjson.JSONDecodeError is a ValueError
            count = None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return dialect_error(ANTHROPIC, ApiError(502, "the endpoint's /tokenize gave no count"))
        return Response(orjson.dumps({"input_tokens": count}), media_type="application/json")

    async def _call(
        self,
        rollout_id: str,
        attempt: int,
        mode: str,
        body: bytes,
        api: _Api,
        request: dict[str, Any],
    ) -> Response:
        try:
            sampling = requested_sampling(request)
            text_rule = requested_text_rule(request)
        except (SamplingError, TextRuleError) as error:
            return api.error(ApiError(400, str(error)))
        # The API is part of the request: the same bytes sent to another API's route (a
        # chat body is often a valid Messages body) are another call, not a retry.
        request_hash = hashlib.sha256(api.name.encode() + b"\n" + body).digest()
        lost = await self.store.claim_answer(rollout_id, attempt, request_hash, self.boot)
        if lost is not None:
            log.info(
                "replaying answer %s of rollout %s: its first sending was lost",
                lost.answer_id,
                rollout_id,
            )
            return self._replay(rollout_id, attempt, lost)
        # The endpoint (and so the policy_version recorded) is chosen only once admitted:
        # a call that waited through a weight update goes to the new weights.
        ticket = await self.gate.enter()
        try:
            try:
                endpoint = self.router.pick(request.get("model"), rollout_id)
            except ApiError as error:
                return api.error(error)
            forwarded = {
                **request,
                "model": endpoint.model,
                **api.forwarded(),
                **forwarded_sampling(sampling),
                **text_rule_record(text_rule),
            }
            if request.get("seed") is None and self.seeds is not None:
                forwarded["seed"] = self.seeds.next(rollout_id, attempt, request_hash)
            call = CallContext(
                rollout_id,
                attempt,
                mode,
                endpoint,
                request,
                request_hash,
                time.monotonic(),
                api,
                sampling,
                text_rule,
                forwarded.get("seed"),
            )
            url = endpoint.endpoint.rstrip("/") + api.path
            if request.get("stream"):
                return await self._stream(call, url, orjson.dumps(forwarded), ticket)
            return await self._unary(call, url, orjson.dumps(forwarded))
        finally:
            if not request.get("stream"):
                ticket.release()

    async def _unary(self, call: CallContext, url: str, body: bytes) -> Response:
        try:
            upstream = await self.upstream.open(url, body)
        except UpstreamUnavailable as error:
            return await self._failed(call, _unreachable(error))
        async with upstream:
            payload = await upstream.read()
            if upstream.status != 200:
                return await self._failed(call, upstream_error(upstream.status, payload))
        try:
            # Held to the rules of a request: what is recorded must read back.
            answer = parse_answer(payload)
            calls = [
                self._call_data(
                    call,
                    choice,
                    # vLLM puts a text completion's prompt ids on its choice, a chat's on top
                    c.get("prompt_token_ids") or answer.get("prompt_token_ids"),
                    c.get("token_ids"),
                    _logprobs(c),
                    c.get("finish_reason"),
                    c.get("stop_reason"),
                    _answer_message(c),
                )
                for choice, c in enumerate(answer["choices"])
            ]
            sent = call.api.answer(answer)
        except _MALFORMED as error:
            return await self._failed(
                call, ApiError(502, f"endpoint answered a malformed completion: {error!r}")
            )
        answer_id = await self._record(call, calls, sent, stream=False)
        return _Sent(
            sent,
            background=BackgroundTask(self._delivered, call.rollout_id, call.attempt, answer_id),
        )

    async def _stream(self, call: CallContext, url: str, body: bytes, ticket: Ticket) -> Response:
        """Relay an event stream. The ticket is released when the response is over, however
        it ends (finished, upstream broke, harness gone before the first byte)."""
        try:
            upstream = await self.upstream.open(url, body)
        except BaseException as error:
            ticket.release()
            if isinstance(error, UpstreamUnavailable):
                return await self._failed(call, _unreachable(error))
            raise
        if upstream.status != 200:
            async with upstream:
                payload = await upstream.read()
            ticket.release()
            return await self._failed(call, upstream_error(upstream.status, payload))

        recorded_ids: list[str] = []
        translator = call.api.stream()

        async def relay() -> AsyncIterator[bytes]:
            choices: dict[int, _Choice] = {}
            prompt_ids: RawIds | list[int] | None = None
            sent: list[bytes] = []
            try:
                while line := await upstream.content.readline(max_line_length=_MAX_LINE):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = parse_answer(data)
                    if chunk.get("prompt_token_ids") is not None:
                        prompt_ids = chunk["prompt_token_ids"]
                    for c in chunk.get("choices") or ():
                        choices.setdefault(_index(c, "a choice"), _Choice()).add(c)
                    for event in translator.feed(chunk):
                        sent.append(event)
                        yield event
                else:
                    raise _StreamBroke("the endpoint's stream ended before [DONE]")
                # Prompt ids that do not read back break the stream as a malformed chunk.
                calls = [
                    self._call_data(
                        call,
                        choice,
                        c.prompt_ids or prompt_ids,
                        c.token_ids,
                        c.logprobs,
                        c.finish_reason,
                        c.stop_reason,
                        c.message(),
                    )
                    for choice, (_, c) in enumerate(sorted(choices.items()))
                ]
            except (aiohttp.ClientError, HttpProcessingError, TimeoutError, *_MALFORMED) as error:
                broken = _StreamBroke(f"the endpoint's stream broke: {error!r}")
                closing = translator.fail(502, str(broken))
                if closing is None:
                    raise broken from error
                # The harness's API has an error event: end its stream with it.
                await self._record_failure(call, 502, str(broken))
                for event in closing:
                    yield event
                return
            closing = translator.finish()
            recorded = await self._record(call, calls, b"".join([*sent, *closing]), stream=True)
            recorded_ids.append(recorded)
            for event in closing:
                yield event

        async def broke(error: _StreamBroke) -> None:
            await self._record_failure(call, 502, str(error))

        async def delivered() -> None:
            if recorded_ids:
                await self._delivered(call.rollout_id, call.attempt, recorded_ids[0])

        def done() -> None:
            upstream.release()
            ticket.release()

        return _StreamThenClose(relay(), done, broke, delivered)

    def _call_data(
        self,
        call: CallContext,
        choice: int,
        prompt_ids: object,
        response_ids: list[int] | None,
        logprobs: list[float],
        finish_reason: str | None,
        stop_reason: object,
        message: dict[str, Any],
    ) -> _CallRecord:
        """One choice's event data, stored by what it adds to the call it extends, if
        any. ValueError: the prompt ids cannot be stored (as the answer's parse says)."""
        inputs = call.recorded_input()
        key = input_key(inputs)
        given = inputs[key] if key is not None else None
        written = None if given is None else orjson.dumps(given)
        prompt, base, raw = self._prompt(call, prompt_ids, given, written, key)
        # Ids from bytes were checked as parsed; none at all (and no base) is no prompt.
        checked = raw is not None and bool(base or prompt)
        if base is not None and key is not None:
            inputs[key] = inputs[key][base.keep_input :]
        data: dict[str, Any] = {
            "prompt_ids": prompt,
            "response_ids": response_ids,
            "logprobs": logprobs,
            "policy_version": call.endpoint.policy_version,
            # What the logprobs are of, and so what the trainer scores the tokens under.
            "sampling": sampling_record(call.sampling),
            "choice": choice,  # of the request's n: dedup tells choices from retries
            "finish_reason": finish_reason,
            # What text the harness got of the ids: the trainer checks them under it.
            "text_rule": text_rule_record(call.text_rule),
            **inputs,
            "response": message.get("content"),
            "latency_s": time.monotonic() - call.started,
            "model": call.endpoint.model,
            "endpoint": call.endpoint.endpoint,
            "mode": call.mode,
        }
        if call.seed is not None:
            data["seed"] = call.seed
        if isinstance(stop_reason, str):  # a stop string ended the text
            data["stop_reason"] = stop_reason
        if call.api.name != "chat":  # chat completions, the default, goes unnamed
            data["api"] = call.api.name
        if message.get("tool_calls"):
            data["tool_calls"] = message["tool_calls"]
        if call.request.get("tools"):
            data["tools"] = call.request["tools"]
        reason = invalid_reason(data, prompt_checked=checked)
        if reason is not None:
            # The harness has its answer; the record says it cannot be trained on.
            data["invalid"] = reason
            log.warning(
                "endpoint %s answered a call that cannot be trained on: %s",
                call.endpoint.endpoint,
                reason,
            )
            return _CallRecord(data, base, None)
        prompt_list, response_list = data["prompt_ids"], data["response_ids"]  # valid: lists
        if raw is None:  # the answer's ids came parsed (an unusual answer)
            raw = orjson.dumps(prompt_list)[1:-1]
        response = b"," + orjson.dumps(response_list)[1:-1]
        kept = base.keep_ids if base is not None else 0
        tokens = kept + len(prompt_list) + len(response_list)
        items = 0 if given is None else len(given)
        link = Link(0, raw, response, tokens, written, items, key)
        return _CallRecord(data, base, link)

    def _prompt(
        self,
        call: CallContext,
        given: object,
        input: list[Any] | str | None,
        written: bytes | None,
        key: str | None,
    ) -> tuple[object, PromptBase | None, bytes | None]:
        """The prompt ids to store, the base they extend (None: stored whole), and the
        whole prompt's ids as JSON items where the answer gave them as bytes (then the
        ids stored are token ids, checked). The ids a base covers were checked when it
        was recorded and are compared as bytes, never parsed; the rest are parsed once
        (orjson, at C speed), and read by ``parse_storable`` where they are unusual."""
        if not isinstance(given, RawIds):
            return given, None, None  # the answer was parsed whole: as it came
        match = self.chain.match(call.rollout_id, call.attempt, given.content, input, written, key)
        if match is not None:
            tail = _token_ids(given.content[match.covered + 1 :])
            if tail is not None:
                return tail, match.base, given.content
        ids = _token_ids(given.content)
        if ids is None:  # exactly as the whole answer's parse reads them (or its error)
            return given.parse(), None, None
        return ids, None, given.content

    def _replay(self, rollout_id: str, attempt: int, lost: PendingAnswer) -> Response:
        # The header Stripe-style idempotent APIs use: the harness can tell, a test can count.
        headers = {"Idempotent-Replayed": "true"}
        delivered = BackgroundTask(self._delivered, rollout_id, attempt, lost.answer_id)
        if not lost.stream:
            return _Sent(lost.body, headers=headers, background=delivered)

        async def once() -> AsyncIterator[bytes]:
            yield lost.body

        return StreamingResponse(
            once(),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache"},
            background=delivered,
        )

    async def _record(
        self, call: CallContext, calls: list[_CallRecord], sent: bytes, stream: bool
    ) -> str:
        """Store the call's events with the answer about to be sent; answer its id. Its
        valid calls become bases for the attempt's next ones once they are stored."""
        answer_id = uuid.uuid4().hex
        bases = [c.base for c in calls]
        stored = await self.store.append_events(
            call.rollout_id,
            call.attempt,
            [
                EventIn.model_construct(
                    event_id=answer_id if i == 0 else None, type=MODEL_REQUEST, data=c.data
                )
                for i, c in enumerate(calls)
            ],
            time.time(),
            pending=PendingAnswer(answer_id, call.request_hash, self.boot, sent, stream),
            bases=bases,
        )
        for c, event in zip(calls, stored, strict=True):
            if c.link is not None:
                link = dataclasses.replace(c.link, sequence=event.sequence)
                self.chain.add(call.rollout_id, call.attempt, link)
        return answer_id

    async def _delivered(self, rollout_id: str, attempt: int, answer_id: str) -> None:
        await self.store.answer_delivered(rollout_id, attempt, answer_id)

    async def _record_failure(self, call: CallContext, status: int, message: str) -> None:
        data = {
            "status": status,
            "error": message,
            **call.recorded_input(),
            "latency_s": time.monotonic() - call.started,
            "endpoint": call.endpoint.endpoint,
            "mode": call.mode,
        }
        await self.store.append_events(
            call.rollout_id,
            call.attempt,
            [EventIn.model_construct(event_id=None, type=MODEL_REQUEST_FAILED, data=data)],
            time.time(),
        )

    async def _failed(self, call: CallContext, error: ApiError) -> Response:
        await self._record_failure(call, error.status, error.message)
        return call.api.error(error)


@dataclass(frozen=True)
class _CallRecord:
    """One choice's event as it is stored, and what it adds to the attempt's chain."""

    data: dict[str, Any]  # with a base: prompt_ids and input hold what the call adds
    base: PromptBase | None
    link: Link | None  # None: an invalid call, never a base (its sequence comes later)


def _token_ids(items: bytes) -> list[int] | None:
    """``items`` (JSON list items) as token ids, or None where they are anything else."""
    if not items:
        return []
    try:
        ids = orjson.loads(b"[" + items + b"]")
    except orjson.JSONDecodeError:
        return None
    if items.translate(None, b"0123456789,"):  # a sign, a space, ...: check each id's type
        return ids if token_ids(ids) else None
    # Digits only: integers >= 0 (orjson reads one past 64 bits as a float, over the max).
    return ids if max(ids) <= MAX_TOKEN_ID else None


def _request_of(body: bytes) -> dict[str, Any]:
    """A harness's request body: a JSON object that the store can hold."""
    try:
        request = _read_json(body)  # it is recorded, and must read back
    except ValueError as error:
        raise ApiError(400, f"request body: {error}") from None
    if not isinstance(request, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return request


def _read_json(body: bytes) -> Any:
    """``body`` as ``parse_storable`` reads it (ValueError as it raises), read by orjson
    where that reads it alike: several times faster on a long conversation's text. orjson
    reads an integer past 64 bits as a float, so a float that large, or anything else
    ``storable`` might refuse (nesting past its depth, a non-finite number) or orjson
    refuses, sends the body to ``parse_storable``, which reads it exactly."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return parse_storable(body)
    if type(value) is not dict and type(value) is not list:
        return parse_storable(body)  # not a request anyway: read as exactly as it is refused
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:  # the request's objects and lists: messages, not characters
        item, depth = stack.pop()
        for child in item.values() if type(item) is dict else item:
            kind = type(child)
            if kind is dict or kind is list:
                if depth >= MAX_JSON_DEPTH:
                    return parse_storable(body)
                stack.append((child, depth + 1))
            elif kind is float and not -(2.0**63) < child < 2.0**64:  # NaN too
                return parse_storable(body)
    return value


class _StreamBroke(Exception):
    """The endpoint's stream failed after the harness had part of it."""


# One event-stream line may be long: vLLM's first chunk carries every prompt token id,
# megabytes for a long agentic prompt (aiohttp's default limit is 128 KiB).
_MAX_LINE = 1 << 30

# What a malformed answer from an endpoint raises while it is read.
_MALFORMED = (ValueError, KeyError, TypeError, AttributeError)


class _Sent(Response):
    """A JSON answer whose background task runs only once all of it is with the kernel.
    The empty last message makes the server wait while the connection is paused (a
    harness not reading a large answer), so an answer still inside this process when it
    dies stays pending."""

    media_type = "application/json"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if self.background is not None:
            await self.background()


class _StreamThenClose(StreamingResponse):
    """An event stream that runs ``on_close`` once the response is over, whether the
    body was sent, broke off, or never started, and ``on_sent`` after its last message
    (which, like :class:`_Sent`'s, waits out a paused connection). When the endpoint's
    stream breaks, the failure is recorded and the harness's connection is cut short, so
    that its client sees an error rather than a clean but truncated answer."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        on_close: Callable[[], None],
        on_broken: Callable[[_StreamBroke], Awaitable[None]],
        on_sent: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close
        self._on_broken = on_broken
        self._on_sent = on_sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except _StreamBroke as error:
            log.warning("%s; cutting the harness's stream short", error)
            await self._on_broken(error)
        else:
            await self._on_sent()
        finally:
            self._on_close()


def _unreachable(error: UpstreamUnavailable) -> ApiError:
    return ApiError(502, f"inference endpoint unreachable: {error}", code="upstream_unreachable")
