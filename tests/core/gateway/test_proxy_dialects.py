"""The Responses API and the Anthropic Messages API through the recording proxy, with the
official SDKs against a real gateway: each call is one recorded ``model_request``, the
answer comes back in the API the harness spoke, and so do errors."""

from __future__ import annotations

from collections.abc import Callable

import anthropic
import httpx
import openai
import pytest

from agl.core.client import GatewayClient
from agl.core.contracts.records import Rollout
from agl.testing.fake_vllm import EOS, FakeVllm, encode, reply_for
from agl.testing.processes import GatewayProcess
from tests.conftest import agent, anthropic_agent, model_requests, proxy_root

TOOL_ARGS = '{"query":"weather"}'


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_responses_text(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
    stream: bool,
) -> None:
    r = running()
    client = agent(gateway, r)
    kwargs = {"model": "gpt-x", "instructions": "be brief", "input": "hello"}
    if stream:
        with client.responses.stream(**kwargs) as events:
            kinds = [e.type for e in events]
            response = events.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "response.output_text.delta" in kinds
    else:
        response = client.responses.create(**kwargs)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert response.output_text == reply_for(messages)
    (call,) = model_requests(admin, r)
    assert call["api"] == "responses" and call["messages"] == messages
    assert call["response_ids"] == [*encode(reply_for(messages)), EOS]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_responses_function_call_round_trip(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
    stream: bool,
) -> None:
    r = running()
    client = agent(gateway, r)
    tools = [
        {
            "type": "function",
            "name": "search",
            "description": "look it up",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        }
    ]
    first_input = [{"role": "user", "content": "use-tool weather"}]
    if stream:
        with client.responses.stream(model="m", input=first_input, tools=tools) as events:
            first = events.get_final_response()
    else:
        first = client.responses.create(model="m", input=first_input, tools=tools)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, call.arguments) == ("search", TOOL_ARGS)
    second = client.responses.create(
        model="m",
        tools=tools,
        input=[
            *first_input,
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": "search",
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
    )
    assert second.output_text
    first_record, second_record = model_requests(admin, r)
    assert first_record["tool_calls"][0]["function"]["arguments"] == TOOL_ARGS
    tool_message = second_record["messages"][-1]
    assert tool_message == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
    assert second_record["messages"][-2]["tool_calls"][0]["id"] == call.call_id


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_messages_text_and_tool_use(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
    stream: bool,
) -> None:
    r = running()
    client = anthropic_agent(gateway, r)
    tools = [
        {
            "name": "search",
            "description": "look it up",
            "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
        }
    ]
    kwargs = {
        "model": "claude-x",
        "max_tokens": 100,
        "system": "be brief",
        "tools": tools,
        "messages": [{"role": "user", "content": "use-tool weather"}],
    }
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("search", {"query": "weather"})
    answer = client.messages.create(
        model="claude-x",
        max_tokens=100,
        tools=tools,
        messages=[
            *kwargs["messages"],
            {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
            },
        ],
    )
    assert answer.stop_reason == "end_turn"
    assert "".join(b.text for b in answer.content if b.type == "text")
    first, second = model_requests(admin, r)
    assert first["api"] == "anthropic" and first["messages"][0] == {
        "role": "system",
        "content": "be brief",
    }
    assert second["messages"][-1]["role"] == "tool"
    assert second["messages"][-1]["tool_call_id"] == use.id


def test_errors_come_in_the_api_the_harness_spoke(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
) -> None:
    r = running()
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        anthropic_agent(gateway, r, key="not-a-key").messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert bad_key.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as untranslatable:
        anthropic_agent(gateway, r).messages.create(
            model="m",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        )
    assert untranslatable.value.body["type"] == "error"
    not_json = httpx.post(
        proxy_root(gateway, r) + "/anthropic/v1/messages",
        content=b"{not json",
        headers={"x-api-key": r.attempt_key or "", "content-type": "application/json"},
    )
    assert not_json.status_code == 400
    assert not_json.json()["error"]["type"] == "invalid_request_error"
    fake.fail_next = [500] * 10
    with pytest.raises(openai.InternalServerError):
        agent(gateway, r).responses.create(model="m", input="hi")
    failed = admin.get_events(r.rollout_id, type="model_request_failed")
    assert [f.data["status"] for f in failed] == [500]
    fake.fail_next.clear()
    admin.patch_rollout(r.rollout_id, "succeeded", attempt=r.attempt)
    with pytest.raises(anthropic.APIStatusError) as ended:
        anthropic_agent(gateway, r).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert ended.value.status_code == 409 and ended.value.body["type"] == "error"
    assert model_requests(admin, r) == []
