"""OpenAI's Responses API (``POST /v1/responses``, what Codex CLI speaks) over chat
completions.

Request: ``instructions`` and the leading system/developer messages become one system
message; ``input`` items become chat messages (``function_call`` items join the assistant
message before them, ``function_call_output`` items become tool messages, ``reasoning``
items are dropped). ``function`` tools map one to one; a ``custom`` (free-form) tool
becomes a function taking one string, ``input``, and the model's call of it goes back as
a ``custom_tool_call``. A ``namespace`` tool is flattened into its function and custom
tools: each keeps its bare name in chat (``namespace.name`` where two would clash), and
its calls go back with the bare ``name`` and the ``namespace`` field, as Codex routes
them. ``additional_tools`` input items (Codex lists its tools there for its own models)
add their tools to the request's. Tools that run on OpenAI's side (``web_search``,
``file_search``, ...) are left out with one log line per kind: the model behind this
gateway cannot call them. Refused (400): state this gateway does not keep
(``previous_response_id``, ``conversation``, ``prompt``, ``background``), non-text
content, input items other than the above.

Answer: a ``response`` object, or its event stream ending in ``response.completed``
(``response.incomplete`` when the answer was cut at ``max_output_tokens``, as OpenAI
sends it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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

NAME = "responses"

# Fields the translation carries over; every other one is ignored with a log line.
_CARRIED = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "parallel_tool_calls",
    "text",
}

# Fields that ask for state kept between calls: without it no answer would be right.
_STATEFUL = {
    "previous_response_id": "previous_response_id cannot be honoured: this gateway keeps no "
    "responses; send the whole conversation in 'input' (store=false)",
    "conversation": "conversation cannot be honoured: this gateway keeps no conversations; "
    "send the whole conversation in 'input'",
    "prompt": "prompt (a stored prompt template) cannot be honoured: this gateway keeps no "
    "prompts; send 'instructions' and 'input' instead",
    "background": "background responses cannot be honoured: this gateway keeps no "
    "responses to poll",
}

# The schema of the one argument a custom (free-form) tool becomes as a chat function.
_CUSTOM_INPUT = "input"

_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


class Responses:
    name = NAME

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise DialectError(400, "a response request is a JSON object")
        for key, message in _STATEFUL.items():
            if body.get(key):
                raise DialectError(400, message)
        ignored = {k for k in body if k not in _CARRIED and k not in _STATEFUL}
        toolset = _toolset(body, ignored)
        messages = _instructions(body.get("instructions")) + _input(
            body.get("input"), ignored, toolset
        )
        chat: dict[str, Any] = {"model": body.get("model"), "messages": _lead_system(messages)}
        choice, tools = _tool_choice(body.get("tool_choice"), toolset)
        if tools:
            chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
        for ours, theirs in (
            ("max_output_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("parallel_tool_calls", "parallel_tool_calls"),
        ):
            if body.get(ours) is not None:
                chat[theirs] = body[ours]
        response_format = _response_format(body.get("text"), ignored)
        if response_format is not None:
            chat["response_format"] = response_format
        if body.get("stream"):
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        note_ignored(NAME, ignored)
        return chat

    def from_chat(self, answer: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
        outcome = outcome_of(answer, "call_")
        toolset = _toolset(request)
        ids = [_new_item_id(b, toolset) for b in outcome.blocks]
        return _response(request, new_id("resp_"), int(time.time()), outcome, ids)

    def stream(self, request: dict[str, Any]) -> ResponsesStream:
        return ResponsesStream(request)

    def error_body(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> dict[str, Any]:
        return error_body(
            status,
            message,
            type=_ERROR_TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            param=param,
            code=code or ("rate_limit_exceeded" if status == 429 else None),
        )


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}

RESPONSES = Responses()


# --- request -------------------------------------------------------------------------


def _instructions(instructions: Any) -> list[dict[str, Any]]:
    if instructions is None or instructions == "":
        return []
    if isinstance(instructions, str):
        return [{"role": "system", "content": instructions}]
    raise DialectError(400, "'instructions' must be a string")


def _input(items: Any, ignored: set[str], toolset: _Toolset) -> list[dict[str, Any]]:
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise DialectError(400, "'input' must be a string or a list of items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise DialectError(400, f"{where} is not an object")
        kind = item.get("type") or "message"
        if kind == "reasoning":
            # A chat template has no place for earlier reasoning (most drop it anyway).
            ignored.add("input reasoning items")
            continue
        if kind == _ADDITIONAL_TOOLS:
            continue  # its tools are in the toolset: chat lists tools once, per request
        convert = _ITEMS.get(kind)
        if convert is None:
            raise DialectError(
                400,
                f"{where}: items of type {kind!r} cannot be translated to chat completions "
                f"(supported: {', '.join(sorted([*_ITEMS, 'reasoning', _ADDITIONAL_TOOLS]))})",
            )
        convert(item, messages, where, toolset)
    return messages


def _message(
    item: dict[str, Any], messages: list[dict[str, Any]], where: str, toolset: _Toolset
) -> None:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise DialectError(400, f"{where}: unknown message role {role!r}")
    # Chat templates know no developer role; it is OpenAI's new name for system.
    role = "system" if role == "developer" else role
    messages.append({"role": role, "content": _text(item.get("content"), where)})


def _function_call(
    item: dict[str, Any], messages: list[dict[str, Any]], where: str, toolset: _Toolset
) -> None:
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise DialectError(400, f"{where}: 'arguments' must be a string of JSON")
    _append_call(messages, _call_id(item, where), _called(item, where, toolset), arguments)


def _custom_call(
    item: dict[str, Any], messages: list[dict[str, Any]], where: str, toolset: _Toolset
) -> None:
    text = item.get("input", "")
    if not isinstance(text, str):
        raise DialectError(400, f"{where}: 'input' must be a string")
    # The same JSON the model writes for the function this tool becomes (see _tools).
    arguments = json.dumps({_CUSTOM_INPUT: text}, ensure_ascii=False)
    _append_call(messages, _call_id(item, where), _called(item, where, toolset), arguments)


def _called(item: dict[str, Any], where: str, toolset: _Toolset) -> str:
    """The chat name of the tool a call item names (with its ``namespace``, if any)."""
    namespace = item.get("namespace")
    return toolset.chat_name(_name(item, where), namespace if isinstance(namespace, str) else None)


def _call_output(
    item: dict[str, Any], messages: list[dict[str, Any]], where: str, toolset: _Toolset
) -> None:
    content = _text(item.get("output"), f"{where}.output")
    messages.append({"role": "tool", "tool_call_id": _call_id(item, where), "content": content})


_ITEMS: dict[str, Callable[[dict[str, Any], list[dict[str, Any]], str, _Toolset], None]] = {
    "message": _message,
    "function_call": _function_call,
    "function_call_output": _call_output,
    "custom_tool_call": _custom_call,
    "custom_tool_call_output": _call_output,
}


def _append_call(messages: list[dict[str, Any]], call_id: str, name: str, arguments: str) -> None:
    """A call joins the assistant message before it: chat has one assistant turn with text
    and all its tool calls, where Responses has an item for each."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise DialectError(400, f"{where}: 'call_id' is missing")
    return call_id


