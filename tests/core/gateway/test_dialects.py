"""agl.core.gateway.dialects: the Responses and Messages APIs over chat completions.

Every answer and every streamed event is checked with the official SDKs' own types, a
stream is added up with the SDKs' own accumulators, and the SDK clients themselves talk
to the translation (over an in-process transport) as Codex CLI or Claude Code would."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from agl.core.gateway.dialects import ANTHROPIC, RESPONSES, Dialect, DialectError

RESPONSE_EVENT = TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
USAGE = {"prompt_tokens": 31, "completion_tokens": 17, "total_tokens": 48}


# --- chat answers, whole and in chunks ---------------------------------------------------


def call(name: str, arguments: str, call_id: str | None = "chatcmpl-tool-1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_answer(
    content: str | None = "",
    tool_calls: list[dict[str, Any]] | None = None,
    finish_reason: str | None = None,
    stop_reason: str | None = None,
    usage: dict[str, Any] | None = USAGE,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    finish = finish_reason or ("tool_calls" if tool_calls else "stop")
    choice = {"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop_reason}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "policy",
        "choices": [choice],
        "usage": usage,
    }


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c for c in cuts if 0 < c < len(text)})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True) if text]


def chunks_of(
    answer: dict[str, Any],
    text_cuts: list[int] | None = None,
    argument_cuts: list[list[int]] | None = None,
    name_cuts: list[int] | None = None,
) -> list[dict[str, Any]]:
    """The chunks vLLM streams for ``answer``, the text and each call's arguments cut at
    the given points (one chunk per piece), the usage in a last chunk of its own."""
    choice = answer["choices"][0]
    message = choice["message"]
    head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**head, "choices": [{**choice, **extra}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"content": t}) for t in split(message.get("content") or "", text_cuts or [])]
    for i, tool in enumerate(message.get("tool_calls") or ()):
        function = tool["function"]
        names = split(function["name"], name_cuts or []) or [""]
        cuts = argument_cuts[i] if argument_cuts and i < len(argument_cuts) else []
        pieces = split(function["arguments"], cuts)
        first = {"index": i, "type": "function", "function": {"name": names[0]}}
        if tool["id"]:
            first["id"] = tool["id"]
        deltas = [first] + [{"index": i, "function": {"name": n}} for n in names[1:]]
        deltas += [{"index": i, "function": {"arguments": p}} for p in pieces]
        chunks += [chunk({"tool_calls": [d]}) for d in deltas]
    chunks.append(chunk({}, choice["finish_reason"], stop_reason=choice.get("stop_reason")))
    if answer.get("usage"):
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks


def events_of(raw: list[bytes]) -> list[dict[str, Any]]:
    """Each server-sent event's data; its ``event:`` line names its type."""
    events = []
    for event in raw:
        head, _, rest = event.partition(b"\n")
        assert head.startswith(b"event: ") and rest.startswith(b"data: "), event
        assert rest.endswith(b"\n\n") and rest.count(b"\n") == 2, event
        data = json.loads(rest[6:])
        assert data["type"] == head[7:].decode()
        events.append(data)
    return events


def streamed(
    dialect: Dialect, request: dict[str, Any], chunks: list[dict[str, Any]]
) -> list[bytes]:
    translator = dialect.stream(request)
    raw = [event for c in chunks for event in translator.feed(copy.deepcopy(c))]
    return raw + translator.finish()


# --- the SDK clients, served by the translation ------------------------------------------


def serve(
    dialect: Dialect, answer: dict[str, Any], seen: list[dict[str, Any]]
) -> Callable[..., Any]:
    """An in-process server answering every call with ``answer`` in ``dialect``; what
    the SDK sent and its chat translation go to ``seen``."""

    def handle(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        try:
            chat = dialect.to_chat(body)
        except DialectError as error:
            return httpx2.Response(
                error.status, json=dialect.error_body(error.status, error.message)
            )
        seen.append({"body": body, "chat": chat})
        if not body.get("stream"):
            return httpx2.Response(200, json=dialect.from_chat(copy.deepcopy(answer), body))
        raw = streamed(dialect, body, chunks_of(answer, [3, 7], [[2, 5]] * 4))
        return httpx2.Response(
            200, content=b"".join(raw), headers={"content-type": "text/event-stream"}
        )

    return handle


def openai_client(handler: Callable[..., Any]) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="sk-test",
        base_url="http://gateway.test/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
        max_retries=0,
        _strict_response_validation=True,
    )


def anthropic_client(handler: Callable[..., Any]) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="sk-ant-test",
        base_url="http://gateway.test",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
        max_retries=0,
        _strict_response_validation=True,
    )


@pytest.fixture
def ignored_log(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[str]]]:
    """The dialects' "ignoring ..." lines logged during the test."""
    caplog.set_level(logging.DEBUG, logger="agl.core.gateway.dialects")
    yield lambda: [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]


# --- Responses: requests -----------------------------------------------------------------


def test_responses_string_input_and_instructions() -> None:
    chat = RESPONSES.to_chat({"model": "m", "instructions": "Be brief.", "input": "Hi"})
    assert chat == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }


