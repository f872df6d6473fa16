"""Anthropic's Messages API (``POST /v1/messages``, what Claude Code speaks) over chat
completions.

Request: ``system`` becomes the system message; each message becomes chat messages in
order (an assistant's text and ``tool_use`` blocks one assistant message with tool calls,
the input JSON-dumped as arguments; each ``tool_result`` a tool message, ``is_error``
said as an ``Error:`` prefix; ``thinking`` blocks dropped). A final assistant message is
a prefill: the model continues it (vLLM's ``continue_final_message``). Custom tools
(``name``, ``description``, ``input_schema``) become functions. Refused (400): a missing
``max_tokens``, images, documents and other non-text blocks, Anthropic's typed tools
(web search, bash, text editor, ...: they run on Anthropic's side or have a schema only
Claude knows), ``mcp_servers``.

Answer: a ``message`` (text block, then ``tool_use`` blocks with the chat tool call's
id and its arguments parsed; arguments that are not a JSON object are kept as
``{"_raw": "<arguments>"}``, so the harness can tell the model its call was malformed),
or the event stream of one. A stream sends a tool call's input whole, as one
``input_json_delta`` when its block ends: a client parses the pieces as it goes, and a
model's malformed JSON would otherwise break the client's stream instead of its tool.
"""

from __future__ import annotations

import json
from typing import Any

from agl.core.gateway.dialects._base import DialectError, note_ignored, sse
from agl.core.gateway.dialects._chat import (
    Block,
    ChunkReader,
    End,
    Outcome,
    Piece,
    Start,
    Usage,
    new_id,
    outcome_of,
)
from agl.core.http_errors import error_body

NAME = "anthropic"

# Fields the translation carries over; every other one is ignored with a log line.
_CARRIED = {
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",  # not OpenAI's, but vLLM's (and the embedded server's)
    "stream",
    "tools",
    "tool_choice",
    "output_config",
    "mcp_servers",  # refused when not empty
}

