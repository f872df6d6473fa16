"""Tool calls: a sampled text to OpenAI's ``tool_calls`` by a named parser, read as vLLM's
parser of the same name (``--tool-call-parser``) reads it.

- ``hermes``: ``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen2.5/Qwen3, agl's own
  template). Content is the text before the first block.
- ``llama3_json``: JSON objects ``{"name": ..., "parameters": {...}}`` anywhere in the
  text, optionally after ``<|python_tag|>`` (Llama 3.1-3.3). Content is dropped when a
  call parses, as vLLM drops it.

Every parser re-serializes the arguments with ``json.dumps``: the text a harness carries
into its history is not the sampled one (a source of retokenization drift).

Where agl reads differently from vLLM (``tests/backends/inference/test_tool_parsers.py``
checks each against vLLM's own parsers): arguments that are a JSON string are decoded
(vLLM encodes the string again), and arguments that are not an object, or missing, make
the text content (vLLM passes them on as they are); hermes also takes ``parameters`` for
``arguments``, leaves out the newline its template puts before the first block, and
makes an unterminated block content (vLLM parses it to the end of the text). The engines
then disagree only on text no harness can use as a call.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

Parsed = tuple[str | None, list[dict[str, Any]]]


class ToolParser(Protocol):
    @property
    def name(self) -> str:
        """vLLM's name for the format."""

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether a request with tools keeps special tokens in its text, whatever it
        asks (vLLM's parser of this name forces it: its markers may be special tokens)."""

    def parse(self, text: str) -> Parsed | None:
        """``(content, tool_calls)`` when ``text`` holds tool calls, else None."""

    def held_from(self, text: str) -> int:
        """Where a stream must stop showing ``text``: what follows may still parse into
        tool calls once the choice is over."""


def partial_suffix(text: str, pattern: str) -> int:
    """The length of the longest end of ``text`` that begins ``pattern`` (not all of it)."""
    for k in range(min(len(pattern) - 1, len(text)), 0, -1):
        if text.endswith(pattern[:k]):
            return k
    return 0


def _call(name: object, arguments: object) -> dict[str, Any] | None:
    """An OpenAI tool call, or None when the name or the arguments are not usable."""
    if not isinstance(name, str):
        return None
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


@functools.cache
def _block_pattern(start: str, end: str) -> re.Pattern[str]:
    return re.compile(re.escape(start) + "(.*?)" + re.escape(end), re.DOTALL)


@dataclass(frozen=True)
class HermesParser:
    """Like vLLM's ``hermes``: each block's JSON must be an object with a string ``name``;
    any block that is not valid JSON, or an unterminated one, makes the whole text plain
    content. The newline the template puts before the first block is not content."""

    name: str = "hermes"
    keeps_special_tokens: bool = True
    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def parse(self, text: str) -> Parsed | None:
        at = text.find(self.start)
        if at < 0:
            return None
        tail = text[at:]
        blocks = _block_pattern(self.start, self.end).findall(tail)
        if not blocks or len(blocks) != tail.count(self.start):
            return None
        calls = []
        for raw in blocks:
            try:
                parsed = json.loads(raw)
            except ValueError:
                return None
            if not isinstance(parsed, dict):
                return None
            call = _call(parsed.get("name"), parsed.get("arguments", parsed.get("parameters", {})))
            if call is None:
                return None
            calls.append(call)
        return text[:at].removesuffix("\n") or None, calls

    def held_from(self, text: str) -> int:
        at = text.find(self.start)
        if at < 0:
            at = len(text) - partial_suffix(text, self.start)
        return at - 1 if text[:at].endswith("\n") else at


@dataclass(frozen=True)
class Llama3JsonParser:
    """Like vLLM's ``llama3_json``: every ``{`` not inside an earlier object starts a JSON
    object, decoded as far as it goes; each must have a ``name`` and ``arguments`` or
    ``parameters``. One that does not, or does not decode, makes the whole text content."""

    name: str = "llama3_json"
    keeps_special_tokens: bool = False
    bot_token: str = "<|python_tag|>"

    def parse(self, text: str) -> Parsed | None:
        decoder = json.JSONDecoder()
        calls: list[dict[str, Any]] = []
        end = -1
        for match in re.finditer(r"\{", text):
            if match.start() <= end:
                continue
            try:
                obj, length = decoder.raw_decode(text[match.start() :])
            except ValueError:
                return None
            end = match.start() + length
            if not isinstance(obj, dict) or "name" not in obj:
                return None
            arguments = obj.get("arguments", obj.get("parameters"))
            call = _call(obj["name"], arguments)
            if call is None:
                return None
            calls.append(call)
        return (None, calls) if calls else None

    def held_from(self, text: str) -> int:
        marks = [at for at in (text.find("{"), text.find(self.bot_token)) if at >= 0]
        if marks:
            return min(marks)
        return len(text) - partial_suffix(text, self.bot_token)


TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser())}


def tool_parser(name: str | None) -> ToolParser | None:
    """The parser vLLM calls ``name`` (None: the model's tool calls are never parsed)."""
    if name is None:
        return None
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"no tool parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return parser


def parse_tool_calls(text: str, parser: str = "hermes") -> Parsed | None:
    """``text``'s tool calls as the parser named ``parser`` reads them."""
    found = tool_parser(parser)
    assert found is not None
    return found.parse(text)
