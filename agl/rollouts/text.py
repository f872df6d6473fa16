"""What models and agents wrote, as one line of text: messages, tool calls, shortened
unless asked not to (``show`` prints them, ``scan`` quotes and searches them).

Whatever this tool prints of them goes through ``visible``: a character Python's ``repr``
escapes (C0 and C1 controls, DEL, format characters such as the bidi overrides, line and
paragraph separators, unassigned code points) is written as ``repr`` writes it, ``\\x1b``,
``\\r``, ``\\x9b``, ``\\u202e``, so a model's text cannot clear the screen, rewrite a line
or reorder what a reader sees, and what it held is still all there. A backslash is
printed as it is: ``\\x1b`` may also be the text's own four characters.
"""

from __future__ import annotations

import json
from typing import IO, Any

TEXT_LIMIT = 240  # characters of a message shown by show without --full


def visible(text: str) -> str:
    """``text`` with every character that is not printable (``str.isprintable``), line
    breaks included, escaped as ``repr`` escapes it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class Visible:
    """A text stream over ``out`` that writes each line through ``visible``: the line
    breaks of what is written stay line breaks, nothing else reaches ``out`` raw."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out

    def write(self, text: str) -> int:
        return self._out.write("\n".join(visible(line) for line in text.split("\n")))


def short(text: str, full: bool) -> str:
    """``text`` on one line, ``visible``, its first ``TEXT_LIMIT`` characters unless
    ``full`` (cut before escaping, so no escape is cut in two)."""
    if full or len(text) <= TEXT_LIMIT:
        return visible(text)
    return visible(text[:TEXT_LIMIT]) + "…"


def message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return json.dumps(message)
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = "" if content is None else str(content)
    for call in message.get("tool_calls") or ():
        text += " " + tool_call_text(call)
    return text.strip()


def tool_call_text(call: Any) -> str:
    function = call.get("function", call) if isinstance(call, dict) else {}
    if not isinstance(function, dict):
        return json.dumps(call)
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return f"{function.get('name', '?')}({arguments})"
