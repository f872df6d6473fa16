"""The embedded inference server: an OpenAI-compatible chat endpoint over ``Engine``.

It speaks vLLM's dialect, so the gateway's recording proxy treats it exactly like vLLM:
asked for ``logprobs`` and ``return_token_ids``, an answer carries ``prompt_token_ids`` at
the top, ``token_ids`` and ``logprobs.content[].logprob`` on each choice, and the same
fields chunk by chunk when streaming.

``POST /v1/completions`` (text completions) follows vLLM too: one prompt, a string or a
list of token ids; ``logprobs`` is an integer and comes back completions-style
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``); ``return_token_ids``
puts ``prompt_token_ids`` and ``token_ids`` on each choice (in a stream, a choice's first
chunk carries its ``prompt_token_ids``). ``POST /tokenize`` counts a prompt as vLLM's does.

Text and tokens follow vLLM's conventions:
- the prompt is the tokenizer's chat template rendered to text and tokenized without
  added special tokens;
- ``token_ids`` is everything sampled, the final eos included; the text leaves the eos out
  (special tokens such as ``<tool_call>`` stay in the text: the tool parser needs them);
- a stop string ends the text before it, while ``token_ids`` keeps the tokens sampled up
  to the one that completed it (so those ids decode to the text plus the stop string);
- tool calls (``<tool_call>{json}</tool_call>``, the Hermes/Qwen format) become
  ``message.tool_calls``, their arguments re-serialized with ``json.dumps``: the text a
  harness sends back next turn is therefore not the text the model sampled, one of the
  drift sources agl studies, left visible on purpose. Malformed tool JSON stays content.
  ``tool_choice`` ``required`` or a named function is accepted but not enforced (no
  guided decoding): the model is free to answer in text.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from agl.backends.inference.byte_level import byte_level_chars
from agl.backends.inference.engine import Delta, Engine, EngineError, Generation, SamplingParams
from agl.core.gateway.errors import ApiError, error_body, error_response

log = logging.getLogger(__name__)

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_START) + "(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
POLICY_VERSION_HEADER = "x-agl-policy-version"


# --------------------------------------------------------------------------- tool calls


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """``(content, tool_calls)`` when ``text`` holds well-formed tool-call blocks, else None.

    Like vLLM's Hermes parser: content is the text before the first ``<tool_call>`` (the
    template's separating newline removed), each block's JSON must be an object with a
    string ``name``; its ``arguments`` are re-serialized with ``json.dumps``. Any block
    that is not valid JSON, or an unterminated one, makes the whole text plain content.
    """
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return None
    tail = text[start:]
    blocks = _TOOL_CALL.findall(tail)
    if not blocks or len(blocks) != tail.count(TOOL_CALL_START):
        return None
    calls = []
    for raw in blocks:
        call = _tool_call(raw)
        if call is None:
            return None
        calls.append(call)
    return text[:start].removesuffix("\n") or None, calls


def _tool_call(raw: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        # Re-serialized, not the sampled text: the drift a harness carries into its history.
        "function": {
            "name": parsed["name"],
            "arguments": json.dumps(arguments, ensure_ascii=False),
        },
    }


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    params: SamplingParams
    max_tokens: int | None  # as asked (None: what the context leaves)
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    want_logprobs: bool
    want_token_ids: bool


def parse_request(body: object, model_name: str, max_batch_size: int) -> ChatRequest:
    """Validate a chat completion body; raises ``ApiError`` (4xx) saying what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404, f"the model {model!r} does not exist; this server serves {model_name!r}"
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role in {sorted(_ROLES)}")
        if not isinstance(m.get("content"), str | list | None):
            raise ApiError(400, f"messages[{i}].content must be a string, a list of parts or null")
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(_is_function_tool(t) for t in tools)
    ):
        raise ApiError(400, "'tools' must be a list of {'type': 'function', 'function': {'name'}}")
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("none", "auto", "required") and not _is_function_tool(tool_choice):
        raise ApiError(400, "'tool_choice' must be 'none', 'auto', 'required' or a function")
    max_tokens = _optional(body, "max_completion_tokens", int, minimum=1)
    if max_tokens is None:
        max_tokens = _optional(body, "max_tokens", int, minimum=1)
    return ChatRequest(
        messages=messages,
        tools=tools or None,
        parse_tools=bool(tools) and tool_choice != "none",
        params=_sampling(body, max_batch_size),
        max_tokens=max_tokens,
        stop=_stops(body.get("stop")),
        stream=bool(_optional(body, "stream", bool)),
        include_usage=_include_usage(body),
        want_logprobs=bool(_optional(body, "logprobs", bool)),
        want_token_ids=bool(_optional(body, "return_token_ids", bool)),
    )


