"""From recorded events to the model calls that merging works on.

A recorded call can be unusable: an endpoint that returns no token ids, ids that are not
token ids, logprobs that do not line up with the response or are not finite, ids that do
not decode to the text the harness received. :func:`invalid_reason` names what is wrong;
the proxy stores the reason with the call (``data["invalid"]``) and the trainer leaves
such calls out, counting them by reason, instead of training on them or crashing.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.core.types import ModelCall

# Token ids above this are not ids of any vocabulary (and overflow int32 tensors).
MAX_TOKEN_ID = 2**31 - 1
# A logprob is <= 0; rounding in an engine's float16/32 path may leave it barely above.
_LOGPROB_SLACK = 1e-3


def invalid_reason(data: object) -> str | None:
    """Why a ``model_request`` event's data cannot be trained on, or None if it can."""
    if not isinstance(data, Mapping):
        return "not_an_object"
    for name in ("prompt_ids", "response_ids"):
        ids = data.get(name)
        if not ids:
            return f"no_{name}"
        if not isinstance(ids, list) or not all(_is_token_id(t) for t in ids):
            return f"bad_{name}"
    logprobs = data.get("logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(data["response_ids"]):
        return "logprobs_length"
    if not all(_is_logprob(x) for x in logprobs):
        return "bad_logprobs"
    version = data.get("policy_version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        return "bad_policy_version"
    return None


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def _is_logprob(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value <= _LOGPROB_SLACK
    )


def text_mismatch(data: Mapping[str, Any], decode: Callable[[list[int]], str]) -> bool:
    """The response ids do not decode to the text the harness got. Only plain text
    answers are checked: tool calls and reasoning are parsed out of the decoded text by
    the server, so their text is legitimately not a substring of it."""
    text = data.get("response")
    if not isinstance(text, str) or not text.strip() or data.get("tool_calls"):
        return False
    return text.strip() not in decode(data["response_ids"])


@dataclass(frozen=True)
class ReadCalls:
    calls: list[ModelCall]
    invalid: Counter[str] = field(default_factory=Counter)  # reason -> calls left out


def shown_messages(data: Mapping[str, Any]) -> list[Any]:
    """A recorded call's prompt as chat messages, for people to read: its ``messages``,
    or a text completion's ``prompt`` as one message of role ``prompt``."""
    messages = data.get("messages")
    if isinstance(messages, list):
        return messages
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "prompt", "content": prompt}]
    return []


def dedup(calls: Sequence[ModelCall]) -> list[ModelCall]:
    """Drop retried calls: of calls with identical ``prompt_ids``, keep the last.

    The gateway replays an answer it recorded and then lost by dying; an answer lost
    while it lived (the harness timed out and retried) leaves two generations of the same
    prompt, and the last one is the answer the harness went on with (the paper's
    "Network Issues").
    Kept calls stay in the order they were made.
    """
    last = {tuple(c.prompt_ids): i for i, c in enumerate(calls)}
    return [c for i, c in enumerate(calls) if last[tuple(c.prompt_ids)] == i]


def read_calls(
    events: Iterable[Any], decode: Callable[[list[int]], str] | None = None
) -> ReadCalls:
    """The ``model_request`` events of one attempt, in order, as calls, without the
    invalid ones (counted by reason; ``decode`` adds the check against the text)."""
    calls: list[ModelCall] = []
    invalid: Counter[str] = Counter()
    for event in sorted(events, key=lambda e: e.sequence):
        if event.type != "model_request":
            continue
        data = event.data
        reason = invalid_reason(data) or data.get("invalid")
        if reason is None and decode is not None and text_mismatch(data, decode):
            reason = "ids_do_not_match_text"
        if reason is not None:
            invalid[str(reason)] += 1
            continue
        calls.append(
            ModelCall(
                prompt_ids=list(data["prompt_ids"]),
                response_ids=list(data["response_ids"]),
                logprobs=[float(x) for x in data["logprobs"]],
                policy_version=int(data.get("policy_version", 0)),
            )
        )
    return ReadCalls(calls, invalid)


def calls_from_events(events: Iterable[Any]) -> list[ModelCall]:
    """The trainable calls of one attempt's events, in order."""
    return read_calls(events).calls
