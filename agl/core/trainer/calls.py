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

from agl.core.contracts.samples import NO_TRANSFORM, ModelCall
from agl.core.contracts.sampling import sampling_of
from agl.core.contracts.text_rule import TextRule, text_rule_of

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
    if sampling_of(data) is None:
        return "bad_sampling"
    choice = data.get("choice", 0)
    if not isinstance(choice, int) or isinstance(choice, bool) or choice < 0:
        return "bad_choice"
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


@dataclass(frozen=True)
class TokenText:
    """A tokenizer's text of token ids, special tokens kept (what the merges compare),
    and which ids are special: an engine may leave those out of the text it returns
    (vLLM does unless asked, ``skip_special_tokens``)."""

    decode_ids: Callable[[list[int]], str]
    special_ids: frozenset[int] = frozenset()

    def __call__(self, ids: Sequence[int]) -> str:
        return self.decode_ids(list(ids))

    def without_specials(self, ids: Sequence[int]) -> str:
        return self.decode_ids([t for t in ids if t not in self.special_ids])


def text_mismatch(data: Mapping[str, Any], decode: Callable[[list[int]], str]) -> bool:
    """The response ids do not decode to the text the harness got, under the text rule
    the call recorded (special tokens skipped or kept; ``decode`` a :class:`TokenText`
    knows which are special), or, for a call recorded without one, under either.

    Only plain text answers are checked: tool calls and reasoning are parsed out of the
    decoded text by the server, so their text is legitimately not a substring of it. A
    stop string cut from the text leaves it a prefix of the decode, so the check is a
    substring one. Engines decode a response as it follows its prompt, and a prompt that
    ends inside a character (raw ids sent to a completion) leaves its unreleased text to
    the response's: then the prompt is decoded in front. Ids changed only in skipped
    special tokens decode to the same text and are not caught, nor, under a rule that
    keeps special tokens without spaces between them, ids changed only in whitespace.
    """
    text = data.get("response")
    if not isinstance(text, str) or not text.strip() or data.get("tool_calls"):
        return False
    ids = data["response_ids"]
    rule = text_rule_of(data)
    if _decodes_to(text.strip(), ids, rule, decode):
        return False
    prompt = data.get("prompt_ids") or []
    if not decode(prompt[-_UNFINISHED_CHARACTER:]).endswith("\ufffd"):
        return True
    return not _decodes_to(text.strip(), [*prompt, *ids], rule, decode)


# Ids enough to hold the start of one unfinished character (UTF-8: up to 3 bytes).
_UNFINISHED_CHARACTER = 3


def _decodes_to(
    text: str, ids: list[int], rule: TextRule | None, decode: Callable[[list[int]], str]
) -> bool:
    if not isinstance(decode, TokenText):
        return text in decode(ids)
    if rule is not None and not rule.skip_special_tokens:
        if rule.spaces_between_special_tokens:
            return text in decode(ids)
        # Kept special tokens lose the spaces a decode puts between two of them: this rule
        # is checked without whitespace.
        return _squeezed(text) in _squeezed(decode(ids))
    return (rule is None and text in decode(ids)) or text in decode.without_specials(ids)


def _squeezed(text: str) -> str:
    return "".join(text.split())


def output_transformed(data: Mapping[str, Any], special_ids: frozenset[int]) -> bool:
    """The text the harness got leaves out part of the ids: a stop string was cut from
    it, or a special token was skipped, other than the eos the call ended on (which the
    chat template puts back as the end of the turn)."""
    rule = text_rule_of(data)
    if rule is None:
        return False
    if isinstance(data.get("stop_reason"), str) and not rule.include_stop_str_in_output:
        return True
    ids = data["response_ids"]
    if data.get("finish_reason") in ("stop", "tool_calls"):
        ids = ids[:-1]
    return rule.skip_special_tokens and any(t in special_ids for t in ids)


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


DEDUP_RULES = ("continued", "last")