def _name(item: dict[str, Any], where: str) -> str:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise DialectError(400, f"{where}: 'name' is missing")
    return name


def _text(content: Any, where: str) -> str:
    """Text content, a string or a list of text parts (joined by newlines, as vLLM joins
    a chat message's text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DialectError(400, f"{where}: content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None or not isinstance(part.get(key), str):
            raise DialectError(
                400,
                f"{where}[{j}]: {kind!r} content cannot be translated: the chat model behind "
                "this gateway takes text only (input_text, output_text)",
            )
        texts.append(part[key])
    return "\n".join(texts)


def _lead_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Instructions and the system/developer messages right after them as one system
    message: many chat templates accept a single system message, and only first."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    if lead < 2:
        return messages
    merged = "\n\n".join(m["content"] for m in messages[:lead])
    return [{"role": "system", "content": merged}, *messages[lead:]]


_ADDITIONAL_TOOLS = "additional_tools"
_NAMESPACE = "namespace"


@dataclass(frozen=True)
class _Tool:
    """A tool the model may call, as the harness named it."""

    name: str
    namespace: str | None
    custom: bool
    function: dict[str, Any]  # its chat function (name filled in by _toolset)


@dataclass
class _Toolset:
    """The request's callable tools as chat functions, and the way back from a chat name
    to the tool's name, namespace and kind."""

    tools: list[_Tool] = field(default_factory=list)
    by_chat_name: dict[str, _Tool] = field(default_factory=dict)
    chat_names: dict[tuple[str | None, str], str] = field(default_factory=dict)

    def chat_name(self, name: str, namespace: str | None) -> str:
        return self.chat_names.get((namespace, name), name)

    def functions(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {**t.function, "name": self.chat_name(t.name, t.namespace)},
            }
            for t in self.tools
        ]

    def find(self, chat_name: str) -> _Tool | None:
        return self.by_chat_name.get(chat_name)


