"""Attacks on calls stored by what they add (issue 46), through a real gateway process:
content the model or a tool controls, answers an endpoint writes oddly, and histories
that rewrite, branch or switch APIs. Every call must read back exactly as the harness
sent it and the endpoint answered it, whatever the store kept of it."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson
import pytest

from agl.core.client import GatewayClient
from agl.core.contracts.call_validity import invalid_reason
from agl.core.contracts.queries import SummaryQuery
from agl.core.contracts.records import EventIn, Rollout, parse_storable
from agl.testing.fake_vllm import EOS, FakeVllm, encode, prompt_ids, reply_for
from agl.testing.processes import GatewayProcess
from tests.conftest import agent, base_url, model_requests

from .test_proxy_deltas import stored_rows

# Text a model or a tool can write: what the gateway looks for in an answer's bytes, the
# JSON escapes around it, and characters JSON writers escape differently (the odd
# turns stream, which the fake does a byte a token: ASCII there).
HOSTILE = [
    '"prompt_token_ids":[1,2,3]',
    '{"prompt_token_ids":[9]} \\"prompt_token_ids\\":[',
    "unicode: \u2028\u2029 \x00 \x1f é 漢字 🙂 \\u0022prompt_token_ids\\u0022:[",
    'a backslash before a quote: \\" and two: \\\\" and a lone \\',
    "]" * 40 + "[" * 40,
]


def chat_answer(prompt: list[int], *choices: tuple[str, list[int]], text: bool = False) -> bytes:
    """A vLLM-shaped unary answer with these choices (content, sampled ids), each valid;
    ``text``: a text completion's, ids on each choice."""
    out: list[dict[str, Any]] = []
    for index, (content, ids) in enumerate(choices):
        logprobs = [-0.5] * len(ids)
        choice: dict[str, Any] = {"index": index, "finish_reason": "stop", "token_ids": ids}
        if text:
            choice |= {"text": content, "prompt_token_ids": prompt}
            choice["logprobs"] = {"token_logprobs": logprobs, "tokens": ["x"] * len(ids)}
        else:
            choice["message"] = {"role": "assistant", "content": content}
            choice["logprobs"] = {"content": [{"token": "x", "logprob": lp} for lp in logprobs]}
        out.append(choice)
    answer: dict[str, Any] = {"id": "x", "object": "chat.completion", "choices": out}
    if not text:
        answer["prompt_token_ids"] = prompt
    return orjson.dumps(answer)


def context_of(admin: GatewayClient, rollout: Rollout) -> int:
    """The attempt summary's context: the longest call's whole prompt plus response."""
    rows, _ = admin.summaries(SummaryQuery(group_id=rollout.group_id, limit=10))
    (row,) = rows
    assert row.summary is not None
    return row.summary.context


def exact(value: Any) -> bytes:
    """``value`` as JSON: 1 and 1.0, or an object's keys in another order, differ."""
    return orjson.dumps(value)


@pytest.fixture
def fresh(running: Callable[..., Rollout]) -> Callable[[], Rollout]:
    """A running rollout alone in a group of its own (its summary is the only row)."""
    return lambda: running(group_id=f"g-{uuid.uuid4().hex[:10]}")


def test_hostile_content_in_answers_and_tool_output_reads_back_exactly(
    gateway: GatewayProcess, admin: GatewayClient, fresh: Callable[[], Rollout], fake: FakeVllm
) -> None:
    r = fresh()
    # The reply to the n-th turn, from the conversation itself: a call another test left
    # at the shared fake takes no turn of this one.
    fake.script = lambda messages: HOSTILE[sum(m.get("role") == "assistant" for m in messages)]
    client = agent(gateway, r)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go " * 50}]
    sent: list[list[dict[str, Any]]] = []
    for turn, tool in enumerate(HOSTILE):
        sent.append(list(messages))
        if turn % 2:
            chunks = client.chat.completions.create(model="policy", messages=messages, stream=True)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            answer = client.chat.completions.create(model="policy", messages=messages)
            content = answer.choices[0].message.content or ""
        assert content == HOSTILE[turn]
        messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": tool}]
    calls = model_requests(admin, r)
    assert [exact(c["messages"]) for c in calls] == [exact(m) for m in sent]
    assert [c["prompt_ids"] for c in calls] == [prompt_ids(m) for m in sent]
    assert [c["response"] for c in calls] == HOSTILE
    assert all("invalid" not in c for c in calls)
    assert all(base is not None for base, _ in stored_rows(gateway, r)[1:])
    last = calls[-1]
    assert context_of(admin, r) == len(last["prompt_ids"]) + len(last["response_ids"])


