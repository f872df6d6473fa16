"""Tool calls: the Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks of a sampled text
to OpenAI's ``tool_calls``, as vLLM's Hermes parser reads them."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_START) + "(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """``(content, tool_calls)`` when ``text`` holds well-formed tool-call blocks, else None.

    Like vLLM's Hermes parser: content is the text before the first ``<tool_call>`` (the
    template's separating newline removed), each block's JSON must be an object with a
    string ``name``; its ``arguments`` are re-serialized with ``json.dumps``. Any block
    that is not valid JSON, or an unterminated one, makes the whole text plain content.
    """
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return None
    tail = text[start:]
    blocks = _TOOL_CALL.findall(tail)
    if not blocks or len(blocks) != tail.count(TOOL_CALL_START):
        return None
    calls = []
    for raw in blocks:
        call = _tool_call(raw)
        if call is None:
            return None
        calls.append(call)
    return text[:start].removesuffix("\n") or None, calls


def _tool_call(raw: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
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
        # Re-serialized, not the sampled text: the drift a harness carries into its history.
        "function": {
            "name": parsed["name"],
            "arguments": json.dumps(arguments, ensure_ascii=False),
        },
    }