_DROPPED_BLOCKS = {"thinking", "redacted_thinking"}

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class Anthropic:
    name = NAME

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return _chat(body, counting=False)

    def count_tokens_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat request whose prompt ``POST /v1/messages/count_tokens`` counts: its
        body has no ``max_tokens`` nor sampling fields. The answer is
        ``{"input_tokens": n}``."""
        return _chat(body, counting=True)

    def from_chat(self, answer: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
        outcome = outcome_of(answer, "toolu_")
        return _message(request, new_id("msg_"), outcome)

    def stream(self, request: dict[str, Any]) -> AnthropicStream:
        return AnthropicStream(request)

    def error_body(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> dict[str, Any]:
        # Anthropic's shape is {"type": "error", "error": {"type", "message"}}; the
        # OpenAI fields inside "error" keep it the gateway's one shape as well.
        kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", **error_body(status, message, type=kind, param=param, code=code)}


ANTHROPIC = Anthropic()


# --- request -------------------------------------------------------------------------


def _chat(body: dict[str, Any], counting: bool) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise DialectError(400, "a messages request is a JSON object")
    if body.get("mcp_servers"):
        raise DialectError(
            400,
            "mcp_servers cannot be honoured: Anthropic's API connects to MCP servers, "
            "this gateway does not",
        )
    ignored = {k for k in body if k not in _CARRIED}
    max_tokens = body.get("max_tokens")
    if not counting and (type(max_tokens) is not int or max_tokens < 1):
        raise DialectError(400, "max_tokens: a positive integer is required")
    messages = _system(body.get("system"), ignored) + _messages(body.get("messages"), ignored)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        # A prefill: Anthropic's model continues the last assistant message.
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    tools = _tools(body.get("tools"), ignored)
    if tools:
        chat["tools"] = tools
    chat.update(_tool_choice(body.get("tool_choice")))
    if not counting:
        chat["max_tokens"] = max_tokens
        chat.update(_sampling(body, ignored))
    note_ignored(NAME, ignored)
    return chat


def _sampling(body: dict[str, Any], ignored: set[str]) -> dict[str, Any]:
    chat = {k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    output = body.get("output_config") or {}
    ignored.update(f"output_config.{k}" for k in output if k != "format")
    fmt = output.get("format")
    if fmt:
        if fmt.get("type") != "json_schema":
            raise DialectError(
                400, f"output_config.format of type {fmt.get('type')!r} cannot be translated"
            )
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt.get("schema") or {}},
        }
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _system(system: Any, ignored: set[str]) -> list[dict[str, Any]]:
    if not system:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise DialectError(400, "system: must be a string or a list of text blocks")
    texts = [_text_block(block, f"system[{i}]", ignored) for i, block in enumerate(system)]
    return [{"role": "system", "content": "\n".join(texts)}]


def _messages(messages: Any, ignored: set[str]) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise DialectError(400, "messages: a list of messages is required")
    chat: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise DialectError(400, f"{where} is not an object")
        role, content = message.get("role"), message.get("content")
        if role == "system":
            # Not in Anthropic's documented API, but Claude Code sends such turns in the
            # middle of a conversation (its agent and skill lists); chat has the role.
            chat += _system(content, ignored)
            continue
        if role not in ("user", "assistant"):
            raise DialectError(400, f"{where}: unknown role {role!r} (user, assistant or system)")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise DialectError(400, f"{where}: content must be a string or a list of blocks")
        elif role == "user":
            chat += _user(content, where, ignored)
        else:
            chat.append(_assistant(content, where, ignored))
    return chat


def _user(blocks: list[Any], where: str, ignored: set[str]) -> list[dict[str, Any]]:
    """A user turn in block order: text runs as user messages, tool results as tool
    messages (Anthropic puts results first; chat wants them right after the call)."""
    chat: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        here = f"{where}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            if texts:
                chat.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            chat.append(_tool_result(block, here, ignored))
        else:
            texts.append(_text_block(block, here, ignored))
    if texts:
        chat.append({"role": "user", "content": "\n".join(texts)})
    return chat


def _tool_result(block: dict[str, Any], where: str, ignored: set[str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise DialectError(400, f"{where}: tool_use_id is missing")
    ignored.update(k for k in block if k not in ("type", "tool_use_id", "content", "is_error"))
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(
            _text_block(b, f"{where}.content[{k}]", ignored) for k, b in enumerate(content)
        )
    else:
        raise DialectError(400, f"{where}: content must be a string or a list of blocks")
    if block.get("is_error"):
        # Chat has no error flag on a tool message; the model reads it in the text.
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant(blocks: list[Any], where: str, ignored: set[str]) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        here = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _DROPPED_BLOCKS:
            # Its signature is Anthropic's; the chat model cannot read it back.
            ignored.add(f"{kind} blocks")
        elif kind == "tool_use":
            calls.append(_tool_use(block, here, ignored))
        else:
            texts.append(_text_block(block, here, ignored))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _tool_use(block: dict[str, Any], where: str, ignored: set[str]) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
        raise DialectError(
            400, f"{where}: a tool_use block needs an id, a name and an input object"
        )
    ignored.update(k for k in block if k not in ("type", "id", "name", "input"))
    # Python's separators, as the chat templates' tojson and most models write JSON:
    # the prompt then shows the call as the model wrote it.
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _text_block(block: Any, where: str, ignored: set[str]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind != "text" or not isinstance(block.get("text"), str):
        raise DialectError(
            400,
            f"{where}: {kind!r} blocks cannot be translated: the chat model behind this "
            "gateway takes text only (text, tool_use, tool_result)",
        )
    ignored.update(k for k in block if k not in ("type", "text"))
    return block["text"]


def _tools(tools: Any, ignored: set[str]) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise DialectError(400, "tools: must be a list")
    return [_tool(tool, f"tools[{i}]", ignored) for i, tool in enumerate(tools)]


def _tool(tool: Any, where: str, ignored: set[str]) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise DialectError(400, f"{where} is not an object")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise DialectError(
            400,
            f"{where}: {kind!r} tools cannot be translated: Anthropic runs them or knows "
            "their schema; only custom tools (name, description, input_schema) can be",
        )
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not name or not isinstance(schema, dict):
        raise DialectError(400, f"{where}: a tool needs a name and an input_schema object")
    ignored.update(k for k in tool if k not in ("type", "name", "description", "input_schema"))
    function: dict[str, Any] = {"name": name, "parameters": schema}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> dict[str, Any]:
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    chat: dict[str, Any] = {}
    if kind in _TOOL_CHOICES:
        chat["tool_choice"] = _TOOL_CHOICES[kind]
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise DialectError(
            400, f"tool_choice {choice!r}: expected auto, any, tool (with a name) or none"
        )
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False
    return chat


# --- answer --------------------------------------------------------------------------


def _shell(request: dict[str, Any], message_id: str) -> dict[str, Any]:
    """The message as it stands before any content."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": request.get("model") or "",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
    }