def test_responses_every_input_item_kind(ignored_log: Callable[[], list[str]]) -> None:
    body = {
        "model": "m",
        "instructions": "You are Codex.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Sandbox: none."}],
            },
            {"role": "system", "content": "Be careful."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "<env/>"},
                    {"type": "input_text", "text": "List files."},
                ],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Listing.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "shell",
                "arguments": '{"cmd": ["ls"]}',
            },
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "shell",
                "arguments": '{"cmd": ["pwd"]}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "/w"}],
            },
            {
                "type": "custom_tool_call",
                "call_id": "c3",
                "name": "apply_patch",
                "input": "*** Begin Patch",
            },
            {"type": "custom_tool_call_output", "call_id": "c3", "output": "Done!"},
            {"type": "message", "role": "developer", "content": "Mid-conversation note."},
            {"role": "user", "content": "Thanks"},
        ],
    }
    assert RESPONSES.to_chat(body)["messages"] == [
        {"role": "system", "content": "You are Codex.\n\nSandbox: none.\n\nBe careful."},
        {"role": "user", "content": "<env/>\nList files."},
        {
            "role": "assistant",
            "content": "Listing.",
            "tool_calls": [
                call("shell", '{"cmd": ["ls"]}', "c1"),
                call("shell", '{"cmd": ["pwd"]}', "c2"),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "/w"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("apply_patch", '{"input": "*** Begin Patch"}', "c3")],
        },
        {"role": "tool", "tool_call_id": "c3", "content": "Done!"},
        {"role": "system", "content": "Mid-conversation note."},
        {"role": "user", "content": "Thanks"},
    ]
    assert any("input reasoning items" in line for line in ignored_log())


def test_responses_tools_and_options(ignored_log: Callable[[], list[str]]) -> None:
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
    body = {
        "model": "m",
        "input": "go",
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "description": "Run.",
                "parameters": schema,
                "strict": False,
            },
            {"type": "function", "name": "noargs"},
            {
                "type": "custom",
                "name": "apply_patch",
                "description": "Patch files.",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
            },
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 256,
        "temperature": 0.5,
        "top_p": 0.9,
        "stream": True,
        "text": {
            "format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True},
            "verbosity": "low",
        },
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "reasoning": {"effort": "high", "summary": "auto"},
        "prompt_cache_key": "k",
        "metadata": {"a": "b"},
    }
    chat = RESPONSES.to_chat(body)
    custom = chat["tools"][2]["function"]
    assert chat["tools"][:2] == [
        {
            "type": "function",
            "function": {
                "name": "shell",
                "parameters": schema,
                "description": "Run.",
                "strict": False,
            },
        },
        {
            "type": "function",
            "function": {"name": "noargs", "parameters": {"type": "object", "properties": {}}},
        },
    ]
    assert custom["name"] == "apply_patch" and custom["description"] == "Patch files."
    assert custom["parameters"]["required"] == ["input"]
    assert "start: /.+/" in custom["parameters"]["properties"]["input"]["description"]
    assert {k: v for k, v in chat.items() if k not in ("messages", "tools")} == {
        "model": "m",
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 256,
        "temperature": 0.5,
        "top_p": 0.9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": schema, "strict": True},
        },
    }
    (line,) = ignored_log()
    for name in ("include", "metadata", "prompt_cache_key", "reasoning", "store", "text.verbosity"):
        assert name in line


@pytest.mark.parametrize(
    ("choice", "expected", "names"),
    [
        ("none", "none", ["a", "b"]),
        (
            {"type": "function", "name": "b"},
            {"type": "function", "function": {"name": "b"}},
            ["a", "b"],
        ),
        (
            {"type": "custom", "name": "b"},
            {"type": "function", "function": {"name": "b"}},
            ["a", "b"],
        ),
        (
            {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "a"}]},
            "auto",
            ["a"],
        ),
    ],
)
def test_responses_tool_choice(choice: Any, expected: Any, names: list[str]) -> None:
    tools = [{"type": "function", "name": "a"}, {"type": "function", "name": "b"}]
    chat = RESPONSES.to_chat({"model": "m", "input": "x", "tools": tools, "tool_choice": choice})
    assert chat["tool_choice"] == expected
    assert [t["function"]["name"] for t in chat["tools"]] == names


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            {"previous_response_id": "resp_1", "input": "x"},
            "send the whole conversation in 'input'",
        ),
        ({"conversation": "conv_1", "input": "x"}, "conversation"),
        ({"background": True, "input": "x"}, "background"),
        ({"prompt": {"id": "pmpt_1"}, "input": "x"}, "stored prompt"),
        ({"input": 3}, "'input' must be a string or a list"),
        ({"input": ["hi"]}, "input[0] is not an object"),
        ({"input": [{"role": "tool", "content": "x"}]}, "unknown message role 'tool'"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}
                ]
            },
            "'input_image'",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "'input_file'",
        ),
        (
            {
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "input_image"}],
                    }
                ]
            },
            "input[0].output[0]: 'input_image'",
        ),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "'call_id' is missing",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
            "string of JSON",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "items of type 'item_reference'"),
        (
            {"input": [{"type": "local_shell_call", "call_id": "c"}]},
            "items of type 'local_shell_call'",
        ),
        ({"input": "x", "tools": [{"name": "f"}]}, "tools[0]: a tool needs a type"),
        (
            {"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": "f"}]},
            "tools[0].tools must be a list",
        ),
        ({"input": [{"type": "additional_tools", "tools": {}}]}, "input[0].tools must be a list"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0]: 'name' is missing"),
        ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ],
)
def test_responses_refuses_what_it_cannot_express(body: dict[str, Any], says: str) -> None:
    with pytest.raises(DialectError) as raised:
        RESPONSES.to_chat({"model": "m", **body})
    assert raised.value.status == 400
    assert says in raised.value.message