def test_one_very_long_message_is_stored_once(
    gateway: GatewayProcess, admin: GatewayClient, fresh: Callable[[], Rollout], fake: FakeVllm
) -> None:
    r = fresh()
    big = "the file's text \\\" " * 20_000  # ~400 kB in one tool output
    messages: list[dict[str, Any]] = [{"role": "user", "content": big}]
    sent = []
    for turn in range(3):
        sent.append(list(messages))
        answer = agent(gateway, r).chat.completions.create(model="policy", messages=messages)
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": f"go on {turn}"},
        ]
    calls = model_requests(admin, r)
    assert [exact(c["messages"]) for c in calls] == [exact(m) for m in sent]
    assert [c["prompt_ids"] for c in calls] == [prompt_ids(m) for m in sent]
    assert all(n < 100 for _, n in stored_rows(gateway, r)[1:])


def test_messages_equal_in_python_but_written_apart_end_the_shared_input(
    gateway: GatewayProcess, admin: GatewayClient, fresh: Callable[[], Rollout], fake: FakeVllm
) -> None:
    """The fake's template reads only role and content, so each prompt's ids extend the
    last: only the input's bytes tell 1 from 1.0 and one key order from another."""
    r = fresh()
    first = [
        {"role": "system", "content": "s", "weight": 1},
        {"role": "user", "content": "u", "name": "a", "cache": {"x": 1, "y": True}},
    ]
    reply = reply_for(first)
    tail = [{"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]
    variants = [
        [{"role": "system", "content": "s", "weight": 1.0}, first[1], *tail],
        [
            first[0],
            {"name": "a", "role": "user", "content": "u", "cache": first[1]["cache"]},
            *tail,
        ],
        [first[0], {**first[1], "cache": {"y": True, "x": 1}}, *tail],
        [first[0], {**first[1], "cache": {"x": True, "y": True}}, *tail],
    ]
    sent = []
    for messages in [first, *variants]:
        # Sent as these bytes: 1.0 stays a float, keys stay in their order.
        body = orjson.dumps({"model": "policy", "messages": messages})
        answer = httpx.post(
            base_url(gateway, r) + "/chat/completions",
            headers={
                "Authorization": f"Bearer {r.attempt_key}",
                "Content-Type": "application/json",
            },
            content=body,
        )
        assert answer.status_code == 200, answer.text
        sent.append(messages)
    calls = model_requests(admin, r)
    assert [exact(c["messages"]) for c in calls] == [exact(m) for m in sent]
    assert [c["prompt_ids"] for c in calls] == [prompt_ids(m) for m in sent]
    assert all(base is not None for base, _ in stored_rows(gateway, r)[1:])


def test_a_history_that_rewrites_an_earlier_message_with_the_same_ids(
    gateway: GatewayProcess, admin: GatewayClient, fresh: Callable[[], Rollout], fake: FakeVllm
) -> None:
    """An unknown role and another one template to the same ids: the prompt extends its
    base, the messages do not."""
    r = fresh()
    first = [{"role": "critic", "content": "a"}, {"role": "user", "content": "b"}]
    client = agent(gateway, r)
    content = client.chat.completions.create(model="policy", messages=first).choices[0]
    rewritten = [
        {"role": "judge", "content": "a"},
        first[1],
        {"role": "assistant", "content": content.message.content},
        {"role": "user", "content": "c"},
    ]
    client.chat.completions.create(model="policy", messages=rewritten)
    calls = model_requests(admin, r)
    assert [exact(c["messages"]) for c in calls] == [exact(first), exact(rewritten)]
    assert [c["prompt_ids"] for c in calls] == [prompt_ids(first), prompt_ids(rewritten)]
    assert stored_rows(gateway, r)[1][0] is not None  # the ids are stored on the base


def test_the_second_of_n_choices_is_extended(
    gateway: GatewayProcess, admin: GatewayClient, fresh: Callable[[], Rollout], fake: FakeVllm
) -> None:
    r = fresh()
    first = [{"role": "user", "content": "two ways"}]
    base = prompt_ids(first)
    fake.raw_next.append(
        chat_answer(base, ("one", [*encode("one"), EOS]), ("two", [*encode("two"), EOS]))
    )
    answer = agent(gateway, r).chat.completions.create(model="policy", messages=first, n=2)
    assert [c.message.content for c in answer.choices] == ["one", "two"]
    second = [*first, {"role": "assistant", "content": "two"}, {"role": "user", "content": "go"}]
    agent(gateway, r).chat.completions.create(model="policy", messages=second)
    calls = model_requests(admin, r)
    assert [c["prompt_ids"] for c in calls] == [base, base, prompt_ids(second)]
    assert [exact(c["messages"]) for c in calls] == [exact(first), exact(first), exact(second)]
    events = admin.get_events(r.rollout_id, type="model_request")
    bases = [b for b, _ in stored_rows(gateway, r)]
    assert bases == [None, None, events[1].sequence]  # on the choice it extends
    assert context_of(admin, r) == len(calls[2]["prompt_ids"]) + len(calls[2]["response_ids"])


def test_a_text_completion_on_a_chat_call_keeps_its_own_input(
    gateway: GatewayProcess, admin: GatewayClient, fresh: Callable[[], Rollout], fake: FakeVllm
) -> None:
    """A chat call, then a text completion of the same attempt whose prompt (a list an
    endpoint accepted) starts with the chat's messages and whose ids extend it: the
    completion's ``prompt`` is not the chat's ``messages``, so it shares none of it."""
    r = fresh()
    first = [{"role": "user", "content": "hi"}]
    answer = agent(gateway, r).chat.completions.create(model="policy", messages=first)
    reply = answer.choices[0].message.content or ""
    extended = [*prompt_ids(first), *encode(reply), EOS, 40, 41]
    fake.raw_next.append(chat_answer(extended, ("ok", [*encode("ok"), EOS]), text=True))
    prompt = [*first, "and more"]
    done = httpx.post(
        base_url(gateway, r) + "/completions",
        headers={"Authorization": f"Bearer {r.attempt_key}"},
        json={"model": "policy", "prompt": prompt},
    )
    assert done.status_code == 200, done.text
    calls = model_requests(admin, r)  # the attempt's record reads back
    assert [c.get("messages") for c in calls] == [first, None]
    assert calls[1]["prompt"] == prompt and calls[1]["prompt_ids"] == extended


# Answers an endpoint might write after a base's ids: the tail as it is written.
ODD_TAILS = [
    b", 40 ,41",  # whitespace
    b",40.0,41",  # a float
    b",-40",  # negative
    b",true",  # a bool
    b",2147483648",  # past the largest token id
    b",18446744073709551616",  # past 64 bits
    b",1e2",  # an exponent
]


@pytest.mark.parametrize("tail", ODD_TAILS, ids=lambda t: t.decode().strip(", "))
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_odd_ids_after_a_base_are_recorded_as_a_whole_parse_reads_them(
    gateway: GatewayProcess,
    admin: GatewayClient,
    fresh: Callable[[], Rollout],
    fake: FakeVllm,
    tail: bytes,
    stream: bool,
) -> None:
    r = fresh()
    first = [{"role": "user", "content": "hi"}]
    reply = agent(gateway, r).chat.completions.create(model="policy", messages=first)
    content = reply.choices[0].message.content or ""
    head = orjson.dumps([*prompt_ids(first), *encode(content), EOS])[:-1]
    ids_json = head + tail + b"]"
    sampled = [*encode("ok"), EOS]
    if stream:
        opening = {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
        chunks = [
            orjson.dumps(opening)[:-1] + b',"prompt_token_ids":' + ids_json + b"}",
            orjson.dumps(
                {
                    "id": "x",
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": "ok"},
                            "token_ids": sampled,
                            "logprobs": {"content": [{"token": "o", "logprob": -0.5}] * 3},
                            "finish_reason": "stop",
                        }
                    ],
                }
            ),
        ]
        fake.raw_next.append(
            b"".join(b"data: " + c + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        )
    else:
        placeholder = chat_answer([0], ("ok", sampled))
        fake.raw_next.append(
            placeholder.replace(b'"prompt_token_ids":[0]', b'"prompt_token_ids":' + ids_json)
        )
    messages = [*first, {"role": "assistant", "content": content}, {"role": "user", "content": "x"}]
    try:
        parsed = parse_storable(ids_json)
    except ValueError:
        parsed = None  # the whole answer does not read: a failed call, as before issue 46
    try:
        result = agent(gateway, r).chat.completions.create(
            model="policy", messages=messages, stream=stream
        )
        if stream:
            list(result)
    except (openai.APIError, httpx.HTTPError):
        assert parsed is None
        (failed,) = model_requests(admin, r, type="model_request_failed")
        assert failed["status"] == 502 and len(model_requests(admin, r)) == 1
        return
    calls = model_requests(admin, r)
    assert len(calls) == 2 and calls[1]["prompt_ids"] == parsed
    whole = {k: v for k, v in calls[1].items() if k != "invalid"}
    assert calls[1].get("invalid") == invalid_reason(whole)  # as before issue 46


@pytest.mark.parametrize(
    "answer",
    [
        # A duplicated key: JSON's last one counts, as the whole parse reads it.
        b'{"prompt_token_ids":[1,2,3],"choices":CHOICES,"prompt_token_ids":[7,8]}',
        b'{"prompt_token_ids":null,"choices":CHOICES}',
        b'{"prompt_token_ids": [1, 2],"choices":CHOICES}',
        b'{"prompt_token_ids":[],"choices":CHOICES}',
        b'{"prompt_token_ids":[ ],"choices":CHOICES}',
        b'{"choices":CHOICES,"usage":{"prompt_token_ids":[5]},"prompt_token_ids":[1]}',
    ],
    ids=["duplicate", "null", "spaces", "empty", "blank", "nested"],
)
def test_odd_answers_are_recorded_as_a_whole_parse_reads_them(
    gateway: GatewayProcess,
    admin: GatewayClient,
    fresh: Callable[[], Rollout],
    fake: FakeVllm,
    answer: bytes,
) -> None:
    r = fresh()
    sampled = [*encode("ok"), EOS]
    choices = orjson.loads(chat_answer([0], ("ok", sampled)))["choices"]
    payload = answer.replace(b"CHOICES", orjson.dumps(choices))
    fake.raw_next.append(payload)
    agent(gateway, r).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "a"}]
    )
    (call,) = model_requests(admin, r)
    expected = parse_storable(payload)["prompt_token_ids"]
    assert call["prompt_ids"] == expected
    whole = {k: v for k, v in call.items() if k != "invalid"}
    assert call.get("invalid") == invalid_reason(whole)


def test_a_repeated_event_id_answers_the_call_whole(
    gateway: GatewayProcess, admin: GatewayClient, fresh: Callable[[], Rollout], fake: FakeVllm
) -> None:
    """Posting an event whose id is a recorded call's stores nothing and answers the call
    as it was stored: whole, as every read gives it, not the tails its row holds."""
    r = fresh()
    sent = [{"role": "user", "content": "a"}]
    client = agent(gateway, r)
    reply = client.chat.completions.create(model="policy", messages=sent)
    sent += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "b"},
    ]
    client.chat.completions.create(model="policy", messages=sent)
    based = admin.get_events(r.rollout_id, type="model_request")[1]
    assert stored_rows(gateway, r)[1][0] is not None
    (echo,) = admin.post_events(
        r.rollout_id, r.attempt, [EventIn(event_id=based.event_id, type="note", data={})]
    )
    assert echo.sequence == based.sequence
    assert echo.data == based.data