def _sampling(body: dict[str, Any], max_batch_size: int) -> SamplingParams:
    """The sampling fields chat and text completions share; ``max_tokens`` is set once
    the prompt is known."""
    temperature = _optional(body, "temperature", float, minimum=0.0)
    top_p = _optional(body, "top_p", float)
    if top_p is not None and not 0 < top_p <= 1:
        raise ApiError(400, "'top_p' must be in (0, 1]")
    top_k = _optional(body, "top_k", int, minimum=-1)  # vLLM's: -1 or 0 is off
    n = _optional(body, "n", int, minimum=1)
    if n is not None and n > max_batch_size:
        raise ApiError(400, f"'n' must be at most {max_batch_size} (the batch size)")
    return SamplingParams(
        max_tokens=1,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k or 0, 0),
        seed=_optional(body, "seed", int),
        n=n or 1,
        ignore_eos=bool(_optional(body, "ignore_eos", bool)),
    )


def _include_usage(body: dict[str, Any]) -> bool:
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "'stream_options' must be an object")
    return bool(_optional(stream_options, "include_usage", bool))


# vLLM's (and OpenAI's) default cap of a text completion, when the request sets none.
COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    add_special_tokens: bool
    params: SamplingParams
    max_tokens: int | None  # as asked (None: COMPLETION_MAX_TOKENS, or what fits)
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None  # completions-style: how many top logprobs (None: none)
    want_token_ids: bool


def parse_completion_request(
    body: object, model_name: str, max_batch_size: int
) -> CompletionRequest:
    """Validate a text completion body; raises ``ApiError`` (4xx) saying what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404, f"the model {model!r} does not exist; this server serves {model_name!r}"
        )
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported by this server")
    if body.get("suffix") is not None:
        raise ApiError(400, "'suffix' is not supported by this server")  # nor by vLLM
    return CompletionRequest(
        prompt=_one_prompt(body.get("prompt")),
        add_special_tokens=_optional(body, "add_special_tokens", bool) is not False,
        params=_sampling(body, max_batch_size),
        max_tokens=_optional(body, "max_tokens", int, minimum=1),
        stop=_stops(body.get("stop")),
        stream=bool(_optional(body, "stream", bool)),
        include_usage=_include_usage(body),
        logprobs=_optional(body, "logprobs", int, minimum=0),
        want_token_ids=bool(_optional(body, "return_token_ids", bool)),
    )


def _one_prompt(prompt: object) -> str | list[int]:
    """A string or a list of token ids; a batch of one is that one. Batches of several
    prompts are refused: one prompt per request keeps one call one record."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "'prompt' holds several prompts; send one prompt per request")
    raise ApiError(400, "'prompt' must be a non-empty string or a non-empty list of token ids")


def _is_function_tool(tool: object) -> bool:
    return (
        isinstance(tool, dict)
        and tool.get("type") == "function"
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    )


def _optional(body: dict[str, Any], key: str, kind: type, minimum: float | None = None) -> Any:
    value = body.get(key)
    if value is None:
        return None
    # bool is an int in Python; a JSON true is not a valid count, nor 1.5 a valid int.
    ok = (
        isinstance(value, bool)
        if kind is bool
        else isinstance(value, int | float) and not isinstance(value, bool)
    )
    if kind is int and ok and value != int(value):
        ok = False
    if not ok:
        raise ApiError(400, f"'{key}' must be {_KINDS[kind]}")
    value = kind(value)
    if minimum is not None and value < minimum:
        raise ApiError(400, f"'{key}' must be at least {minimum:g}")
    return value