def test_responses_false_background_and_null_state_pass() -> None:
    body = {"model": "m", "input": "x", "background": False, "previous_response_id": None}
    assert RESPONSES.to_chat(body)["messages"] == [{"role": "user", "content": "x"}]


# --- Responses: answers ------------------------------------------------------------------


def upstream_ids(answer: dict[str, Any]) -> set[str]:
    return {c["id"] for c in answer["choices"][0]["message"].get("tool_calls") or () if c["id"]}


def without_ids(response: dict[str, Any], kept: set[str]) -> dict[str, Any]:
    """A response object less what is made afresh for each answer (ids, time, the ids
    of tool calls the upstream gave none: all but ``kept``)."""
    response = copy.deepcopy(response)
    del response["id"], response["created_at"]
    for item in response["output"]:
        del item["id"]
        if "call_id" in item and item["call_id"] not in kept:
            item["call_id"] = "made"
    return response


def responses_stream(
    request: dict[str, Any], chunks: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The final response object of a streamed answer, checked event by event with the
    SDK's types and its stream state; the events."""
    events = events_of(streamed(RESPONSES, request, chunks))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    state: ResponseStreamState[Any] = ResponseStreamState(
        input_tools=openai.omit, text_format=openai.omit
    )
    for event in events:
        state.handle_event(RESPONSE_EVENT.validate_python(event))
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    assert final["type"] == f"response.{final['response']['status']}"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert final["response"]["output"] == done
    for item in done:  # every item is the sum of its deltas
        assert item == added_up(events, item)
    return final["response"], events


def added_up(events: list[dict[str, Any]], item: dict[str, Any]) -> dict[str, Any]:
    def deltas(kind: str) -> str:
        return "".join(
            e["delta"] for e in events if e["type"] == kind and e["item_id"] == item["id"]
        )

    if item["type"] == "message":
        text = deltas("response.output_text.delta")
        return {**item, "content": [{**item["content"][0], "text": text}]}
    if item["type"] == "function_call":
        return {**item, "arguments": deltas("response.function_call_arguments.delta")}
    return {**item, "input": deltas("response.custom_tool_call_input.delta")}


def responses_both(
    request: dict[str, Any], answer: dict[str, Any], **cuts: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The unary translation of ``answer``, checked to equal its streamed one."""
    unary = RESPONSES.from_chat(copy.deepcopy(answer), request)
    Response.model_validate(unary)
    final, events = responses_stream(request, chunks_of(answer, **cuts))
    assert without_ids(final, upstream_ids(answer)) == without_ids(unary, upstream_ids(answer))
    return unary, events


TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    },
    {"type": "custom", "name": "apply_patch", "description": "Patch."},
]
REQUEST = {"model": "gpt-5-codex", "input": "go", "tools": TOOLS, "stream": True, "store": False}


def test_responses_text_answer() -> None:
    unary, events = responses_both(REQUEST, chat_answer("Hello there, world."), text_cuts=[1, 5, 6])
    (message,) = unary["output"]
    assert message["type"] == "message" and message["status"] == "completed"
    assert message["content"][0]["text"] == "Hello there, world."
    assert (
        unary["status"] == "completed"
        and unary["model"] == "gpt-5-codex"
        and unary["id"].startswith("resp_")
    )
    assert unary["usage"]["input_tokens"] == 31 and unary["usage"]["output_tokens"] == 17
    assert unary["usage"]["total_tokens"] == 48
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == ["H", "ello", " ", "there, world."]


def test_responses_tool_calls() -> None:
    answer = chat_answer(
        "Running both.",
        [
            call("shell", '{"cmd": "ls"}', "chatcmpl-tool-a"),
            call("shell", '{"cmd": "pwd"}', "chatcmpl-tool-b"),
        ],
    )
    unary, events = responses_both(REQUEST, answer, argument_cuts=[[1, 4], [3]])
    message, first, second = unary["output"]
    assert message["content"][0]["text"] == "Running both."
    assert (first["type"], first["call_id"], first["name"], first["arguments"]) == (
        "function_call",
        "chatcmpl-tool-a",
        "shell",
        '{"cmd": "ls"}',
    )
    assert second["call_id"] == "chatcmpl-tool-b" and first["id"].startswith("fc_")
    assert [
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    ] == [
        "{",
        '"cm',
        'd": "ls"}',
        '{"c',
        'md": "pwd"}',
    ]


def test_responses_one_call_without_upstream_id_or_text() -> None:
    unary, _ = responses_both(REQUEST, chat_answer(None, [call("shell", '{"cmd": "ls"}', None)]))
    (item,) = unary["output"]
    assert item["type"] == "function_call" and item["call_id"].startswith("call_")


# What Codex sends for its own models: its tools in an ``additional_tools`` input item,
# grouped in namespaces (one of them its custom "exec" tool), and hosted tools.
CODEX_TOOLS = [
    {
        "type": "namespace",
        "name": "functions",
        "description": "",
        "tools": [
            {"type": "custom", "name": "exec", "description": "Run JavaScript."},
            {"type": "function", "name": "wait", "parameters": {"type": "object"}},
        ],
    },
    {
        "type": "namespace",
        "name": "collaboration",
        "description": "Work with other agents.",
        "tools": [
            {"type": "function", "name": "list_agents", "parameters": {"type": "object"}},
            {"type": "function", "name": "wait", "parameters": {"type": "object"}},
        ],
    },
]
CODEX_REQUEST = {
    "model": "gpt-6.2-sol",
    "stream": True,
    "tools": [{"type": "web_search", "external_web_access": False}, {"type": "image_generation"}],
    "input": [
        {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": CODEX_TOOLS},
        {"type": "message", "role": "user", "content": "go"},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "list_agents",
            "namespace": "collaboration",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "c1", "output": "[]"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "exec", "input": "text(1)"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "1"},
        {
            "type": "function_call",
            "call_id": "c3",
            "name": "wait",
            "namespace": "functions",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "c3", "output": "ok"},
    ],
}


def test_responses_codex_namespaces_and_additional_tools(
    ignored_log: Callable[[], list[str]],
) -> None:
    """Namespaces flatten to chat functions under their bare names (qualified where two
    share one), hosted tools are left out with a log line, and calls go back with the
    bare name and the namespace, as Codex routes them."""
    chat = RESPONSES.to_chat(CODEX_REQUEST)
    names = [t["function"]["name"] for t in chat["tools"]]
    assert names == ["exec", "functions.wait", "list_agents", "collaboration.wait"]
    assert [m["role"] for m in chat["messages"]] == ["user", *["assistant", "tool"] * 3]
    called = [m["tool_calls"][0]["function"]["name"] for m in chat["messages"][1::2]]
    assert called == ["list_agents", "exec", "functions.wait"]
    assert json.loads(chat["messages"][3]["tool_calls"][0]["function"]["arguments"]) == {
        "input": "text(1)"
    }
    logged = " ".join(ignored_log())
    assert "tools of type web_search" in logged and "tools of type image_generation" in logged

    answer = chat_answer(
        None,
        [
            call("list_agents", "{}", "t1"),
            call("collaboration.wait", "{}", "t2"),
            call("exec", json.dumps({"input": "text(2)"}), "t3"),
            call("functions.list_agents", "{}", "t4"),  # not a tool of that namespace
            call("nowhere", "{}", "t5"),
        ],
    )
    unary, _ = responses_both(CODEX_REQUEST, answer)
    assert [(o["type"], o["name"], o.get("namespace")) for o in unary["output"]] == [
        ("function_call", "list_agents", "collaboration"),
        ("function_call", "wait", "collaboration"),
        ("custom_tool_call", "exec", "functions"),
        ("function_call", "functions.list_agents", None),
        ("function_call", "nowhere", None),
    ]
    assert unary["output"][2]["input"] == "text(2)"


def test_responses_custom_tool_call() -> None:
    patch = "*** Begin Patch\n*** Add File: a\n+x\n*** End Patch"
    answer = chat_answer(None, [call("apply_patch", json.dumps({"input": patch}))])
    unary, events = responses_both(REQUEST, answer, argument_cuts=[[5, 20]])
    (item,) = unary["output"]
    assert (
        item["type"] == "custom_tool_call"
        and item["input"] == patch
        and item["id"].startswith("ctc_")
    )
    (done,) = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert done["input"] == patch
    # The model wrote no JSON object: its text is the input, for the harness to judge.
    unary, _ = responses_both(REQUEST, chat_answer(None, [call("apply_patch", "*** Begin Patch")]))
    assert unary["output"][0]["input"] == "*** Begin Patch"


@pytest.mark.parametrize("in_call", [False, True])
def test_responses_length_cut(in_call: bool) -> None:
    calls = [call("shell", '{"cmd": "l', "t1")] if in_call else None
    unary, events = responses_both(
        REQUEST, chat_answer("Partial ans", calls, finish_reason="length"), text_cuts=[4]
    )
    assert unary["status"] == "incomplete"
    assert unary["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["status"] for i in unary["output"]] == (
        ["completed", "incomplete"] if in_call else ["incomplete"]
    )
    assert events[-1]["type"] == "response.incomplete"


def test_responses_empty_answer_and_no_usage() -> None:
    unary, events = responses_both(REQUEST, chat_answer("", usage=None))
    assert unary["output"] == [] and unary["usage"] is None and unary["status"] == "completed"
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]


def test_responses_echoes_the_request() -> None:
    request = {
        **REQUEST,
        "instructions": "Be brief.",
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0.2,
        "max_output_tokens": 99,
        "reasoning": {"effort": "low"},
    }
    unary = Response.model_validate(RESPONSES.from_chat(chat_answer("ok"), request))
    assert unary.instructions == "Be brief." and unary.tool_choice == "required"
    assert unary.parallel_tool_calls is False and unary.temperature == 0.2
    assert unary.max_output_tokens == 99 and [t.name for t in unary.tools] == [
        "shell",
        "apply_patch",
    ]
    assert unary.output_text == "ok"


def test_responses_stream_failure() -> None:
    translator = RESPONSES.stream(REQUEST)
    raw = translator.feed(chunks_of(chat_answer("Hi"))[1]) + translator.fail(
        502, "the endpoint's stream broke"
    )
    events = events_of(raw)
    for event in events:
        RESPONSE_EVENT.validate_python(event)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == "the endpoint's stream broke"


def test_responses_refuses_a_tool_call_resumed_after_the_next() -> None:
    translator = RESPONSES.stream(REQUEST)
    chunks = chunks_of(chat_answer(None, [call("shell", "{}", "a"), call("shell", "{}", "b")]))
    resumed = copy.deepcopy(chunks[1])
    for chunk in chunks[1:4]:  # call 0 whole, call 1 begun
        translator.feed(chunk)
    with pytest.raises(ValueError, match="resumed tool call 0"):
        translator.feed(resumed)


def test_responses_through_the_openai_client() -> None:
    seen: list[dict[str, Any]] = []
    answer = chat_answer("Let me see.", [call("shell", '{"cmd": "ls -la"}', "chatcmpl-tool-9")])
    client = openai_client(serve(RESPONSES, answer, seen))
    history: list[Any] = [
        {"role": "user", "content": "What is here?"},
        {"type": "function_call", "call_id": "c0", "name": "shell", "arguments": '{"cmd": "pwd"}'},
        {"type": "function_call_output", "call_id": "c0", "output": "/work"},
    ]
    tools: list[Any] = TOOLS[:1]
    response = client.responses.create(
        model="gpt-5-codex", instructions="Be Codex.", input=history, tools=tools
    )
    assert response.output_text == "Let me see."
    assert [(o.type, getattr(o, "call_id", None)) for o in response.output] == [
        ("message", None),
        ("function_call", "chatcmpl-tool-9"),
    ]
    assert [m["role"] for m in seen[0]["chat"]["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
    ]

    texts: list[str] = []
    with client.responses.stream(
        model="gpt-5-codex", instructions="Be Codex.", input=history, tools=tools
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                texts.append(event.delta)
        final = stream.get_final_response()
    assert "".join(texts) == "Let me see." and len(texts) == 3
    assert final.model_dump(exclude={"id", "created_at", "output"}) == response.model_dump(
        exclude={"id", "created_at", "output"}
    )
    # The stream's are the SDK's parsed types, with an empty ``parsed`` more.
    assert [o.model_dump(exclude={"id"}, exclude_none=True) for o in final.output] == [
        o.model_dump(exclude={"id"}, exclude_none=True) for o in response.output
    ]
    assert seen[1]["chat"]["stream_options"] == {"include_usage": True}

    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="m", input="x", tools=[{"name": "f"}])  # type: ignore[list-item]
    assert raised.value.type == "invalid_request_error"
    assert "a tool needs a type" in str(raised.value.body)


@pytest.mark.parametrize(
    ("status", "error", "kind"),
    [
        (400, openai.BadRequestError, "invalid_request_error"),
        (401, openai.AuthenticationError, "authentication_error"),
        (404, openai.NotFoundError, "invalid_request_error"),
        (413, openai.APIStatusError, "invalid_request_error"),
        (429, openai.RateLimitError, "rate_limit_error"),
        (502, openai.InternalServerError, "server_error"),
    ],
)
def test_responses_error_body(status: int, error: type[openai.APIStatusError], kind: str) -> None:
    body = RESPONSES.error_body(status, "it went wrong")
    client = openai_client(lambda _: httpx2.Response(status, json=body))
    with pytest.raises(error) as raised:
        client.responses.create(model="m", input="x")
    assert raised.value.status_code == status and raised.value.type == kind
    assert raised.value.body == body["error"] and "it went wrong" in raised.value.message


@st.composite
def split_answers(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """A chat answer (text, 0-3 tool calls, maybe cut at the length limit) and where its
    chunks split the text, each call's arguments and the calls' names."""
    values = st.one_of(st.integers(), st.text(max_size=12), st.booleans(), st.none())
    calls = [
        call(
            draw(st.sampled_from(["shell", "apply_patch", "read_file"])),
            json.dumps(draw(st.dictionaries(st.text(max_size=6), values, max_size=3))),
            draw(st.sampled_from([None, f"chatcmpl-tool-{i}"])),
        )
        for i in range(draw(st.integers(0, 3)))
    ]
    answer = chat_answer(draw(st.text(max_size=40)), calls, draw(st.sampled_from([None, "length"])))
    cuts = {
        "text_cuts": draw(st.lists(st.integers(0, 40), max_size=8)),
        "argument_cuts": [draw(st.lists(st.integers(0, 60), max_size=6)) for _ in calls],
        "name_cuts": draw(st.lists(st.integers(0, 10), max_size=2)),
    }
    return answer, cuts


SPLITS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SPLITS
@given(split_answers())
def test_responses_any_chunking_adds_up_to_the_unary_answer(
    case: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    answer, cuts = case
    responses_both(REQUEST, answer, **cuts)


# --- Anthropic: requests -----------------------------------------------------------------


def messages_request(**fields: Any) -> dict[str, Any]:
    return {
        "model": "claude-local",
        "max_tokens": 1024,
        "messages": [{"role": "user", "content": "Hi"}],
        **fields,
    }


def test_anthropic_every_block_kind(ignored_log: Callable[[], list[str]]) -> None:
    body = messages_request(
        system=[
            {
                "type": "text",
                "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": "Be brief."},
        ],
        messages=[
            {"role": "user", "content": "List files."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use ls.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "text", "text": "Listing."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "Bash",
                        "input": {"command": "ls"},
                    },
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": "Bash",
                        "input": {"command": "pwd", "n": 1},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py\nb.py"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [
                            {"type": "text", "text": "no such"},
                            {"type": "text", "text": "dir"},
                        ],
                        "is_error": True,
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "text", "text": "<system-reminder>x</system-reminder>"},
                    {"type": "text", "text": "Go on."},
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_3", "name": "Noop", "input": {}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
        ],
    )
    assert ANTHROPIC.to_chat(body)["messages"] == [
        {"role": "system", "content": "You are Claude Code.\nBe brief."},
        {"role": "user", "content": "List files."},
        {
            "role": "assistant",
            "content": "Listing.",
            "tool_calls": [
                call("Bash", '{"command": "ls"}', "toolu_1"),
                call("Bash", '{"command": "pwd", "n": 1}', "toolu_2"),
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py\nb.py"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such\ndir"},
        {"role": "user", "content": "<system-reminder>x</system-reminder>\nGo on."},
        {"role": "assistant", "content": None, "tool_calls": [call("Noop", "{}", "toolu_3")]},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
    ]
    (line,) = ignored_log()
    for name in ("cache_control", "redacted_thinking blocks", "thinking blocks"):
        assert name in line


def test_anthropic_tools_and_options(ignored_log: Callable[[], list[str]]) -> None:
    schema = {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    }
    body = messages_request(
        system="Be Claude.",
        tools=[
            {
                "name": "Bash",
                "description": "Run a command.",
                "input_schema": schema,
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "custom", "name": "Noop", "input_schema": {"type": "object"}},
        ],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["###"],
        temperature=0.7,
        top_p=0.95,
        top_k=40,
        stream=True,
        metadata={"user_id": "u"},
        thinking={"type": "enabled", "budget_tokens": 2000},
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "high"},
    )
    chat = ANTHROPIC.to_chat(body)
    assert chat == {
        "model": "claude-local",
        "messages": [
            {"role": "system", "content": "Be Claude."},
            {"role": "user", "content": "Hi"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "Bash", "parameters": schema, "description": "Run a command."},
            },
            {"type": "function", "function": {"name": "Noop", "parameters": {"type": "object"}}},
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 1024,
        "temperature": 0.7,
        "top_p": 0.95,
        "top_k": 40,  # vLLM's, and recorded: the trainer scores under it
        "stop": ["###"],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema},
        },
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    (line,) = ignored_log()
    for name in ("cache_control", "metadata", "output_config.effort", "thinking"):
        assert name in line


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        (
            {"type": "tool", "name": "Bash"},
            {"tool_choice": {"type": "function", "function": {"name": "Bash"}}},
        ),
        (
            {"type": "auto", "disable_parallel_tool_use": True},
            {"tool_choice": "auto", "parallel_tool_calls": False},
        ),
    ],
)
def test_anthropic_tool_choice(choice: dict[str, Any], expected: dict[str, Any]) -> None:
    tools = [{"name": "Bash", "input_schema": {"type": "object"}}]
    chat = ANTHROPIC.to_chat(messages_request(tools=tools, tool_choice=choice))
    assert {k: chat[k] for k in expected} == expected
    assert ("parallel_tool_calls" in chat) == ("parallel_tool_calls" in expected)


def test_anthropic_prefill_continues_the_last_assistant_message() -> None:
    messages = [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": "{"}]
    chat = ANTHROPIC.to_chat(messages_request(messages=messages))
    assert chat["messages"][-1] == {"role": "assistant", "content": "{"}
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    assert "continue_final_message" not in ANTHROPIC.to_chat(messages_request())


def test_anthropic_count_tokens_request() -> None:
    body = {
        "model": "claude-local",
        "system": "S",
        "messages": [{"role": "user", "content": "Hi"}],
    }
    body["tools"] = [{"name": "Bash", "input_schema": {"type": "object"}}]
    chat = ANTHROPIC.count_tokens_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hi"},
    ]
    assert chat["tools"][0]["function"]["name"] == "Bash"
    assert "max_tokens" not in chat and "stream" not in chat
    anthropic.types.MessageTokensCount.model_validate({"input_tokens": 12})  # the answer's shape


def image(source: str = "base64") -> dict[str, Any]:
    return {"type": "image", "source": {"type": source, "media_type": "image/png", "data": "iVBO"}}


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"max_tokens": None}, "max_tokens: a positive integer is required"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": "Hi"}, "messages: a list of messages is required"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "unknown role 'tool'"),
        (
            {"messages": [{"role": "user", "content": [image()]}]},
            "messages[0].content[0]: 'image' blocks",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "'document' blocks",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": [image()]}
                        ],
                    }
                ]
            },
            "messages[0].content[0].content[0]: 'image' blocks",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "tool_use_id is missing",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [
                            {
                                "type": "server_tool_use",
                                "id": "s",
                                "name": "web_search",
                                "input": {},
                            }
                        ],
                    }
                ]
            },
            "'server_tool_use' blocks",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}],
                    }
                ]
            },
            "input object",
        ),
        ({"system": [image()]}, "system[0]: 'image' blocks"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools[0]: 'web_search_20250305' tools",
        ),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "'bash_20250124' tools"),
        (
            {"tools": [{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]},
            "text_editor",
        ),
        ({"tools": [{"name": "Bash"}]}, "tools[0]: a tool needs a name and an input_schema"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ],
)
def test_anthropic_refuses_what_it_cannot_express(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(DialectError) as raised:
        ANTHROPIC.to_chat(messages_request(**fields))
    assert raised.value.status == 400
    assert says in raised.value.message


# --- Anthropic: answers ------------------------------------------------------------------


def anthropic_stream(
    request: dict[str, Any], chunks: list[dict[str, Any]]
) -> tuple[anthropic.types.Message, list[dict[str, Any]]]:
    """The message a stream adds up to with the SDK's accumulator, each event checked
    with the SDK's types; the events."""
    events = events_of(streamed(ANTHROPIC, request, chunks))
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for event in events:
        parsed = MESSAGE_EVENT.validate_python(event)
        snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs=json_bufs)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == list(range(len(starts)))  # each block ends before the next
    assert snapshot is not None
    return anthropic.types.Message.model_validate(snapshot.model_dump()), events


def anthropic_both(
    request: dict[str, Any], answer: dict[str, Any], **cuts: Any
) -> tuple[anthropic.types.Message, list[dict[str, Any]]]:
    """The unary translation of ``answer``, checked to equal what its stream adds up to."""
    unary = anthropic.types.Message.model_validate(
        ANTHROPIC.from_chat(copy.deepcopy(answer), request)
    )
    final, events = anthropic_stream(request, chunks_of(answer, **cuts))
    kept = upstream_ids(answer)

    def comparable(message: anthropic.types.Message) -> dict[str, Any]:
        dumped = message.model_dump(exclude={"id"}, exclude_none=True)
        for block in dumped["content"]:
            if block["type"] == "tool_use" and block["id"] not in kept:
                assert block["id"].startswith("toolu_")
                block["id"] = "made"
        return dumped

    assert comparable(final) == comparable(unary)
    return unary, events


CLAUDE = messages_request(tools=[{"name": "Bash", "input_schema": {"type": "object"}}], stream=True)


def test_anthropic_text_answer() -> None:
    unary, events = anthropic_both(CLAUDE, chat_answer("Hello there."), text_cuts=[2, 3])
    assert unary.id.startswith("msg_") and unary.model == "claude-local"
    assert [(b.type, getattr(b, "text", None)) for b in unary.content] == [("text", "Hello there.")]
    assert unary.stop_reason == "end_turn" and unary.stop_sequence is None
    assert (unary.usage.input_tokens, unary.usage.output_tokens) == (31, 17)
    deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == ["He", "l", "lo there."]


def test_anthropic_tool_calls() -> None:
    answer = chat_answer(
        "Checking.",
        [
            call("Bash", '{"command": "ls"}', "chatcmpl-tool-a"),
            call("Bash", '{"command":"pwd"}', None),
        ],
    )
    unary, events = anthropic_both(CLAUDE, answer, argument_cuts=[[3, 9], [1]])
    text, first, second = unary.content
    assert text.type == "text" and text.text == "Checking."
    assert first.type == "tool_use" and (first.id, first.name, first.input) == (
        "chatcmpl-tool-a",
        "Bash",
        {"command": "ls"},
    )
    assert (
        second.type == "tool_use"
        and second.id.startswith("toolu_")
        and second.input == {"command": "pwd"}
    )
    assert unary.stop_reason == "tool_use"
    # A tool's input goes out whole, once its block ends.
    partial = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert partial == ['{"command": "ls"}', '{"command": "pwd"}']


def test_anthropic_tool_call_arguments_that_are_no_object() -> None:
    calls = [
        call("Bash", "{\"command\": 'ls'}", "t1"),
        call("Bash", "[1]", "t2"),
        call("Noop", "", "t3"),
    ]
    unary, _ = anthropic_both(CLAUDE, chat_answer(None, calls), argument_cuts=[[4]])
    assert [getattr(b, "input", None) for b in unary.content] == [
        {"_raw": "{\"command\": 'ls'}"},
        {"_raw": "[1]"},
        {},
    ]


def test_anthropic_forced_tool_call_ends_in_tool_use() -> None:
    # vLLM ends a required or named tool call with finish_reason "stop".
    unary, _ = anthropic_both(CLAUDE, chat_answer(None, [call("Bash", "{}")], finish_reason="stop"))
    assert unary.stop_reason == "tool_use"


def test_anthropic_length_cut_and_stop_sequence() -> None:
    unary, _ = anthropic_both(CLAUDE, chat_answer("Partial", finish_reason="length"), text_cuts=[3])
    assert unary.stop_reason == "max_tokens"
    unary, _ = anthropic_both(
        CLAUDE, chat_answer("x", [call("Bash", '{"a": ')], finish_reason="length")
    )
    assert unary.stop_reason == "max_tokens"
    request = {**CLAUDE, "stop_sequences": ["###", "END"]}
    unary, _ = anthropic_both(request, chat_answer("Done", stop_reason="END"))
    assert (unary.stop_reason, unary.stop_sequence) == ("stop_sequence", "END")
    # A stop string the harness did not ask for (a template's own) is an ordinary end.
    unary, _ = anthropic_both(request, chat_answer("Done", stop_reason="<|im_end|>"))
    assert (unary.stop_reason, unary.stop_sequence) == ("end_turn", None)


def test_anthropic_usage() -> None:
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 20}}
    unary, _ = anthropic_both(CLAUDE, chat_answer("ok", usage=usage))
    assert (unary.usage.input_tokens, unary.usage.cache_read_input_tokens) == (11, 20)
    unary, _ = anthropic_both(CLAUDE, chat_answer("ok", usage=None))
    assert (unary.usage.input_tokens, unary.usage.output_tokens) == (0, 0)
    # vLLM's first chunk carries the prompt's ids: message_start knows the prompt's size.
    chunks = chunks_of(chat_answer("ok"))
    chunks[0]["prompt_token_ids"] = list(range(31))
    _, events = anthropic_stream(CLAUDE, chunks)
    assert events[0]["message"]["usage"]["input_tokens"] == 31


