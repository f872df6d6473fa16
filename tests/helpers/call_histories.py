"""Recorded-call histories for the tests of prompts stored by what they add
(``agl.core.gateway.store.prompt_delta``).

``histories()`` is a Hypothesis strategy of what the recording proxy appends to a
rollout: calls of n choices whose prompts extend the last call, branch from an earlier
one, rewrite a prefix (in ways Python finds equal but JSON writes apart too), or start
afresh, with chat messages, text prompts, token-list prompts or no input; other events
between them, on two attempts; and retries of an earlier append, ids and all.
``coding_rollout`` is one realistic extending rollout, for sizes and timings.
"""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from agl.core.contracts.records import EventIn
from agl.core.gateway.store.prompt_delta import PromptBase, encode

ATTEMPTS = (1, 2)
_IDS = st.lists(st.integers(0, 2**31 - 1), max_size=4)
_TEXT = st.text(alphabet='ab \n"é\\', max_size=6)
_INPUTS = ("messages", "text", "tokens", "none")


@dataclass(frozen=True)
class Batch:
    """One append: a call's choices, or other events, of one attempt."""

    attempt: int
    events: tuple[EventIn, ...]


@dataclass(frozen=True)
class Retry:
    """An earlier append sent again, ids and all."""

    batch: Batch


Step = Batch | Retry


def reference_base(
    data: dict[str, Any], earlier: list[tuple[int, dict[str, Any]]]
) -> tuple[dict[str, Any], PromptBase] | None:
    """The reference rule: ``data`` stored on the latest of the attempt's earlier calls
    (sequence, whole data) that it extends, or None (stored whole)."""
    for sequence, base_data in reversed(earlier):
        encoded = encode(data, base_data, sequence)
        if encoded is not None:
            return encoded
    return None


def _message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(("user", "tool", "system")))
    return {"role": role, "content": draw(st.one_of(_TEXT, st.none(), st.just({"n": 1})))}


def _fresh_input(draw: st.DrawFn, kind: str) -> Any:
    if kind == "messages":
        return [_message(draw) for _ in range(draw(st.integers(1, 3)))]
    if kind == "text":
        return draw(_TEXT)
    if kind == "tokens":
        return draw(_IDS)
    return None


def _grown_input(draw: st.DrawFn, base: dict[str, Any], kind: str) -> Any:
    """What a harness sends next: the base's input, its answer, and something new."""
    if kind == "messages" and isinstance(base.get("messages"), list):
        answer = {"role": "assistant", "content": base["response"]}
        return [
            *base["messages"],
            answer,
            *(_message(draw) for _ in range(draw(st.integers(0, 2)))),
        ]
    if kind == "text" and isinstance(base.get("prompt"), str):
        return base["prompt"] + base["response"] + draw(_TEXT)
    if kind == "tokens" and isinstance(base.get("prompt"), list):
        return base["prompt"] + base["response_ids"] + draw(_IDS)
    return _fresh_input(draw, kind)


def _changed(draw: st.DrawFn, item: Any) -> Any:
    """An item Python finds equal or not, written apart as JSON either way."""
    if isinstance(item, dict):
        return draw(
            st.sampled_from(
                (
                    dict(reversed(item.items())),  # the same keys in another order
                    {**item, "content": {"n": 1.0}},
                    {**item, "content": "changed"},
                )
            )
        )
    if isinstance(item, bool):
        return not item
    if isinstance(item, int):
        return draw(st.sampled_from((item + 1, float(item))))  # 1.0 == 1 in Python
    return [item]


def _rewritten(draw: st.DrawFn, items: Any) -> Any:
    """``items`` (a list or string) with one changed at a drawn place, or cut short."""
    if not items:
        return items
    at = draw(st.integers(0, len(items) - 1))
    if isinstance(items, str):
        return items[:at] + draw(st.sampled_from(("", "Z", items[at] + "Z")))
    if draw(st.booleans()):
        return items[:at]
    return [*items[:at], _changed(draw, items[at]), *items[at + 1 :]]


def _call(
    draw: st.DrawFn, step: int, prompt_ids: list[Any], kind: str, given: Any
) -> list[EventIn]:
    """A call's events: one per choice, the same prompt and input, their own answers."""
    events = []
    for choice in range(draw(st.integers(1, 3))):
        response_ids = draw(_IDS)
        data: dict[str, Any] = {
            "prompt_ids": prompt_ids,
            "response_ids": response_ids,
            "logprobs": [-0.5 * (i + 1) for i in range(len(response_ids))],
            "choice": choice,
            "response": draw(_TEXT),
            "finish_reason": "stop",
        }
        if kind == "messages":
            data["messages"] = given
        elif kind in ("text", "tokens"):
            data["prompt"] = given
        events.append(EventIn(event_id=f"s{step}-{choice}", type="model_request", data=data))
    return events