def _toolset(body: dict[str, Any], ignored: set[str] | None = None) -> _Toolset:
    """The tools of ``body["tools"]`` and of its ``additional_tools`` input items,
    namespaces flattened. A bare name is the chat name unless two tools share it; then
    each becomes ``namespace.name``."""
    ignored = set() if ignored is None else ignored
    listed: dict[tuple[str | None, str], _Tool] = {}
    for where, tools in _tool_lists(body):
        for i, tool in enumerate(tools):
            for found in _tool(tool, f"{where}[{i}]", None, ignored):
                listed[(found.namespace, found.name)] = found  # a later listing replaces one
    toolset = _Toolset(tools=list(listed.values()))
    bare = [t.name for t in toolset.tools]
    for t in toolset.tools:
        chat = (
            t.name if bare.count(t.name) == 1 or t.namespace is None else f"{t.namespace}.{t.name}"
        )
        toolset.chat_names[(t.namespace, t.name)] = chat
        toolset.by_chat_name[chat] = t
    for t in toolset.tools:  # a model may write the qualified name of a tool anyway
        if t.namespace is not None:
            toolset.by_chat_name.setdefault(f"{t.namespace}.{t.name}", t)
    return toolset


def _tool_lists(body: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    lists: list[tuple[str, list[Any]]] = []
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise DialectError(400, "'tools' must be a list")
        lists.append(("tools", tools))
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if isinstance(item, dict) and item.get("type") == _ADDITIONAL_TOOLS:
            extra = item.get("tools")
            if not isinstance(extra, list):
                raise DialectError(400, f"input[{i}].tools must be a list")
            lists.append((f"input[{i}].tools", extra))
    return lists


def _tool(tool: Any, where: str, namespace: str | None, ignored: set[str]) -> list[_Tool]:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind == "function":
        return [_Tool(_name(tool, where), namespace, False, _function(tool, where))]
    if kind == "custom":
        return [_Tool(_name(tool, where), namespace, True, _custom_function(tool, where))]
    if kind == _NAMESPACE and namespace is None:
        inner = tool.get("tools")
        if not isinstance(inner, list):
            raise DialectError(400, f"{where}.tools must be a list")
        if tool.get("description"):
            ignored.add("namespace descriptions")
        name = _name(tool, where)
        return [
            t for j, x in enumerate(inner) for t in _tool(x, f"{where}.tools[{j}]", name, ignored)
        ]
    if isinstance(kind, str) and kind != _NAMESPACE:
        # web_search, file_search, code_interpreter, image_generation, mcp, local_shell...:
        # OpenAI runs them, or they come back as items of their own. The model behind
        # this gateway cannot call them; the harness goes on with its other tools.
        ignored.add(f"tools of type {kind}")
        return []
    raise DialectError(
        400,
        f"{where}: a tool needs a type: 'function', 'custom' or 'namespace' (of those two)",
    )


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    function = {
        "name": _name(tool, where),
        "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
    }
    if tool.get("description"):
        function["description"] = tool["description"]
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return function


def _custom_function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A free-form tool as a function of one string. Its grammar, if any, is told to the
    model in words: chat completions cannot constrain one argument to a grammar."""
    described = "The tool's input: free text, not JSON."
    grammar = tool.get("format") or {}
    if grammar.get("type") == "grammar":
        described += (
            f" It must follow this {grammar.get('syntax', '')} grammar:\n"
            f"{grammar.get('definition', '')}"
        )
    function: dict[str, Any] = {
        "name": _name(tool, where),
        "parameters": {
            "type": "object",
            "properties": {_CUSTOM_INPUT: {"type": "string", "description": described}},
            "required": [_CUSTOM_INPUT],
        },
    }
    if tool.get("description"):
        function["description"] = tool["description"]
    return function


def _tool_choice(
    choice: Any, toolset: _Toolset
) -> tuple[str | dict[str, Any] | None, list[dict[str, Any]]]:
    tools = toolset.functions()
    if choice is None or choice in ("none", "auto", "required"):
        return choice, tools
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        name = toolset.chat_name(choice["name"], choice.get("namespace"))
        return {"type": "function", "function": {"name": name}}, tools
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required"):
        # Chat completions has no allowed list: the other tools are left out instead.
        allowed = {
            toolset.chat_name(t["name"], t.get("namespace"))
            for t in choice.get("tools") or ()
            if isinstance(t, dict) and isinstance(t.get("name"), str)
        }
        return choice["mode"], [t for t in tools if t["function"]["name"] in allowed]
    raise DialectError(
        400,
        f"tool_choice {choice!r} cannot be translated: use 'none', 'auto', 'required', "
        "a function or custom tool by name, or allowed_tools",
    )


def _response_format(text: Any, ignored: set[str]) -> dict[str, Any] | None:
    if not isinstance(text, dict):
        return None
    ignored.update(f"text.{k}" for k in text if k != "format")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise DialectError(400, f"text.format of type {kind!r} cannot be translated")


# --- answer --------------------------------------------------------------------------

# The request fields a response object repeats back.
_ECHOED = (
    "instructions",
    "max_output_tokens",
    "metadata",
    "reasoning",
    "store",
    "temperature",
    "text",
    "top_p",
    "truncation",
    "user",
)

_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _shell(request: dict[str, Any], response_id: str, created_at: int) -> dict[str, Any]:
    """The response object as it stands before any output."""
    shell: dict[str, Any] = {k: request[k] for k in _ECHOED if request.get(k) is not None}
    return {
        **shell,
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "model": request.get("model") or "",
        "output": [],
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": request.get("tools") or [],
        "error": None,
        "incomplete_details": None,
        "previous_response_id": None,
        "usage": None,
    }


def _response(
    request: dict[str, Any],
    response_id: str,
    created_at: int,
    outcome: Outcome,
    item_ids: list[str],
) -> dict[str, Any]:
    incomplete = _INCOMPLETE.get(outcome.finish_reason or "")
    toolset = _toolset(request)
    last = len(outcome.blocks) - 1
    output = [
        _item(block, item_id, toolset, "incomplete" if incomplete and i == last else "completed")
        for i, (block, item_id) in enumerate(zip(outcome.blocks, item_ids, strict=True))
    ]
    return {
        **_shell(request, response_id, created_at),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "output": output,
        "usage": _usage(outcome.usage),
    }


def _is_custom(block: Block, toolset: _Toolset) -> bool:
    tool = toolset.find(block.name or "")
    return tool is not None and tool.custom


def _new_item_id(block: Block, toolset: _Toolset) -> str:
    if block.kind == "text":
        return new_id("msg_")
    return new_id("ctc_" if _is_custom(block, toolset) else "fc_")


def _item(block: Block, item_id: str, toolset: _Toolset, status: str) -> dict[str, Any]:
    if block.kind == "text":
        return {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [_text_part(block.text)],
        }
    tool = toolset.find(block.name or "")
    # The harness's own name for the tool: bare, with its namespace beside it (Codex
    # answers "unsupported call" to "namespace.name").
    called: dict[str, Any] = {"name": block.name} if tool is None else {"name": tool.name}
    if tool is not None and tool.namespace is not None:
        called["namespace"] = tool.namespace
    if tool is not None and tool.custom:
        return {
            "id": item_id,
            "type": "custom_tool_call",
            "call_id": block.call_id,
            **called,
            "input": _custom_input(block.text),
        }
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": block.call_id,
        **called,
        "arguments": block.text,
        "status": status,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _custom_input(arguments: str) -> str:
    """A custom tool's input from the function call it was asked as. Arguments that are
    not the expected object are passed on as they are: the model may have written the
    input itself, and the harness then says what is wrong with it."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(parsed, dict) and isinstance(parsed.get(_CUSTOM_INPUT), str):
        return parsed[_CUSTOM_INPUT]
    return arguments


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponsesStream:
    """One streamed answer as Responses events. ``response.created`` goes out with the
    first chunk, so a call that fails before any chunk can still be answered with an
    error status instead of a stream."""

    def __init__(self, request: dict[str, Any]) -> None:
        self._request = request
        self._tools = _toolset(request)
        self._reader = ChunkReader("call_")
        self._id = new_id("resp_")
        self._created_at = int(time.time())
        self._sequence = 0
        self._began = False
        self._item_ids: list[str] = []
        self._open: tuple[Block, str, int] | None = None  # the open item, its id and index
        self._finishing = False

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        events = self._begin()
        for piece in self._reader.feed(chunk):
            events += self._piece(piece)
        return events

    def finish(self) -> list[bytes]:
        events = self._begin()
        self._finishing = True
        for piece in self._reader.finish():
            events += self._piece(piece)
        outcome = self._reader.outcome
        response = _response(self._request, self._id, self._created_at, outcome, self._item_ids)
        done = "response.completed" if response["status"] == "completed" else "response.incomplete"
        events.append(self._event(done, response=response))
        return events

    def fail(self, status: int, message: str) -> list[bytes]:
        events = self._begin()
        response = {
            **_shell(self._request, self._id, self._created_at),
            "status": "failed",
            "error": {"code": "server_error", "message": message},
        }
        events.append(self._event("response.failed", response=response))
        return events

    def _begin(self) -> list[bytes]:
        if self._began:
            return []
        self._began = True
        shell = _shell(self._request, self._id, self._created_at)
        return [
            self._event("response.created", response=shell),
            self._event("response.in_progress", response=shell),
        ]

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(kind, data)

    def _piece(self, piece: Piece) -> list[bytes]:
        if isinstance(piece, Start):
            return self._start(piece.block)
        if isinstance(piece, End):
            return self._end(piece.block)
        assert self._open is not None  # the reader starts a block before its deltas
        block, item_id, index = self._open
        if block.kind == "text":
            where = {"item_id": item_id, "output_index": index, "content_index": 0}
            return [
                self._event("response.output_text.delta", **where, delta=piece.text, logprobs=[])
            ]
        if _is_custom(block, self._tools):
            return []  # its input is whole only once its JSON is (see _end)
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=index,
                delta=piece.text,
            )
        ]

    def _start(self, block: Block) -> list[bytes]:
        item_id = _new_item_id(block, self._tools)
        index = len(self._item_ids)
        self._item_ids.append(item_id)
        self._open = (block, item_id, index)
        item = _item(
            Block(block.kind, "", block.call_id, block.name), item_id, self._tools, "in_progress"
        )
        events = [self._event("response.output_item.added", output_index=index, item=item)]
        if block.kind == "text":
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=_text_part(""),
                )
            )
        return events

    def _end(self, block: Block) -> list[bytes]:
        assert self._open is not None
        _, item_id, index = self._open
        incomplete = self._finishing and _INCOMPLETE.get(self._reader.outcome.finish_reason or "")
        item = _item(block, item_id, self._tools, "incomplete" if incomplete else "completed")
        where = {"item_id": item_id, "output_index": index}
        if block.kind == "text":
            events = [
                self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=block.text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done", **where, content_index=0, part=item["content"][0]
                ),
            ]
        elif _is_custom(block, self._tools):
            events = [
                self._event("response.custom_tool_call_input.delta", **where, delta=item["input"]),
                self._event("response.custom_tool_call_input.done", **where, input=item["input"]),
            ]
        else:
            events = [
                self._event("response.function_call_arguments.done", **where, arguments=block.text)
            ]
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events
