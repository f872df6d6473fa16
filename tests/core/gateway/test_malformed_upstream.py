"""Malformed model-server output: the harness keeps its answer, the record says why the
call cannot be trained on, and the trainer leaves it out, counted by reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agl.core.client import GatewayClient
from agl.core.contracts.call_validity import invalid_reason
from agl.core.contracts.records import Event, Rollout, Status
from agl.core.trainer.assemble import FinishedRollout, assemble
from agl.core.trainer.calls import read_calls
from agl.strategies.advantage.rollout import rollout_advantage
from agl.strategies.merge.prefix import prefix as merge_prefix
from agl.testing.fake_vllm import BYTE_OFFSET, FakeVllm, encode
from agl.testing.processes import GatewayProcess
from tests.conftest import agent, base_url

TEXT = "four"
GOOD: dict[str, Any] = {
    "prompt_token_ids": [1, 4, 20, 2],
    "token_ids": encode(TEXT),
    "logprobs": [-0.5] * len(TEXT),
}


def answer(**changes: Any) -> bytes:
    """A vLLM-shaped answer with ``changes`` applied (a value of ``...`` drops the key)."""
    fields = {**GOOD, **changes}
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": fields.get("text", TEXT)},
        "finish_reason": "stop",
    }
    if fields["token_ids"] is not ...:
        choice["token_ids"] = fields["token_ids"]
    if fields["logprobs"] is not ...:
        choice["logprobs"] = {"content": [{"token": "t", "logprob": x} for x in fields["logprobs"]]}
    body: dict[str, Any] = {"id": "c", "object": "chat.completion", "choices": [choice]}
    if fields["prompt_token_ids"] is not ...:
        body["prompt_token_ids"] = fields["prompt_token_ids"]
    return orjson.dumps(body)


def fake_decode(ids: list[int]) -> str:
    return bytes(t - BYTE_OFFSET for t in ids if t >= BYTE_OFFSET).decode(errors="replace")


MALFORMED = {
    "no_response_ids": answer(token_ids=...),
    "no_prompt_ids": answer(prompt_token_ids=...),
    "bad_response_ids": answer(token_ids=["f", "o", "u", "r"]),
    "bad_prompt_ids": answer(prompt_token_ids=[1, -4, 2]),
    "logprobs_length": answer(logprobs=[-0.5]),
    "bad_logprobs": answer(logprobs=[-0.5, None, -0.5, -0.5]),
}


@pytest.mark.parametrize("reason", sorted(MALFORMED))
def test_a_malformed_answer_reaches_the_harness_and_is_recorded_invalid(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
    reason: str,
) -> None:
    r = running()
    fake.raw_next = [MALFORMED[reason], answer()]
    client = openai.OpenAI(base_url=base_url(gateway, r), api_key=r.attempt_key, max_retries=0)
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user"}])
        assert reply.choices[0].message.content == TEXT
    events = admin.get_events(r.rollout_id, type="model_request")
    assert [e.data.get("invalid") for e in events] == [reason, None]
    read = read_calls(events, fake_decode)
    assert read.invalid == {reason: 1}
    assert [c.response_ids for c in read.calls] == [GOOD["token_ids"]]


def test_nan_is_not_json_so_the_call_fails_and_is_not_trained_on(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
) -> None:
    r = running()
    fake.raw_next = [answer().replace(b"-0.5", b"NaN", 1)]
    client = openai.OpenAI(base_url=base_url(gateway, r), api_key=r.attempt_key, max_retries=0)
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model="policy", messages=[{"role": "user"}])
    assert raised.value.status_code == 502
    assert admin.get_events(r.rollout_id, type="model_request") == []
    (failed,) = admin.get_events(r.rollout_id, type="model_request_failed")
    assert "malformed completion" in failed.data["error"]


def nested(depth: int) -> bytes:
    """A list ``depth`` levels deep (orjson will not write one past 254)."""
    return b"[" * depth + b"]" * depth


BREAKS_THE_STORE = {
    "nested_251": answer(token_ids="X").replace(b'"X"', nested(251)),
    "nested_300": answer(token_ids="X").replace(b'"X"', nested(300)),
    "integer_past_64_bits": answer(token_ids="X").replace(b'"X"', b"[18446744073709551616]"),
}


@pytest.mark.parametrize("case", sorted(BREAKS_THE_STORE))
def test_an_answer_the_store_cannot_keep_fails_the_call_and_the_rollout_still_reads(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
    case: str,
) -> None:
    """The storable-JSON rules of a request hold for the upstream's answer too: it used
    to be stored, and from then on the rollout's events answered 500 (or, at 300 levels,
    the call answered 500 and nothing was recorded)."""
    r = running()
    fake.raw_next = [BREAKS_THE_STORE[case], answer()]
    client = agent(gateway, r)
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model="policy", messages=[{"role": "user"}])
    assert raised.value.status_code == 502
    assert "malformed completion" in raised.value.message
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user"}])
    assert reply.choices[0].message.content == TEXT
    (failed,) = admin.get_events(r.rollout_id, type="model_request_failed")
    assert "malformed completion" in failed.data["error"]
    assert ("64 bits" if case.startswith("integer") else "deeper") in failed.data["error"]
    (recorded,) = admin.get_events(r.rollout_id, type="model_request")  # still reads: 200
    assert recorded.data["response_ids"] == GOOD["token_ids"]


def sse(*chunks: dict[str, Any]) -> bytes:
    events = [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks]
    return b"".join([*events, b"data: [DONE]\n\n"])


def chunk(index: Any = 0, **delta: Any) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "token_ids": [20], "finish_reason": None}
    return {"id": "c", "object": "chat.completion.chunk", "choices": [choice]}


FIRST = {**chunk(role="assistant", content=""), "prompt_token_ids": GOOD["prompt_token_ids"]}
MALFORMED_STREAMS = {
    "content_is_a_number": sse(FIRST, chunk(content=4)),
    "content_is_an_object": sse(FIRST, chunk(content={"text": "four"})),
    "indexes_mix_types": sse(FIRST, chunk(index="1", content="four")),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_STREAMS))
def test_a_malformed_stream_ends_in_an_error_and_is_recorded_as_failed(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
    case: str,
) -> None:
    """As a stream that breaks off: a chat stream is cut short (it has no error event),
    so the client raises rather than take a truncated answer; it used to crash after
    the relay, with a traceback and no record at all."""
    r = running()
    fake.raw_next = [MALFORMED_STREAMS[case]]
    client = agent(gateway, r)
    with pytest.raises(openai.APIError):
        list(
            client.chat.completions.create(model="policy", messages=[{"role": "user"}], stream=True)
        )
    assert admin.get_events(r.rollout_id, type="model_request") == []
    (failed,) = admin.get_events(r.rollout_id, type="model_request_failed")
    assert failed.data["status"] == 502
    assert "stream broke" in failed.data["error"] and "not a" in failed.data["error"]


def test_ids_that_do_not_decode_to_the_text_are_left_out(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    fake: FakeVllm,
) -> None:
    r = running()
    fake.raw_next = [answer(token_ids=encode("five"))]
    client = openai.OpenAI(base_url=base_url(gateway, r), api_key=r.attempt_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user"}])
    events = admin.get_events(r.rollout_id, type="model_request")
    assert events[0].data.get("invalid") is None  # the gateway has no tokenizer
    assert read_calls(events).invalid == {}
    assert read_calls(events, fake_decode).invalid == {"ids_do_not_match_text": 1}


def test_left_out_calls_are_counted_in_the_step_metrics() -> None:
    rollouts = [
        FinishedRollout(
            "a", "g", "train", Status.SUCCEEDED, 1.0, [], invalid_calls={"bad_logprobs": 2}
        ),
        FinishedRollout(
            "b", "g", "train", Status.SUCCEEDED, 0.0, [], invalid_calls={"bad_logprobs": 1}
        ),
    ]
    metrics = assemble(rollouts, merge_prefix, rollout_advantage).metrics
    assert metrics["calls/invalid"] == 3
    assert metrics["calls/invalid/bad_logprobs"] == 3


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=12,
)


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "prompt_ids": JSON,
            "response_ids": JSON,
            "logprobs": JSON,
            "policy_version": JSON,
        },
    )
)
def test_any_recorded_data_is_either_trainable_or_has_a_reason(data: dict[str, Any]) -> None:
    """Whatever an endpoint sends, reading it never raises, and what is kept makes a
    well-formed call."""
    reason = invalid_reason(data)
    read = read_calls([_event(data)])
    if reason is None:
        (call,) = read.calls
        assert len(call.logprobs) == len(call.response_ids) > 0
    else:
        assert read.calls == [] and read.invalid == {reason: 1}


def test_recorded_data_that_is_not_an_object_is_left_out() -> None:
    read = read_calls([_event([1, 2]), _event("text"), _event(None)])
    assert read.calls == [] and read.invalid == {"not_an_object": 3}


def _event(data: Any) -> Event:
    return Event(
        rollout_id="r", attempt=1, event_id="e", sequence=1, type="model_request", data=data, time=0
    )
