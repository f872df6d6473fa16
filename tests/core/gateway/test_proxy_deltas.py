"""A call that extends an earlier call of its attempt, through a real gateway process:
parsed, checked and stored by what it adds, and read back exactly as it was sent."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from agl.core.client import GatewayClient
from agl.core.contracts.records import Rollout
from agl.testing.fake_vllm import EOS, FakeVllm, encode, prompt_ids, reply_for, serve_in_thread
from agl.testing.processes import GatewayProcess
from tests.conftest import agent, base_url, model_requests


def stored_rows(gateway: GatewayProcess, rollout: Rollout) -> list[tuple[int | None, int]]:
    """(base sequence, prompt ids stored) of the rollout's calls, in order, as the store
    file holds them (a read-only look behind the API)."""
    path = f"file:{gateway.run_dir / 'gateway.db'}?mode=ro"
    with contextlib.closing(sqlite3.connect(path, uri=True)) as db:
        return db.execute(
            "SELECT prompt_base, json_array_length(CAST(data AS TEXT), '$.prompt_ids') "
            "FROM events WHERE rollout_id = ? AND type = 'model_request' ORDER BY seq",
            (rollout.rollout_id,),
        ).fetchall()


def converse(
    gateway: GatewayProcess, rollout: Rollout, turns: int, stream_at: int = -1
) -> list[list[dict[str, Any]]]:
    """A conversation of ``turns`` calls, each prompt the last one, its answer and a tool's
    output; the ``stream_at``-th call streams. Answers each call's messages."""
    client = agent(gateway, rollout)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "you are a coding agent " * 20},
        {"role": "user", "content": "fix the bug"},
    ]
    sent: list[list[dict[str, Any]]] = []
    for turn in range(turns):
        sent.append(list(messages))
        if turn == stream_at:
            chunks = client.chat.completions.create(model="policy", messages=messages, stream=True)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            answer = client.chat.completions.create(model="policy", messages=messages)
            content = answer.choices[0].message.content or ""
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"tool output {turn}: " + "x" * 40},
        ]
    return sent


def test_an_extending_conversation_is_stored_by_what_each_call_adds(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running()
    sent = converse(gateway, r, turns=4, stream_at=2)
    calls = model_requests(admin, r)
    assert [c["messages"] for c in calls] == sent  # read back whole
    assert [c["prompt_ids"] for c in calls] == [prompt_ids(m) for m in sent]
    assert all("invalid" not in c for c in calls)
    rows = stored_rows(gateway, r)
    assert rows[0][0] is None and all(base is not None for base, _ in rows[1:])
    # What each call adds: its tool output's template, far fewer than its whole prompt.
    assert all(n < len(encode("tool output 0: " + "x" * 40)) + 8 for _, n in rows[1:])


def test_a_rewritten_history_is_stored_whole_and_read_back_whole(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running()
    first = converse(gateway, r, turns=2)
    compacted = [{"role": "user", "content": "summary of the work so far"}]
    agent(gateway, r).chat.completions.create(model="policy", messages=compacted)
    branch = [*first[1][:2], {"role": "user", "content": "another way"}]  # a shared start
    agent(gateway, r).chat.completions.create(model="policy", messages=branch)
    calls = model_requests(admin, r)
    assert [c["messages"] for c in calls] == [*first, compacted, branch]
    assert [c["prompt_ids"] for c in calls] == [prompt_ids(m) for m in [*first, compacted, branch]]
    assert [base is None for base, _ in stored_rows(gateway, r)] == [True, False, True, True]


def test_a_text_completion_that_extends_the_last_is_stored_by_what_it_adds(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running()
    prompt, prompts = "def add(a, b):", []
    for _ in range(3):
        prompts.append(prompt)
        # max_tokens ends the text before its EOS: the next prompt holds every sampled id.
        answer = httpx.post(
            base_url(gateway, r) + "/completions",
            headers={"Authorization": f"Bearer {r.attempt_key}"},
            json={"model": "policy", "prompt": prompt, "max_tokens": 4},
        ).json()
        prompt += answer["choices"][0]["text"] + "\n    "
    calls = model_requests(admin, r)
    assert [c["prompt"] for c in calls] == prompts
    assert [c["prompt_ids"] for c in calls] == [encode(p) for p in prompts]
    assert [base is None for base, _ in stored_rows(gateway, r)] == [True, False, False]


def test_bad_ids_after_a_base_mark_the_call_and_it_is_no_base(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running()
    (first,) = converse(gateway, r, turns=1)
    reply = reply_for(first)
    # An endpoint's bug, after the ids the base holds:
    bad = [*prompt_ids(first), *encode(reply), EOS, -5, 40]
    fake.raw_next.append(
        orjson.dumps(
            {
                "id": "x",
                "object": "chat.completion",
                "model": "policy",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "logprobs": {"content": [{"token": "o", "logprob": -0.5}]},
                        "finish_reason": "stop",
                        "token_ids": [EOS],
                    }
                ],
                "prompt_token_ids": bad,
            }
        )
    )
    messages = [*first, {"role": "assistant", "content": reply}]
    agent(gateway, r).chat.completions.create(model="policy", messages=messages)
    later = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    agent(gateway, r).chat.completions.create(model="policy", messages=later)
    calls = model_requests(admin, r)
    assert calls[1]["prompt_ids"] == bad and calls[1]["invalid"] == "bad_prompt_ids"
    assert calls[2]["prompt_ids"] == prompt_ids(later) and "invalid" not in calls[2]
    bases = [base for base, _ in stored_rows(gateway, r)]
    first_sequence = admin.get_events(r.rollout_id, type="model_request")[0].sequence
    assert bases == [None, None, first_sequence]  # the later call extends the valid one


def test_the_wide_fake_answers_prompts_that_extend_the_last_and_its_answer() -> None:
    """The benchmark's upstream (4 bytes a token, cached per message): what it answers
    for a conversation's next prompt starts with the last prompt and the ids sampled."""
    with serve_in_thread(FakeVllm(token_bytes=4)) as (url, _):
        messages = [{"role": "user", "content": "read the repository " * 30}]
        last: list[int] = []
        for turn in range(3):
            answer = httpx.post(
                url + "/chat/completions",
                json={"messages": messages, "return_token_ids": True, "stream": turn == 1},
            )
            if turn == 1:
                chunks = [orjson.loads(line[6:]) for line in answer.text.split("\n\n")[:-2]]
                prompt = chunks[0]["prompt_token_ids"]
                sampled = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
                content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            else:
                body = answer.json()
                prompt, sampled = body["prompt_token_ids"], body["choices"][0]["token_ids"]
                content = body["choices"][0]["message"]["content"]
            assert prompt[: len(last)] == last and len(prompt) > len(last)
            assert len(prompt) < len(orjson.dumps(messages)) // 2  # several bytes a token
            last = prompt + sampled
            messages += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": f"tool output {turn}"},
            ]
