"""Request bodies: read as JSON and validated into the fields the endpoints use; what is
wrong answers as an ``ApiError`` (4xx) saying so, in vLLM's and OpenAI's terms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request

from agl.backends.inference.engine import SamplingParams
from agl.core.contracts.text_rule import TextRule, TextRuleError, parse_text_rule
from agl.core.http_errors import ApiError

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


async def read_json_body(request: Request) -> Any:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    params: SamplingParams
    max_tokens: int | None  # as asked (None: what the context leaves)
    stop: tuple[str, ...]
    text_rule: TextRule
    stream: bool
    include_usage: bool
    want_logprobs: bool
    want_token_ids: bool


def parse_chat_request(body: object, model_name: str, max_batch_size: int) -> ChatRequest:
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
    max_tokens = optional_field(body, "max_completion_tokens", int, minimum=1)
    if max_tokens is None:
        max_tokens = optional_field(body, "max_tokens", int, minimum=1)
    return ChatRequest(
        messages=messages,
        tools=tools or None,
        parse_tools=bool(tools) and tool_choice != "none",
        params=_sampling(body, max_batch_size),
        max_tokens=max_tokens,
        stop=_stops(body.get("stop")),
        text_rule=_text_rule(body),
        stream=bool(optional_field(body, "stream", bool)),
        include_usage=_include_usage(body),
        want_logprobs=bool(optional_field(body, "logprobs", bool)),
        want_token_ids=bool(optional_field(body, "return_token_ids", bool)),
    )


def _sampling(body: dict[str, Any], max_batch_size: int) -> SamplingParams:
    """The sampling fields chat and text completions share; ``max_tokens`` is set once
    the prompt is known."""
    temperature = optional_field(body, "temperature", float, minimum=0.0)
    top_p = optional_field(body, "top_p", float)
    if top_p is not None and not 0 < top_p <= 1:
        raise ApiError(400, "'top_p' must be in (0, 1]")
    top_k = optional_field(body, "top_k", int, minimum=-1)  # vLLM's: -1 or 0 is off
    n = optional_field(body, "n", int, minimum=1)
    if n is not None and n > max_batch_size:
        raise ApiError(400, f"'n' must be at most {max_batch_size} (the batch size)")
    return SamplingParams(
        max_tokens=1,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k or 0, 0),
        seed=optional_field(body, "seed", int),
        n=n or 1,
        ignore_eos=bool(optional_field(body, "ignore_eos", bool)),
    )


def _text_rule(body: dict[str, Any]) -> TextRule:
    try:
        return parse_text_rule(body)
    except TextRuleError as error:
        raise ApiError(400, str(error)) from None


def _include_usage(body: dict[str, Any]) -> bool:
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "'stream_options' must be an object")
    return bool(optional_field(stream_options, "include_usage", bool))


# vLLM's (and OpenAI's) default cap of a text completion, when the request sets none.
COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    add_special_tokens: bool
    params: SamplingParams
    max_tokens: int | None  # as asked (None: COMPLETION_MAX_TOKENS, or what fits)
    stop: tuple[str, ...]
    text_rule: TextRule
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
        prompt=parse_prompt(body.get("prompt")),
        add_special_tokens=optional_field(body, "add_special_tokens", bool) is not False,
        params=_sampling(body, max_batch_size),
        max_tokens=optional_field(body, "max_tokens", int, minimum=1),
        stop=_stops(body.get("stop")),
        text_rule=_text_rule(body),
        stream=bool(optional_field(body, "stream", bool)),
        include_usage=_include_usage(body),
        logprobs=optional_field(body, "logprobs", int, minimum=0),
        want_token_ids=bool(optional_field(body, "return_token_ids", bool)),
    )


def parse_prompt(prompt: object) -> str | list[int]:
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


def optional_field(body: dict[str, Any], key: str, kind: type, minimum: float | None = None) -> Any:
    """``body[key]`` as a ``kind`` (bool, int or float), at least ``minimum`` if given;
    None when absent or null."""
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