def _other(draw: st.DrawFn, step: int) -> list[EventIn]:
    kinds = st.sampled_from(("reward", "log", "model_request_failed"))
    values = st.one_of(st.floats(-1, 1), st.integers(-3, 3), st.booleans(), st.none())
    out = []
    for i in range(draw(st.integers(1, 2))):
        kind = draw(kinds)
        data = {"value": draw(values)} if kind == "reward" else {"text": draw(_TEXT)}
        out.append(EventIn(event_id=f"s{step}-o{i}", type=kind, data=data))
    return out


@st.composite
def histories(draw: st.DrawFn, max_steps: int = 10) -> list[Step]:
    """What the proxy (and the harness's own events) append to one rollout."""
    calls: dict[int, list[dict[str, Any]]] = {a: [] for a in ATTEMPTS}
    steps: list[Step] = []
    for step in range(draw(st.integers(1, max_steps))):
        attempt = draw(st.sampled_from(ATTEMPTS))
        earlier = calls[attempt]
        action = draw(
            st.sampled_from(("extend", "extend", "branch", "rewrite", "fresh", "retry", "other"))
        )
        batches = [s for s in steps if isinstance(s, Batch)]
        if action == "retry" and batches:
            steps.append(Retry(draw(st.sampled_from(batches))))
            continue
        if action == "other":
            steps.append(Batch(attempt, tuple(_other(draw, step))))
            continue
        kind = draw(st.sampled_from(_INPUTS))
        if action in ("extend", "branch", "rewrite") and earlier:
            base = earlier[-1] if action == "extend" else draw(st.sampled_from(earlier))
            if draw(st.integers(0, 4)):  # mostly the base's kind of input, grown
                kind = _kind_of(base)
            prompt_ids = base["prompt_ids"] + base["response_ids"] + draw(_IDS)
            given = _grown_input(draw, base, kind)
            if action == "rewrite":
                prompt_ids = _rewritten(draw, prompt_ids)
                if given is not None and draw(st.booleans()):
                    given = _rewritten(draw, given)
        else:
            prompt_ids, given = draw(_IDS), _fresh_input(draw, kind)
        events = _call(draw, step, prompt_ids, kind, given)
        earlier.extend(e.data for e in events)
        steps.append(Batch(attempt, tuple(events)))
    return steps


def _kind_of(data: dict[str, Any]) -> str:
    if isinstance(data.get("messages"), list):
        return "messages"
    prompt = data.get("prompt")
    return "text" if isinstance(prompt, str) else "tokens" if isinstance(prompt, list) else "none"


# -- one realistic extending rollout -------------------------------------------------


def _text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of code-like text, ~4 characters a token."""
    out: list[str] = []
    size = 0
    while size < 4 * tokens:
        if rng.random() < 0.9:
            word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 8)))
        else:
            word = rng.choice(string.punctuation)  # a quote or backslash JSON escapes
        out.append(word)
        out.append("\n" if rng.random() < 0.1 else " ")
        size += len(word) + 1
    return "".join(out)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(150_000) for _ in range(n)]


def coding_calls(
    first: int = 1_000, added: int = 800, response: int = 200, seed: int = 0
) -> Iterator[dict[str, Any]]:
    """The data of a coding agent's model_requests, without end: each prompt extends the
    last call's prompt and answer by a tool's output of ``added`` tokens, from ``first``
    prompt tokens; answers of ``response`` tokens with their logprobs, and the fields the
    proxy records beside them. Text is ~4 characters a token."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": _text(rng, first // 2)},
        {"role": "user", "content": _text(rng, first // 2)},
    ]
    prompt_ids = _ids(rng, first)
    data: dict[str, Any] = {}
    for i in itertools.count():
        if data:  # the call before, answered
            messages = [
                *messages,
                {"role": "assistant", "content": data["response"]},
                {"role": "tool", "content": _text(rng, added), "tool_call_id": f"call_{i}"},
            ]
            prompt_ids = prompt_ids + data["response_ids"] + _ids(rng, added)
        data = {
            "prompt_ids": prompt_ids,
            "response_ids": _ids(rng, response),
            # as vLLM's JSON gives them: all of a double's digits
            "logprobs": [-rng.expovariate(4.0) for _ in range(response)],
            "policy_version": 3,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0},
            "choice": 0,
            "finish_reason": "stop",
            "text_rule": {"skip_special_tokens": True},
            "messages": messages,
            "response": _text(rng, response),
            "latency_s": rng.uniform(0.5, 5.0),
            "model": "policy",
            "endpoint": "http://vllm-0.vllm:8000/v1",
            "mode": "train",
        }
        yield data


def coding_rollout(
    calls: int = 30, first: int = 1_000, last: int = 30_000, response: int = 200
) -> list[dict[str, Any]]:
    """``calls`` of :func:`coding_calls`, their prompts growing from ``first`` to about
    ``last`` tokens."""
    added = (last - first) // max(calls - 1, 1) - response
    return list(itertools.islice(coding_calls(first, added, response), calls))