def dedup(calls: Sequence[ModelCall], rule: str = "continued") -> list[ModelCall]:
    """The calls the harness went on with, in the order they were made.

    Two calls with identical ``prompt_ids`` are the choices of one ``n > 1`` request, a
    retry (the harness timed out, or its answer was lost: the paper's "Network Issues"),
    or a prompt sent again on purpose (a context reset, a subagent started from the same
    opening). ``rule``:

    - ``continued`` (default; loses no call the harness used): a call is *continued* when
      a later call's prompt extends its prompt and, of the calls with that prompt made
      before it, matches this one's response furthest (ties: the latest request, then its
      lowest choice). A call is kept when it is continued, or when nothing continued its
      request and no later request has its prompt: then its request's choice 0 (what a
      client takes by default). So a retry is dropped, an unused choice is dropped, and a
      prompt sent again after its first answer was used keeps both calls.
    - ``last``: of calls with identical ``prompt_ids``, keep the last (the paper's rule).

    Invariants (property-tested): the result is a subsequence of ``calls``; every call
    that a later prompt continues is in it under ``continued``; of calls with one prompt
    and nothing continuing them, exactly one is kept.
    """
    if rule == "last":
        latest = {tuple(c.prompt_ids): i for i, c in enumerate(calls)}
        return [c for i, c in enumerate(calls) if latest[tuple(c.prompt_ids)] == i]
    if rule != "continued":
        raise ValueError(f"unknown dedup rule {rule!r}; use one of {', '.join(DEDUP_RULES)}")
    requests = _requests(calls)
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    continued: set[int] = set()
    for j, call in enumerate(calls):
        for members in by_prompt.values():
            prompt = calls[members[0]].prompt_ids
            n = len(prompt)
            if len(call.prompt_ids) > n and call.prompt_ids[:n] == prompt:
                continued.add(_best_match(calls, members, call.prompt_ids, n, requests))
        by_prompt.setdefault(tuple(call.prompt_ids), []).append(j)
    used = {requests[i] for i in continued}
    last = {requests[m[-1]] for m in by_prompt.values()}
    first_choice: dict[int, int] = {}
    for i, r in enumerate(requests):
        first_choice.setdefault(r, i)
    return [
        c
        for i, c in enumerate(calls)
        if i in continued
        or (requests[i] not in used and requests[i] in last and first_choice[requests[i]] == i)
    ]


def _requests(calls: Sequence[ModelCall]) -> list[int]:
    """Which request each call is a choice of: a new one starts at each choice 0 (or a
    choice index that does not follow the one before, or another prompt)."""
    out: list[int] = []
    for i, c in enumerate(calls):
        same = i > 0 and c.choice > calls[i - 1].choice and c.prompt_ids == calls[i - 1].prompt_ids
        out.append(out[-1] if same else (out[-1] + 1 if out else 0))
    return out


def _best_match(
    calls: Sequence[ModelCall],
    members: Sequence[int],
    later_prompt: Sequence[int],
    n: int,
    requests: Sequence[int],
) -> int:
    """Of ``members`` (calls with the prompt of length ``n``), the one whose response the
    later prompt matches furthest: ties go to the latest request, then its first choice."""

    def key(i: int) -> tuple[int, int, int]:
        response = calls[i].response_ids
        rest = later_prompt[n : n + len(response)]
        match = 0
        while match < len(rest) and rest[match] == response[match]:
            match += 1
        return (match, requests[i], -calls[i].choice)

    return max(members, key=key)


def read_calls(
    events: Iterable[Any], decode: Callable[[list[int]], str] | None = None
) -> ReadCalls:
    """The ``model_request`` events of one attempt, in order, as calls, without the
    invalid ones (counted by reason; ``decode`` adds the check against the text)."""
    calls: list[ModelCall] = []
    invalid: Counter[str] = Counter()
    specials = decode.special_ids if isinstance(decode, TokenText) else frozenset()
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
                sampling=sampling_of(data) or NO_TRANSFORM,
                choice=int(data.get("choice", 0)),
                output_transformed=output_transformed(data, specials),
            )
        )
    return ReadCalls(calls, invalid)


def calls_from_events(events: Iterable[Any]) -> list[ModelCall]:
    """The trainable calls of one attempt's events, in order."""
    return read_calls(events).calls
