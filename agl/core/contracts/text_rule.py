"""What text a response is: one rule for which sampled tokens the returned text shows.

An engine samples token ids; the text a harness gets is those ids decoded under three of
vLLM's request fields, with vLLM's defaults:

- ``skip_special_tokens`` (True): special tokens (eos, ``<tool_call>``, ``<think>`` in
  many tokenizers) are left out of the text;
- ``spaces_between_special_tokens`` (True): kept special tokens may be joined by spaces
  (slow tokenizers; a fast one only drops them between two added tokens when False);
- ``include_stop_str_in_output`` (False): a stop string ends the text and is not in it
  (its ids are in the response either way).

The proxy resolves the rule of each request (:func:`requested_text_rule`), forwards it
explicitly, so that the embedded engine and vLLM apply the same one, and records it with
the call; the trainer checks the ids against the text under that rule, and the merge
metrics name the drift (``output_transformed``) when the text left out what the ids hold.

With tools (and ``tool_choice`` not ``none``) special tokens are kept whatever the request
says: tool-call markers are special tokens in many models and the parser must see them;
vLLM's hermes parser forces the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

FIELDS = ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")


@dataclass(frozen=True)
class TextRule:
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False


VLLM_DEFAULT = TextRule()


class TextRuleError(ValueError):
    """A text rule field that is not a boolean (the message names it)."""


def parse_text_rule(request: Mapping[str, Any], default: TextRule = VLLM_DEFAULT) -> TextRule:
    """The rule ``request`` asks for, ``default`` where it says nothing; raises
    ``TextRuleError``."""
    values = asdict(default)
    for name in FIELDS:
        value = request.get(name)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise TextRuleError(f"'{name}' must be a boolean")
        values[name] = value
    return TextRule(**values)


def uses_tools(request: Mapping[str, Any]) -> bool:
    return bool(request.get("tools")) and request.get("tool_choice", "auto") != "none"


def requested_text_rule(request: Mapping[str, Any]) -> TextRule:
    """The rule the proxy forwards and records for ``request`` (see the module)."""
    rule = parse_text_rule(request)
    if uses_tools(request) and rule.skip_special_tokens:
        rule = replace(rule, skip_special_tokens=False)
    return rule


def text_rule_record(rule: TextRule) -> dict[str, bool]:
    """How a call's rule is forwarded and stored with it (``data["text_rule"]``)."""
    return asdict(rule)


def text_rule_of(data: Mapping[str, Any]) -> TextRule | None:
    """A recorded call's rule; None for calls recorded without one (or a malformed one)."""
    record = data.get("text_rule")
    if not isinstance(record, Mapping):
        return None
    try:
        return parse_text_rule(record)
    except TextRuleError:
        return None