_KINDS = {bool: "a boolean", int: "an integer", float: "a number"}


def _stops(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings")
    return tuple(s for s in stop if s)


# ------------------------------------------------------------------------- text output


class TokenCodec:
    """What the server needs from the tokenizer, the hot paths on the Rust tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = (
            (lambda ids: backend.decode(ids, skip_special_tokens=False))
            if backend is not None
            else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        )
        self._added = {v: k for k, v in tokenizer.get_added_vocab().items()}
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._byte_of = {ch: b for b, ch in enumerate(byte_level_chars())}
        self._entries: dict[int, tuple[str, list[int]]] = {}

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(list(ids))

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode_text(text, add_special_tokens=False)

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """A text completion's prompt: with the tokenizer's special tokens (a bos) by
        default, as vLLM; a rendered chat template already holds its own."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def entry(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and its bytes, for ``logprobs.content`` (cached)."""
        found = self._entries.get(token_id)
        if found is None:
            text = self._decode([token_id])
            raw = text.encode()
            if self._byte_level and token_id not in self._added:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if piece is not None and all(ch in self._byte_of for ch in piece):
                    raw = bytes(self._byte_of[ch] for ch in piece)
            found = self._entries[token_id] = (text, list(raw))
        return found


class Detokenizer:
    """Token ids to text, one token at a time, never splitting a UTF-8 character: text is
    released once the window ``ids[prefix:]`` decodes without a trailing replacement
    character (vLLM's incremental detokenization)."""

    def __init__(self, tokens: TokenCodec) -> None:
        self._tokens = tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._tokens.decode(self._ids[self._prefix : self._read])
        text = self._tokens.decode(self._ids[self._prefix :])
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]