def _message(request: dict[str, Any], message_id: str, outcome: Outcome) -> dict[str, Any]:
    stop_reason, stop_sequence = _stop(outcome, request)
    return {
        **_shell(request, message_id),
        "content": [_content_block(b) for b in outcome.blocks],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(outcome.usage),
    }


def _stop(outcome: Outcome, request: dict[str, Any]) -> tuple[str, str | None]:
    finish = outcome.finish_reason
    if finish == "length":
        return "max_tokens", None
    # vLLM ends a forced (required or named) tool call with "stop": the calls decide.
    if any(b.kind == "tool" for b in outcome.blocks):
        return "tool_use", None
    if finish == "content_filter":
        return "refusal", None
    matched = outcome.matched_stop
    if isinstance(matched, str) and matched in (request.get("stop_sequences") or ()):
        return "stop_sequence", matched
    return "end_turn", None


def _content_block(block: Block) -> dict[str, Any]:
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    return {
        "type": "tool_use",
        "id": block.call_id,
        "name": block.name,
        "input": _input(block.text),
    }


def _input(arguments: str) -> dict[str, Any]:
    if not arguments.strip():
        return {}  # a call without arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"_raw": arguments}


def _usage(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage()
    # Anthropic counts cached prompt tokens apart from input_tokens.
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


class AnthropicStream:
    """One streamed answer as Messages events. ``message_start`` goes out with the first
    chunk, so a call that fails before any chunk can still be answered with an error
    status instead of a stream. Its ``input_tokens`` are the prompt's when vLLM sends the
    prompt's token ids first (``return_token_ids``), else 0 until ``message_delta``."""

    def __init__(self, request: dict[str, Any]) -> None:
        self._request = request
        self._reader = ChunkReader("toolu_")
        self._id = new_id("msg_")
        self._began = False
        self._index = -1  # the open content block's
        self._open: Block | None = None

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        pieces = self._reader.feed(chunk)
        events = self._begin()
        for piece in pieces:
            events += self._piece(piece)
        return events

    def finish(self) -> list[bytes]:
        events = self._begin()
        for piece in self._reader.finish():
            events += self._piece(piece)
        stop_reason, stop_sequence = _stop(self._reader.outcome, self._request)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = _usage(self._reader.outcome.usage)
        events.append(_event("message_delta", delta=delta, usage=usage))
        events.append(_event("message_stop"))
        return events

    def fail(self, status: int, message: str) -> list[bytes]:
        return [*self._begin(), sse("error", ANTHROPIC.error_body(status, message))]

    def _begin(self) -> list[bytes]:
        if self._began:
            return []
        self._began = True
        usage = {"input_tokens": self._reader.prompt_tokens or 0, "output_tokens": 0}
        message = {**_shell(self._request, self._id), "usage": usage}
        return [_event("message_start", message=message)]

    def _piece(self, piece: Piece) -> list[bytes]:
        if isinstance(piece, Start):
            self._index += 1
            self._open = piece.block
            empty = Block(piece.block.kind, "", piece.block.call_id, piece.block.name)
            return [
                _event(
                    "content_block_start", index=self._index, content_block=_content_block(empty)
                )
            ]
        if isinstance(piece, End):
            return self._end(piece.block)
        assert self._open is not None  # the reader starts a block before its deltas
        if self._open.kind == "tool":
            return []  # sent whole at its end (see the module)
        delta = {"type": "text_delta", "text": piece.text}
        return [_event("content_block_delta", index=self._index, delta=delta)]

    def _end(self, block: Block) -> list[bytes]:
        events = []
        if block.kind == "tool":
            arguments = _input(block.text)
            if arguments:
                delta = {
                    "type": "input_json_delta",
                    "partial_json": json.dumps(arguments, ensure_ascii=False),
                }
                events.append(_event("content_block_delta", index=self._index, delta=delta))
        events.append(_event("content_block_stop", index=self._index))
        return events


def _event(kind: str, **fields: Any) -> bytes:
    return sse(kind, {"type": kind, **fields})
