"""Text completions (``/v1/completions``) and Anthropic's ``count_tokens`` through the
recording proxy, with the real ``openai`` and ``anthropic`` clients against a real gateway
on loopback: first over fake vLLM (every id predictable), then over the embedded server
on the tiny model (its own tokenizer, real sampling).

A text completion is recorded as one ``model_request`` with the prompt's and the answer's
token ids and logprobs, in the layout of a chat call, so the trainer reads it and merges
it like one; ``count_tokens`` counts the prompt with the endpoint's ``/tokenize`` and
records nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from agl.core.client import GatewayClient
from agl.core.contracts.records import Rollout
from agl.core.gateway.dialects import ANTHROPIC
from agl.core.trainer.calls import read_calls
from agl.strategies.registry import get
from agl.testing.fake_vllm import EOS, FakeVllm, completion_for, encode, logprob, prompt_ids
from agl.testing.processes import GatewayProcess
from agl.ui.views import timeline
from tests.conftest import agent, anthropic_agent, model_requests
from tests.helpers.tiny_gateway import Tiny, start, tiny, tiny_admin  # noqa: F401 - fixtures

PROMPT = "The capital of France is"


def complete(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str, str | None, Any]:
    """(text, finish_reason, logprobs of the one choice) of a unary or streamed call."""
    if not stream:
        (choice,) = client.completions.create(**kwargs).choices
        return choice.text, choice.finish_reason, choice.logprobs
    texts: list[str] = []
    finish, token_logprobs = None, []
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert choice.index == 0
            assert not (choice.model_extra or {}).keys() & {"token_ids", "prompt_token_ids"}
            texts.append(choice.text)
            finish = choice.finish_reason or finish
            if choice.logprobs is not None:
                token_logprobs += choice.logprobs.token_logprobs
    return "".join(texts), finish, token_logprobs or None


# --- over fake vLLM ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_text_completion_is_recorded_like_a_chat_call(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
    stream: bool,
) -> None:
    r = running()
    text, finish, logprobs = complete(
        agent(gateway, r), stream, model="any", prompt=PROMPT, max_tokens=100
    )
    assert (text, finish, logprobs) == (completion_for(PROMPT), "stop", None)
    (forwarded,) = fake.requests
    assert forwarded["logprobs"] == 0 and forwarded["return_token_ids"] is True
    (call,) = model_requests(admin, r)
    assert call["api"] == "completions" and call["prompt"] == PROMPT
    assert "messages" not in call and call["response"] == text
    assert call["prompt_ids"] == encode(PROMPT)
    assert call["response_ids"] == [*encode(text), EOS]
    assert call["logprobs"] == [logprob(i) for i in range(len(call["response_ids"]))]
    assert call["policy_version"] == 3 and "invalid" not in call


def test_the_viewer_shows_a_text_completions_prompt(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running()
    text, _, _ = complete(agent(gateway, r), False, model="any", prompt=PROMPT)
    events = admin.get_events(r.rollout_id)
    (item,) = [i for i in timeline(events) if i.kind == "call"]
    assert [(m.role, m.text) for m in item.messages] == [("prompt", PROMPT)]
    assert item.response == text


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_logprobs_the_harness_asks_for_reach_it(
    gateway: GatewayProcess,
    running: Callable[..., Rollout],
    fake: FakeVllm,
    stream: bool,
) -> None:
    r = running()
    client = agent(gateway, r)
    text, _, logprobs = complete(client, stream, model="m", prompt="x", logprobs=2, max_tokens=50)
    assert fake.requests[-1]["logprobs"] == 2  # what the harness asked, not less
    values = logprobs if stream else logprobs.token_logprobs
    assert values == [logprob(i) for i in range(len(text.encode()) + 1)]  # + the eos


def test_a_token_id_prompt_continues_one_sample(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
) -> None:
    """A harness that sends token ids back (prompt + answer + more) makes one sample of
    two calls: the trainer reads them as it reads chat calls, and prefix merging sees the
    second prompt extend the first exactly."""
    r = running()
    client = agent(gateway, r)
    client.completions.create(model="m", prompt=PROMPT, max_tokens=100)
    (first,) = model_requests(admin, r)
    follow = [*first["prompt_ids"], *first["response_ids"], *encode(" and")]
    client.completions.create(model="m", prompt=follow, max_tokens=8)
    events = admin.get_events(r.rollout_id, type="model_request")
    read = read_calls(events)
    assert not read.invalid and len(read.calls) == 2
    assert read.calls[1].prompt_ids == follow
    assert read.calls[1].response_ids == encode(completion_for(_decode(follow)))[:8]
    (sample,) = get("merge", "prefix")(read.calls, r.rollout_id, "g")
    assert sample.tokens == [*follow, *read.calls[1].response_ids]
    assert sum(sample.action_mask) == len(first["response_ids"]) + 8


def test_completions_errors_are_openai_errors(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
) -> None:
    r = running()
    client = agent(gateway, r)
    with pytest.raises(openai.BadRequestError) as echo:
        client.completions.create(model="m", prompt="hi", echo=True)
    assert "echo" in echo.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="")
    fake.fail_next = [500] * 10
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="m", prompt="hi")
    fake.fail_next.clear()
    (failed,) = admin.get_events(r.rollout_id, type="model_request_failed")
    assert failed.data["status"] == 500 and failed.data["prompt"] == "hi"
    fake.stream_break_after = 2
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        list(client.completions.create(model="m", prompt="hi", stream=True))
    fake.stream_break_after = None
    admin.patch_rollout(r.rollout_id, "succeeded", attempt=r.attempt)
    with pytest.raises(openai.ConflictError):
        client.completions.create(model="m", prompt="hi")
    assert model_requests(admin, r) == []


def test_count_tokens_counts_the_translated_prompt(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
) -> None:
    r = running()
    body: dict[str, Any] = {
        "model": "claude-x",
        "system": "be brief",
        "messages": [{"role": "user", "content": "hello"}],
        "tools": [{"name": "search", "input_schema": {"type": "object"}}],
    }
    counted = anthropic_agent(gateway, r).messages.count_tokens(**body)
    chat = ANTHROPIC.count_tokens_request(body)
    assert counted.input_tokens == len(prompt_ids(chat["messages"]))
    (asked,) = fake.requests
    assert asked["messages"] == chat["messages"] and asked["add_generation_prompt"] is True
    assert asked["tools"] == chat["tools"] and asked["model"] == "policy"
    assert model_requests(admin, r) == []  # nothing sampled, nothing recorded
    with pytest.raises(anthropic.BadRequestError) as bad:
        anthropic_agent(gateway, r).messages.count_tokens(
            model="m", messages=[{"role": "robot", "content": "x"}]
        )
    assert bad.value.body["type"] == "error"
    fake.fail_next = [404]
    with pytest.raises(anthropic.NotFoundError) as missing:
        anthropic_agent(gateway, r).messages.count_tokens(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
    assert "/tokenize" in missing.value.body["error"]["message"]


def _decode(ids: list[int]) -> str:
    return bytes(t - 16 for t in ids if t >= 16).decode()


# --- over the embedded server on the tiny model -----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_tiny_model_text_completions_are_trainable(
    tiny: Tiny,  # noqa: F811
    tiny_admin: GatewayClient,  # noqa: F811
    stream: bool,
) -> None:
    r = start(tiny_admin)
    client = agent(tiny.gateway, r)
    text, finish, logprobs = complete(
        client, stream, model="gpt-x", prompt=PROMPT, max_tokens=24, seed=7, logprobs=0
    )
    assert finish in ("stop", "length")
    (call,) = model_requests(tiny_admin, r)
    assert call["api"] == "completions" and call["prompt"] == PROMPT
    assert call["prompt_ids"] == tiny.tokenizer.encode(PROMPT)
    assert tiny.text(call["response_ids"]) == text == call["response"]
    values = logprobs if stream else logprobs.token_logprobs
    assert values == call["logprobs"] and len(values) == len(call["response_ids"])
    # The trainer's reading, with its text check, and a merge make one sample of it.
    events = tiny_admin.get_events(r.rollout_id, type="model_request")
    read = read_calls(events, lambda ids: tiny.tokenizer.decode(ids, skip_special_tokens=False))
    assert not read.invalid and len(read.calls) == 1
    (sample,) = get("merge", "independent")(read.calls, r.rollout_id, "g")
    assert sample.tokens == call["prompt_ids"] + call["response_ids"]
    assert sample.logprobs[len(call["prompt_ids"]) :] == call["logprobs"]


def test_tiny_model_count_tokens_is_the_messages_prompt(
    tiny: Tiny,  # noqa: F811
    tiny_admin: GatewayClient,  # noqa: F811
) -> None:
    """count_tokens answers the length of the prompt the same messages call is sampled
    from, tools and system included."""
    r = start(tiny_admin)
    client = anthropic_agent(tiny.gateway, r)
    body: dict[str, Any] = {
        "model": "claude-x",
        "system": "be brief",
        "messages": [{"role": "user", "content": "hello there"}],
        "tools": [
            {
                "name": "search",
                "description": "look it up",
                "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
            }
        ],
    }
    counted = client.messages.count_tokens(**body)
    client.messages.create(max_tokens=4, **body)
    (call,) = model_requests(tiny_admin, r)
    assert counted.input_tokens == len(call["prompt_ids"]) > 0


def test_tiny_server_completions_directly(tiny: Tiny) -> None:  # noqa: F811
    """The embedded server's own route, as vLLM shapes it: ids on the choice,
    completions-style logprobs, stop strings, token-id prompts, one choice per chunk."""
    with openai.OpenAI(base_url=tiny.url, api_key="unused", max_retries=0) as client:
        ids = tiny.tokenizer.encode(PROMPT)
        answer = client.completions.create(
            model=tiny.model,
            prompt=ids,
            max_tokens=12,
            n=2,
            logprobs=1,
            seed=3,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert answer.object == "text_completion" and len(answer.choices) == 2
        for choice in answer.choices:
            extra = choice.model_extra or {}
            assert extra["prompt_token_ids"] == ids and len(extra["token_ids"]) == 12
            assert choice.finish_reason == "length"
            assert tiny.text(extra["token_ids"]) == choice.text
            assert choice.logprobs is not None
            assert len(choice.logprobs.token_logprobs) == 12 == len(choice.logprobs.tokens)
        assert answer.usage is not None and answer.usage.completion_tokens == 24

        # A stop string ends the text before it, as vLLM: sample once, then again with
        # the same seed and a stop string from the middle of that text.
        same = {"prompt": ids, "max_tokens": 16, "seed": 5, "extra_body": {"ignore_eos": True}}
        first = client.completions.create(model=tiny.model, **same).choices[0].text
        stop = first[len(first) // 2 :][:3]
        stopped = client.completions.create(model=tiny.model, stop=[stop], **same).choices[0]
        assert stopped.text == first[: first.index(stop)] and stopped.finish_reason == "stop"
        assert stopped.text, "the stop string was meant to cut the text, not to empty it"

        chunks = list(
            client.completions.create(
                model=tiny.model,
                prompt=PROMPT,
                max_tokens=6,
                n=2,
                stream=True,
                extra_body={"return_token_ids": True},
            )
        )
        assert all(len(c.choices) == 1 for c in chunks)
        for index in (0, 1):
            mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
            assert (mine[0].model_extra or {})["prompt_token_ids"] == ids
            assert all("prompt_token_ids" not in (m.model_extra or {}) for m in mine[1:])
            streamed = [t for m in mine for t in (m.model_extra or {})["token_ids"]]
            assert tiny.text(streamed) == "".join(m.text for m in mine)
            assert mine[-1].finish_reason in ("stop", "length")

    for bad, why in [
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": ["a", "b"]}, "several prompts"),
        ({"prompt": [10**7]}, "vocabulary"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": []}, "prompt"),
    ]:
        refused = httpx.post(tiny.url + "/completions", json=bad, timeout=30)
        assert refused.status_code == 400 and why in refused.json()["error"]["message"], bad


def test_tiny_server_tokenize_agrees_with_chat(tiny: Tiny) -> None:  # noqa: F811
    root = tiny.url.removesuffix("/v1")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = httpx.post(
        tiny.url + "/chat/completions",
        json={"messages": messages, "max_tokens": 1, "return_token_ids": True},
        timeout=60,
    ).json()
    counted = httpx.post(
        root + "/tokenize", json={"messages": messages, "add_generation_prompt": True}, timeout=30
    ).json()
    assert counted["tokens"] == chat["prompt_token_ids"]
    assert counted["count"] == len(chat["prompt_token_ids"]) and counted["max_model_len"] == 1024
    text = httpx.post(root + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()
    assert text["tokens"] == tiny.tokenizer.encode(PROMPT)