@dataclass
class ChoiceOutput:
    """One choice's answer as it grows: ids, logprobs, text after stop strings, and how
    much of the text a stream may already show."""

    index: int
    tokens: TokenCodec
    stops: tuple[str, ...]
    parse_tools: bool
    incremental: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    shown: int = 0  # characters of text already streamed
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that ended it, as vLLM reports
    detokenizer: Detokenizer | None = None

    def __post_init__(self) -> None:
        if self.incremental:
            self.detokenizer = Detokenizer(self.tokens)

    def add(self, token_ids: list[int], logprobs: list[float], finish: str | None) -> bool:
        """Take the engine's next tokens; answers True when a stop string ended the choice
        (the engine should stop sampling it)."""
        if self.finish_reason:
            return False
        if finish == "abort":
            self.finish_reason = finish
            return False
        # An engine "stop" means the last token is eos: sampled, but not text.
        eos = len(token_ids) - 1 if finish == "stop" else -1
        if not self.incremental:
            self.token_ids += token_ids
            self.logprobs += logprobs
            self.text = self.tokens.decode(token_ids[:eos] if eos >= 0 else token_ids)
            self.finish_reason = finish
            return False
        assert self.detokenizer is not None
        for i, (token, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            if i != eos and self._extend(self.detokenizer.add(token)):
                return True
        if finish:
            if self._extend(self.detokenizer.flush()):
                return True
            self.finish_reason = finish
        return False

    def _extend(self, new: str) -> bool:
        if not new:
            return False
        checked = len(self.text)
        self.text += new
        hits = [
            (at, s)
            for s in self.stops
            if (at := self.text.find(s, max(0, checked - len(s) + 1))) >= 0
        ]
        if not hits:
            return False
        at, self.stop_reason = min(hits)
        self.text = self.text[:at]
        self.finish_reason = "stop"
        return True

    def visible(self) -> int:
        """How much of the text a stream may show now: not what may still turn out to be
        a stop string, nor anything from a tool call on (it may parse into tool_calls)."""
        text = self.text
        if self.finish_reason:
            return len(text)
        end = len(text) - max((_partial_suffix(text, s) for s in self.stops), default=0)
        if self.parse_tools:
            marker = text.find(TOOL_CALL_START)
            if marker < 0:
                marker = len(text) - _partial_suffix(text, TOOL_CALL_START)
            end = min(end, marker)
            # The newline before a tool call belongs to the template, not to the content.
            if text[:end].endswith("\n"):
                end -= 1
        return max(end, self.shown)

    def take_text(self) -> str:
        end = self.visible()
        text, self.shown = self.text[self.shown : end], max(self.shown, end)
        return text

    def emit(self) -> tuple[str, list[dict[str, Any]] | None]:
        """What a stream shows after the latest tokens: new content, and, once the
        choice is over and its text parses, the tool calls (with the content before
        them that was still held back)."""
        if self.finish_reason:
            content, tool_calls = self.message()
            if tool_calls:
                text = (content or "")[self.shown :]
                self.shown = len(self.text)
                return text, tool_calls
        return self.take_text(), None

    def message(self) -> tuple[str | None, list[dict[str, Any]] | None]:
        parsed = parse_tool_calls(self.text) if self.parse_tools else None
        if parsed is None:
            return self.text, None
        return parsed

    def final_reason(self, tool_calls: list[dict[str, Any]] | None) -> str | None:
        return "tool_calls" if tool_calls else self.finish_reason


def _partial_suffix(text: str, pattern: str) -> int:
    """The length of the longest end of ``text`` that begins ``pattern`` (not all of it)."""
    for k in range(min(len(pattern) - 1, len(text)), 0, -1):
        if text.endswith(pattern[:k]):
            return k
    return 0


# ------------------------------------------------------------------------------ server


class ChatServer:
    """The routes, around one engine serving one model under one name."""

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str) -> None:
        self.engine = engine
        self.tokens = TokenCodec(tokenizer)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={ApiError: _api_error, 404: _not_found, 405: _not_allowed},
        )

    async def health(self, request: Request) -> Response:
        engine = self.engine
        return _json(
            {
                "status": "ok",
                "model": self.model_name,
                "policy_version": engine.policy_version,
                "running": engine.running,
                "stats": dataclasses.asdict(engine.stats),
            }
        )

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "agl",
            "max_model_len": self.engine.max_context,
        }
        return _json({"object": "list", "data": [card]})

    async def chat(self, request: Request) -> Response:
        body = await _json_body(request)
        chat = parse_request(body, self.model_name, self.engine.max_batch_size)
        prompt_ids = self._prompt(chat.messages, chat.tools)
        params = self._params(chat.params, chat.max_tokens, prompt_ids, "the messages")
        incremental = chat.stream or bool(chat.stop)
        try:
            generation = self.engine.submit(prompt_ids, params, stream=incremental)
        except EngineError as error:  # closed: the server is shutting down
            return error_response(503, str(error))
        outputs = [
            ChoiceOutput(i, self.tokens, chat.stop, chat.parse_tools, incremental=incremental)
            for i in range(params.n)
        ]
        try:
            if chat.stream:
                return await self._stream(chat, generation, prompt_ids, outputs)
            return await self._unary(chat, generation, prompt_ids, outputs)
        except EngineError as error:
            return error_response(500, f"generation failed: {error}")
        finally:
            if not chat.stream and not generation.finished:
                generation.cancel()

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``: a text completion of one prompt, as vLLM answers it."""
        body = await _json_body(request)
        text = parse_completion_request(body, self.model_name, self.engine.max_batch_size)
        prompt_ids = self._completion_prompt(text.prompt, text.add_special_tokens)
        max_tokens = text.max_tokens
        if max_tokens is None:  # the default cap, or what the context leaves of it
            max_tokens = max(
                1, min(COMPLETION_MAX_TOKENS, self.engine.max_context - len(prompt_ids))
            )
        params = self._params(text.params, max_tokens, prompt_ids, "the prompt")
        incremental = text.stream or bool(text.stop)
        try:
            generation = self.engine.submit(prompt_ids, params, stream=incremental)
        except EngineError as error:
            return error_response(503, str(error))
        outputs = [
            ChoiceOutput(i, self.tokens, text.stop, parse_tools=False, incremental=incremental)
            for i in range(params.n)
        ]
        try:
            if text.stream:
                return await self._stream_text(text, generation, prompt_ids, outputs)
            await _collect(generation, outputs, bool(text.stop))
            return self._text_answer(text, generation, prompt_ids, outputs)
        except EngineError as error:
            return error_response(500, f"generation failed: {error}")
        finally:
            if not text.stream and not generation.finished:
                generation.cancel()

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` as vLLM serves it: ``messages`` (rendered with the chat
        template, as a chat completion would be) or ``prompt``; answers ``count``,
        ``tokens`` and ``max_model_len``."""
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if "messages" in body:
            chat = parse_request(body, self.model_name, self.engine.max_batch_size)
            add_generation_prompt = _optional(body, "add_generation_prompt", bool) is not False
            tokens = self._prompt(chat.messages, chat.tools, add_generation_prompt)
        else:
            special = _optional(body, "add_special_tokens", bool) is not False
            tokens = self._completion_prompt(_one_prompt(body.get("prompt")), special)
        return _json(
            {"count": len(tokens), "tokens": tokens, "max_model_len": self.engine.max_context}
        )

    def _prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as error:  # jinja: a conversation this template cannot render
            raise ApiError(
                400, f"the chat template cannot render these messages: {error}"
            ) from None
        return self.tokens.encode_prompt(text)

    def _completion_prompt(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.tokens.encode_text(prompt, add_special_tokens)
        vocabulary = len(self.tokenizer)
        bad = next((t for t in prompt if not 0 <= t < vocabulary), None)
        if bad is not None:
            raise ApiError(
                400, f"prompt token id {bad} is not in the vocabulary (0-{vocabulary - 1})"
            )
        return list(prompt)

    def _params(
        self, p: SamplingParams, max_tokens: int | None, prompt_ids: list[int], what: str
    ) -> SamplingParams:
        context = self.engine.max_context
        room = context - len(prompt_ids)
        if room < 1:
            raise ApiError(
                400,
                f"this model's maximum context length is {context} tokens; {what} "
                f"have {len(prompt_ids)}",
            )
        if max_tokens is not None and max_tokens > room:
            raise ApiError(
                400,
                f"this model's maximum context length is {context} tokens; you requested "
                f"{len(prompt_ids) + max_tokens} ({len(prompt_ids)} in {what}, "
                f"{max_tokens} in the completion)",
            )
        return dataclasses.replace(p, max_tokens=max_tokens or room)

    async def _unary(
        self,
        chat: ChatRequest,
        generation: Generation,
        prompt_ids: list[int],
        outputs: list[ChoiceOutput],
    ) -> Response:
        await _collect(generation, outputs, bool(chat.stop))
        choices = []
        for out in outputs:
            content, tool_calls = out.message()
            choice: dict[str, Any] = {
                "index": out.index,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": tool_calls or [],
                },
                "logprobs": self._logprobs(out.token_ids, out.logprobs)
                if chat.want_logprobs
                else None,
                "finish_reason": out.final_reason(tool_calls),
                "stop_reason": out.stop_reason,
            }
            if chat.want_token_ids:
                choice["token_ids"] = out.token_ids
            choices.append(choice)
        answer: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(prompt_ids, outputs),
        }
        if chat.want_token_ids:
            answer["prompt_token_ids"] = prompt_ids
        return _json(answer, headers=_version_header(generation))

    async def _stream(
        self,
        chat: ChatRequest,
        generation: Generation,
        prompt_ids: list[int],
        outputs: list[ChoiceOutput],
    ) -> Response:
        deltas, first = await _first_deltas(generation)
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_name,
        }
        role = [
            {
                "index": o.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for o in outputs
        ]
        opening = {**head, "choices": role}
        if chat.want_token_ids:
            opening["prompt_token_ids"] = prompt_ids
        return _event_stream(
            generation,
            deltas,
            first,
            head,
            lambda delta: self._step(chat, generation, outputs, delta),
            (lambda: _usage(prompt_ids, outputs)) if chat.include_usage else None,
            opening,
        )

    def _step(
        self, chat: ChatRequest, generation: Generation, outputs: list[ChoiceOutput], delta: Any
    ) -> list[dict[str, Any]]:
        """The chunk choices one engine delta turns into: its tokens (with the text now
        safe to show), then, if the choice ended, a closing one with its finish reason."""
        out = outputs[delta.index]
        if out.finish_reason:
            return []
        before = len(out.token_ids)
        if out.add(delta.token_ids, delta.logprobs, delta.finish_reason):
            generation.cancel(delta.index)
        new_ids = out.token_ids[before:]
        text, tool_calls = out.emit()
        chunks = []
        if new_ids or (text and not tool_calls):
            chunk: dict[str, Any] = {
                "index": out.index,
                "delta": {"content": text} if text and not tool_calls else {},
                "logprobs": self._logprobs(new_ids, out.logprobs[before:])
                if chat.want_logprobs
                else None,
                "finish_reason": None,
            }
            if chat.want_token_ids:
                chunk["token_ids"] = new_ids
            chunks.append(chunk)
        if out.finish_reason:
            closing: dict[str, Any] = {"index": out.index, "delta": {}, "logprobs": None}
            if tool_calls:
                calls = [{"index": k, **call} for k, call in enumerate(tool_calls)]
                closing["delta"] = (
                    {"content": text, "tool_calls": calls} if text else {"tool_calls": calls}
                )
            closing["finish_reason"] = out.final_reason(tool_calls)
            if chat.want_token_ids:
                closing["token_ids"] = []
            chunks.append(closing)
        return chunks

    def _text_answer(
        self,
        text: CompletionRequest,
        generation: Generation,
        prompt_ids: list[int],
        outputs: list[ChoiceOutput],
    ) -> Response:
        choices = []
        for out in outputs:
            choice: dict[str, Any] = {
                "index": out.index,
                "text": out.text,
                "logprobs": self._text_logprobs(out.token_ids, out.logprobs, 0)
                if text.logprobs is not None
                else None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            if text.want_token_ids:
                choice["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = out.token_ids
            choices.append(choice)
        answer = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(prompt_ids, outputs),
        }
        return _json(answer, headers=_version_header(generation))

    async def _stream_text(
        self,
        text: CompletionRequest,
        generation: Generation,
        prompt_ids: list[int],
        outputs: list[ChoiceOutput],
    ) -> Response:
        deltas, first = await _first_deltas(generation)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        offsets = [0] * len(outputs)  # text_offset of each choice's next token
        opened = [False] * len(outputs)  # each choice's first chunk carries the prompt ids

        def step(delta: Any) -> list[dict[str, Any]]:
            out = outputs[delta.index]
            if out.finish_reason:
                return []
            before = len(out.token_ids)
            if out.add(delta.token_ids, delta.logprobs, delta.finish_reason):
                generation.cancel(delta.index)
            new_ids = out.token_ids[before:]
            new_text = out.take_text()
            if not (new_ids or new_text or out.finish_reason):
                return []
            choice: dict[str, Any] = {
                "index": out.index,
                "text": new_text,
                "logprobs": None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            if text.logprobs is not None:
                logprobs = self._text_logprobs(new_ids, out.logprobs[before:], offsets[out.index])
                offsets[out.index] += sum(len(t) for t in logprobs["tokens"])
                choice["logprobs"] = logprobs
            if text.want_token_ids:
                if not opened[out.index]:
                    choice["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = new_ids
            opened[out.index] = True
            return [choice]

        return _event_stream(
            generation,
            deltas,
            first,
            head,
            step,
            (lambda: _usage(prompt_ids, outputs)) if text.include_usage else None,
        )

    def _text_logprobs(
        self, token_ids: list[int], logprobs: list[float], offset: int
    ) -> dict[str, Any]:
        """Completions-style logprobs. The engine keeps the sampled token's logprob only,
        so ``top_logprobs`` holds that one token whatever number was asked (vLLM's
        answer to ``logprobs: 0``)."""
        tokens, offsets = [], []
        for token in token_ids:
            piece, _ = self.tokens.entry(token)
            tokens.append(piece)
            offsets.append(offset)
            offset += len(piece)
        return {
            "text_offset": offsets,
            "token_logprobs": list(logprobs),
            "tokens": tokens,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)],
        }

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        content = []
        for token, logprob in zip(token_ids, logprobs, strict=True):
            text, raw = self.tokens.entry(token)
            content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": []})
        return {"content": content}


async def _json_body(request: Request) -> Any:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None


async def _collect(generation: Generation, outputs: list[ChoiceOutput], stops: bool) -> None:
    """Run a unary generation to its end into ``outputs``."""
    if stops:  # stop strings are found token by token, as the text grows
        async for batch in generation.deltas():
            for delta in batch:
                if outputs[delta.index].add(delta.token_ids, delta.logprobs, delta.finish_reason):
                    generation.cancel(delta.index)
    else:
        for choice in await generation.wait():
            outputs[choice.index].add(choice.token_ids, choice.logprobs, choice.finish_reason)


async def _first_deltas(
    generation: Generation,
) -> tuple[AsyncIterator[list[Delta]], list[Delta]]:
    """A stream's deltas and the first of them. A stream answers only once the first
    tokens are there: by then the request is admitted, so the policy version is known (a
    header), and an engine failure is a plain 500."""
    deltas = generation.deltas()
    try:
        first = await anext(deltas)
    except BaseException:
        if not generation.finished:  # cancelled: the client went away meanwhile
            generation.cancel()
        raise
    return deltas, first


def _stream_error(error: EngineError) -> bytes:
    return _sse(error_body(500, f"generation failed: {error}"))


def _usage(prompt_ids: list[int], outputs: list[ChoiceOutput]) -> dict[str, int]:
    completion = sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }


def _version_header(generation: Generation) -> dict[str, str]:
    if generation.policy_version is None:
        return {}
    return {POLICY_VERSION_HEADER: str(generation.policy_version)}


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(payload), status_code=status, media_type="application/json", headers=headers
    )


