"""The recording proxy with the real openai client: sync, async, streaming, retries."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import openai
import pytest

from agl.core.client import GatewayClient
from agl.core.contracts.records import Rollout
from agl.testing.fake_vllm import EOS, FakeVllm, encode, logprob, prompt_ids, reply_for
from agl.testing.processes import GatewayProcess
from tests.conftest import agent, base_url, model_requests

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def expected_call(messages: list[dict[str, str]]) -> tuple[list[int], list[int], list[float]]:
    response = [*encode(reply_for(messages)), EOS]
    return prompt_ids(messages), response, [logprob(i) for i in range(len(response))]


def test_chat_is_forwarded_and_recorded(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running()
    answer = agent(gateway, r).chat.completions.create(model="any-name", messages=MESSAGES)
    assert answer.choices[0].message.content == reply_for(MESSAGES)
    assert answer.model == "any-name"
    assert answer.choices[0].logprobs is None  # the harness did not ask for them
    dumped = answer.model_dump()
    assert "prompt_token_ids" not in dumped and "token_ids" not in dumped["choices"][0]
    # What went upstream: the registered model name, plus vLLM's token-id switches.
    sent = fake.requests[-1]
    assert (sent["model"], sent["logprobs"], sent["return_token_ids"]) == ("policy", True, True)
    (call,) = model_requests(admin, r)
    prompt, response, logprobs = expected_call(MESSAGES)
    assert call["prompt_ids"] == prompt and call["response_ids"] == response
    assert call["logprobs"] == pytest.approx(logprobs)
    assert (call["policy_version"], call["finish_reason"]) == (3, "stop")
    assert call["messages"] == MESSAGES and call["response"] == reply_for(MESSAGES)
    assert call["latency_s"] > 0


def test_logprobs_stay_when_the_harness_asks(
    gateway: GatewayProcess, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running()
    answer = agent(gateway, r).chat.completions.create(
        model="policy", messages=MESSAGES, logprobs=True
    )
    assert answer.choices[0].logprobs is not None
    assert [c.logprob for c in answer.choices[0].logprobs.content][:2] == [logprob(0), logprob(1)]


def test_async_client_many_concurrent_calls(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    rollouts = [running() for _ in range(8)]

    async def one(r: Rollout, turn: int) -> str:
        async with openai.AsyncOpenAI(
            base_url=base_url(gateway, r), api_key=r.attempt_key, max_retries=0
        ) as client:
            messages = [{"role": "user", "content": f"turn {turn} of {r.rollout_id}"}]
            answer = await client.chat.completions.create(model="policy", messages=messages)
            return answer.choices[0].message.content or ""

    async def main() -> list[str]:
        return await asyncio.gather(*(one(r, t) for r in rollouts for t in range(3)))

    answers = asyncio.run(main())
    assert len(answers) == 24 and all(a.startswith("turn 1:") for a in answers)
    for r in rollouts:
        assert len(model_requests(admin, r)) == 3


def test_streaming_reaches_the_harness_and_is_recorded(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running()
    stream = agent(gateway, r).chat.completions.create(
        model="policy", messages=MESSAGES, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply_for(MESSAGES)
    assert len(chunks) > 5  # relayed chunk by chunk, not as one answer
    assert all("token_ids" not in c.model_dump()["choices"][0] for c in chunks if c.choices)
    (call,) = model_requests(admin, r)
    prompt, response, logprobs = expected_call(MESSAGES)
    assert (call["prompt_ids"], call["response_ids"]) == (prompt, response)
    assert call["logprobs"] == pytest.approx(logprobs)
    assert (call["finish_reason"], call["response"]) == ("stop", reply_for(MESSAGES))


def test_a_long_prompt_streams(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    """vLLM's first chunk carries every prompt token id on one event-stream line: a long
    agentic prompt makes it megabytes, far past aiohttp's default line limit (128 KiB)."""
    r = running()
    messages = [{"role": "user", "content": "x" * 400_000}]
    stream = agent(gateway, r).chat.completions.create(
        model="policy", messages=messages, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reply_for(messages)
    (call,) = model_requests(admin, r)
    assert call["prompt_ids"] == prompt_ids(messages)


def test_streaming_chunks_arrive_before_the_end(
    gateway: GatewayProcess, running: Callable[..., Rollout]
) -> None:
    """The first chunk is relayed while the upstream is still generating."""
    r = running()
    body = {"model": "policy", "messages": MESSAGES, "stream": True}
    with httpx.stream(
        "POST",
        base_url(gateway, r) + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {r.attempt_key}"},
        timeout=10,
    ) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_tool_calls_are_recorded(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout]
) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "search",
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
            },
        }
    ]
    messages = [{"role": "user", "content": "use-tool weather"}]
    for stream in (False, True):
        r = running()
        client = agent(gateway, r)
        if stream:
            list(
                client.chat.completions.create(
                    model="policy", messages=messages, tools=tools, stream=True
                )
            )
        else:
            answer = client.chat.completions.create(model="policy", messages=messages, tools=tools)
            assert answer.choices[0].message.tool_calls[0].function.name == "search"
        (call,) = model_requests(admin, r)
        assert call["finish_reason"] == "tool_calls"
        assert call["tool_calls"][0]["function"] == {
            "name": "search",
            "arguments": '{"query":"weather"}',
        }
        assert call["tools"] == tools
        assert call["response_ids"] == [*encode('{"query":"weather"}'), EOS]