def test_anthropic_empty_answer() -> None:
    unary, events = anthropic_both(CLAUDE, chat_answer(""))
    assert unary.content == [] and unary.stop_reason == "end_turn"
    assert [e["type"] for e in events] == ["message_start", "message_delta", "message_stop"]


@SPLITS
@given(split_answers())
def test_anthropic_any_chunking_adds_up_to_the_unary_answer(
    case: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    answer, cuts = case
    anthropic_both(CLAUDE, answer, **cuts)


def test_anthropic_through_the_anthropic_client() -> None:
    seen: list[dict[str, Any]] = []
    answer = chat_answer("Let me look.", [call("Bash", '{"command": "ls"}', "chatcmpl-tool-7")])
    client = anthropic_client(serve(ANTHROPIC, answer, seen))
    tools: list[Any] = [{"name": "Bash", "description": "Run.", "input_schema": {"type": "object"}}]
    history: list[Any] = [
        {"role": "user", "content": "What is here?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_0", "name": "Bash", "input": {"command": "pwd"}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "/work"}],
        },
    ]
    message = client.messages.create(
        model="claude-local",
        max_tokens=512,
        system="Be Claude.",
        messages=history,
        tools=tools,
    )
    assert [b.type for b in message.content] == [
        "text",
        "tool_use",
    ] and message.stop_reason == "tool_use"
    assert [m["role"] for m in seen[0]["chat"]["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
    ]

    texts: list[str] = []
    with client.messages.stream(
        model="claude-local",
        max_tokens=512,
        system="Be Claude.",
        messages=history,
        tools=tools,
    ) as stream:
        texts.extend(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "Let me look." and len(texts) == 3
    assert final.model_dump(exclude={"id"}, exclude_none=True) == message.model_dump(
        exclude={"id"}, exclude_none=True
    )

    with_image: list[Any] = [{"role": "user", "content": [image()]}]
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="m", max_tokens=9, messages=with_image)
    assert raised.value.type == "invalid_request_error"
    assert "'image' blocks cannot be translated" in (raised.value.api_message or "")


def test_anthropic_stream_failure_reaches_the_client() -> None:
    def handle(request: httpx2.Request) -> httpx2.Response:
        translator = ANTHROPIC.stream(json.loads(request.content))
        raw = translator.feed(chunks_of(chat_answer("Hi"))[1]) + translator.fail(
            502, "the endpoint broke"
        )
        return httpx2.Response(
            200, content=b"".join(raw), headers={"content-type": "text/event-stream"}
        )

    client = anthropic_client(handle)
    messages: list[Any] = [{"role": "user", "content": "x"}]
    with (
        pytest.raises(anthropic.APIStatusError) as raised,
        client.messages.stream(model="m", max_tokens=9, messages=messages) as stream,
    ):
        list(stream)
    assert raised.value.type == "api_error" and raised.value.api_message == "the endpoint broke"


@pytest.mark.parametrize(
    ("status", "error", "kind"),
    [
        (400, anthropic.BadRequestError, "invalid_request_error"),
        (401, anthropic.AuthenticationError, "authentication_error"),
        (403, anthropic.PermissionDeniedError, "permission_error"),
        (404, anthropic.NotFoundError, "not_found_error"),
        (413, anthropic.APIStatusError, "invalid_request_error"),
        (429, anthropic.RateLimitError, "rate_limit_error"),
        (500, anthropic.InternalServerError, "api_error"),
        (502, anthropic.InternalServerError, "api_error"),
        (529, anthropic.OverloadedError, "overloaded_error"),
    ],
)
def test_anthropic_error_body(
    status: int, error: type[anthropic.APIStatusError], kind: str
) -> None:
    body = ANTHROPIC.error_body(status, "it went wrong")
    anthropic.types.ErrorResponse.model_validate(body)
    client = anthropic_client(lambda _: httpx2.Response(status, json=body))
    with pytest.raises(error) as raised:
        client.messages.create(model="m", max_tokens=9, messages=[{"role": "user", "content": "x"}])
    assert raised.value.status_code == status and raised.value.type == kind
    assert raised.value.api_message == "it went wrong"


@pytest.mark.parametrize("dialect", [RESPONSES, ANTHROPIC], ids=["responses", "anthropic"])
def test_a_body_that_is_no_object(dialect: Dialect) -> None:
    with pytest.raises(DialectError, match="is a JSON object") as raised:
        dialect.to_chat([1, 2])  # type: ignore[arg-type]
    assert raised.value.status == 400


def test_messages_a_system_turn_mid_conversation_stays_a_system_message() -> None:
    """Claude Code sends its agent and skill lists as ``system`` turns between the others
    (not in Anthropic's documented API)."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": [{"type": "text", "text": "Agents: none."}]},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Go"},
    ]
    chat = ANTHROPIC.to_chat(messages_request(messages=messages))
    assert [m["role"] for m in chat["messages"]] == ["user", "system", "assistant", "user"]
    assert chat["messages"][1]["content"] == "Agents: none."