def _event_stream(
    generation: Generation,
    deltas: AsyncIterator[list[Delta]],
    first: list[Delta] | None,
    head: dict[str, Any],
    choices: Callable[[Any], list[dict[str, Any]]],
    usage: Callable[[], dict[str, Any]] | None,
    opening: dict[str, Any] | None = None,
) -> StreamingResponse:
    """The event stream of a generation, chat or text: ``opening``, then each engine
    delta's ``choices`` one per chunk, the usage chunk if asked, ``[DONE]``.

    One choice per chunk, as vLLM streams: clients read ``choices[0]`` only, so a chunk
    holding a choice's last tokens and then its finish_reason would hide the end (Qwen
    Code, OpenCode never saw it). An engine error ends the stream without ``[DONE]``: a
    proxy must see a broken stream, not a short answer.
    """

    async def events() -> AsyncIterator[bytes]:
        try:
            if opening is not None:
                yield _sse(opening)
            batch = first
            while batch is not None:
                for delta in batch:
                    for choice in choices(delta):
                        yield _sse({**head, "choices": [choice]})
                batch = await anext(deltas, None)
            if usage is not None:
                yield _sse({**head, "choices": [], "usage": usage()})
            yield b"data: [DONE]\n\n"
        except EngineError as error:
            yield _stream_error(error)
        finally:
            if not generation.finished:  # the client went away
                generation.cancel()

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", **_version_header(generation)},
    )


def _sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    return error.response()


async def _not_found(request: Request, error: Exception) -> Response:
    return error_response(404, f"no route {request.method} {request.url.path}")


async def _not_allowed(request: Request, error: Exception) -> Response:
    return error_response(405, f"method {request.method} not allowed on {request.url.path}")


def create_app(engine: Engine, tokenizer: Any, model_name: str) -> Starlette:
    """The ASGI app serving ``engine``'s model as ``model_name``."""
    return ChatServer(engine, tokenizer, model_name).app()