def test_transient_upstream_failures_are_retried(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    for stream in (False, True):
        r = running()
        fake.fail_next = [503, 429, 500]
        answer = agent(gateway, r).chat.completions.create(
            model="policy", messages=MESSAGES, stream=stream
        )
        if stream:
            answer = list(answer)
        assert not fake.fail_next
        assert len(model_requests(admin, r)) == 1
        assert model_requests(admin, r, "model_request_failed") == []


def test_final_failure_returns_upstream_status_and_is_not_a_training_call(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running()
    fake.fail_next = [503] * 4  # one try plus three retries
    with pytest.raises(openai.InternalServerError) as failed:
        agent(gateway, r).chat.completions.create(model="policy", messages=MESSAGES)
    assert failed.value.status_code == 503 and "injected failure 503" in str(failed.value)
    fake.fail_next = [400]
    with pytest.raises(openai.BadRequestError):
        agent(gateway, r).chat.completions.create(model="policy", messages=MESSAGES, stream=True)
    assert model_requests(admin, r) == []
    failures = model_requests(admin, r, "model_request_failed")
    assert [f["status"] for f in failures] == [503, 400]


def test_unreachable_endpoint_is_502(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout]
) -> None:
    r = running()
    admin.register_models([{"model": "dead", "endpoint": "http://127.0.0.1:9/v1"}])
    try:
        with pytest.raises(openai.APIStatusError) as failed:
            agent(gateway, r).chat.completions.create(model="dead", messages=MESSAGES)
        assert failed.value.status_code == 502
        # With two models served, an unknown name is refused, naming what is registered.
        with pytest.raises(openai.NotFoundError) as unknown:
            agent(gateway, r).chat.completions.create(model="gpt-4o", messages=MESSAGES)
        assert "dead, policy" in str(unknown.value)
    finally:
        admin.delete_models("dead")
    assert model_requests(admin, r, "model_request_failed")[0]["status"] == 502


def test_broken_stream_is_recorded_as_failed(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running()
    fake.stream_break_after = 3
    with pytest.raises(openai.APIError):
        list(
            agent(gateway, r).chat.completions.create(
                model="policy", messages=MESSAGES, stream=True
            )
        )
    assert model_requests(admin, r) == []
    assert len(model_requests(admin, r, "model_request_failed")) == 1


def test_proxy_refuses_what_is_not_running_or_not_its_own(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout]
) -> None:
    r, other = running(), running()
    key_headers = {"Authorization": f"Bearer {r.attempt_key}"}
    url = base_url(gateway, r) + "/chat/completions"
    body = {"model": "policy", "messages": MESSAGES}
    assert httpx.post(url, json=body, timeout=10).status_code == 401
    wrong = httpx.post(
        base_url(gateway, other) + "/chat/completions", json=body, headers=key_headers, timeout=10
    )
    assert wrong.status_code == 403
    val = httpx.post(
        url.replace("/mode/train/", "/mode/val/"), json=body, headers=key_headers, timeout=10
    )
    assert val.status_code == 400 and "mode" in val.json()["error"]["message"]
    for bad in (b"{oops", b"[]", b'{"messages": "hi"}'):
        response = httpx.post(url, content=bad, headers=key_headers, timeout=10)
        assert response.status_code == 400, bad
    admin.patch_rollout(r.rollout_id, "succeeded")
    done = httpx.post(url, json=body, headers=key_headers, timeout=10)
    assert done.status_code == 409 and done.json()["current"]["status"] == "succeeded"
    queued = admin.create_rollouts([{"rollout_id": r.rollout_id + "-q"}])[0]
    response = httpx.post(
        base_url(gateway, queued) + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {queued.attempt_key}"},
        timeout=10,
    )
    assert response.status_code == 409


BIG_INTEGERS = {  # the field's path: a chat body with an integer past 64 bits there
    "max_tokens": b'{"model": "policy", "messages": [{"role": "user", "content": "hi"}], '
    b'"max_tokens": 18446744073709551616}',
    "messages.0.x.1": b'{"model": "policy", "messages": [{"role": "user", "content": "hi", '
    b'"x": [1, -9223372036854775809]}]}',
}


@pytest.mark.parametrize("path", sorted(BIG_INTEGERS))
def test_an_integer_past_64_bits_in_a_chat_body_is_refused_naming_its_field(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
    path: str,
) -> None:
    """orjson reads such an integer as a float: it used to be forwarded and recorded as a
    number the harness never sent."""
    r = running()
    response = httpx.post(
        base_url(gateway, r) + "/chat/completions",
        content=BIG_INTEGERS[path],
        headers={"Authorization": f"Bearer {r.attempt_key}"},
        timeout=10,
    )
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "64 bits" in message and path in message, message
    assert fake.requests == []
    assert admin.get_events(r.rollout_id) == []


def test_a_rollout_sticks_to_one_endpoint(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], upstream
) -> None:
    from agl.testing.fake_vllm import serve_in_thread

    with serve_in_thread() as (second_url, second):
        # Registered afresh, both endpoints carry no rollout: each pair of new rollouts
        # goes one to each (a new rollout goes to the endpoint with the fewest).
        admin.delete_models()
        admin.register_models(
            [
                {"model": "policy", "endpoint": url, "policy_version": 3}
                for url in (upstream[0], second_url)
            ]
        )
        try:
            seen = []
            for _ in range(4):
                r = running()
                client = agent(gateway, r)
                before = len(second.requests)
                for turn in range(3):
                    client.chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": str(turn)}]
                    )
                went_second = len(second.requests) - before
                assert went_second in (0, 3)  # all three calls on the same endpoint
                seen.append(went_second)
                endpoints = {c["endpoint"] for c in model_requests(admin, r)}
                assert len(endpoints) == 1
            assert sorted(seen) == [0, 0, 3, 3]  # and rollouts spread evenly over both
        finally:
            admin.delete_models()
            admin.register_models(
                [{"model": "policy", "endpoint": upstream[0], "policy_version": 3}]
            )


def test_malformed_answers_are_502_and_recorded_as_failed(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running()
    fake.raw_next = [b"not json", b'{"choices": "nope"}', b'{"no": "choices"}']
    for _ in range(3):
        with pytest.raises(openai.APIStatusError) as failed:
            agent(gateway, r).chat.completions.create(model="policy", messages=MESSAGES)
        assert failed.value.status_code == 502 and "malformed" in str(failed.value)
    assert model_requests(admin, r) == []
    assert len(model_requests(admin, r, "model_request_failed")) == 3
    # and the gateway is fine afterwards
    answer = agent(gateway, r).chat.completions.create(model="policy", messages=MESSAGES)
    assert answer.choices[0].message.content == reply_for(MESSAGES)
