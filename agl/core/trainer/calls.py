"""From recorded events to the model calls that merging works on.

A recorded call can be unusable: an endpoint that returns no token ids, ids that are not
token ids, logprobs that do not line up with the response or are not finite
(``agl.core.contracts.call_validity.invalid_reason``, which the proxy stores with the
call as ``data["invalid"]``), ids that do not decode to the text the harness received
(checked here). The trainer leaves such calls out, counting them by reason, instead of
training on them or crashing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.core.contracts.call_validity import invalid_reason
from agl.core.contracts.samples import NO_TRANSFORM, ModelCall
from agl.core.contracts.sampling import sampling_of
from agl.core.contracts.text_rule import TextRule, text_rule_of


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
