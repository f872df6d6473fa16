"""What models and agents wrote, as one line of text: messages, tool calls, shortened
unless asked not to (``show`` prints them, ``scan`` quotes and searches them)."""

from __future__ import annotations

import json
from typing import Any

TEXT_LIMIT = 240  # characters of a message shown by show without --full


def short(text: str, full: bool) -> str:
    text = text.replace("\n", "\\n")
    return text if full or len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + "…"


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
