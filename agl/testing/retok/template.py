"""A Qwen3-like chat template in plain Python, and the parser a serving stack applies to output.

The template reproduces the two properties of Qwen3's jinja template that matter for
retokenization: every block is ``<|im_start|>role\\n...<|im_end|>\\n`` (so special tokens
bound each message and the sampled ``<|im_end|>`` is continued verbatim), and an
assistant message's ``<think>`` block is rendered only after the last user message. The
second one makes rendering non-compositional (the paper's eq. 10): the reasoning the
model emitted at generation time disappears from the history once a user speaks again.

Messages are OpenAI-style dicts: ``{"role", "content"}``, assistant messages may carry
``reasoning_content`` and ``tool_calls`` (``[{"type": "function", "function": {"name",
"arguments": <JSON string>}}]``), and tool results are ``{"role": "tool", "content"}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agl.backends.inference.qwen_chat import TOOLS_POSTAMBLE, TOOLS_PREAMBLE

Message = dict[str, Any]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"

_TOOL_CALL_RE = re.compile(
    re.escape(TOOL_CALL_START) + r"\n(.*?)\n" + re.escape(TOOL_CALL_END), re.DOTALL
)


def tool_call_json(name: str, arguments: str | Mapping[str, Any]) -> str:
    """The tool-call JSON exactly as Qwen's template writes it (name first, ``tojson`` args).

    ``arguments`` given as a string is inserted verbatim, as the template does; that is
    why a harness that re-serializes the model's JSON changes the text (output
    transformation) while one that keeps canonical JSON does not.
    """
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return '{"name": "' + name + '", "arguments": ' + args + "}"


def _tool_call_block(call: str | Mapping[str, Any]) -> str:
    """One ``<tool_call>`` block; a string is the model's raw JSON, kept as emitted."""
    if isinstance(call, str):
        body = call
    else:
        fn = call.get("function", call)
        body = tool_call_json(fn["name"], fn["arguments"])
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def _assistant_body(
    content: str | None,
    reasoning: str | None,
    tool_calls: Sequence[str | Mapping[str, Any]] | None,
    keep_reasoning: bool,
) -> str:
    """The text between ``<|im_start|>assistant\\n`` and ``<|im_end|>``.

    Shared by generation and history rendering so the two agree byte for byte whenever
    the reasoning is kept: the only difference the template makes is the one Qwen3 makes.
    """
    content = content or ""
    text = ""
    if reasoning and keep_reasoning:
        text = f"{THINK_START}\n{reasoning.strip(chr(10))}\n{THINK_END}\n\n"
        content = content.lstrip("\n")
    text += content
    for i, call in enumerate(tool_calls or ()):
        if i > 0 or content:
            text += "\n"
        text += _tool_call_block(call)
    return text


def render_assistant_output(
    content: str | None,
    reasoning: str | None = None,
    tool_calls: Sequence[str | Mapping[str, Any]] | None = None,
) -> str:
    """What the model emits for one assistant turn, ending with ``<|im_end|>``.

    This is the text the sampled response ids decode to. A tool call given as a string is
    the model's own JSON text (possibly non-canonical); a mapping is serialized canonically.
    """
    return _assistant_body(content, reasoning, tool_calls, keep_reasoning=True) + IM_END


def _last_user_index(messages: Sequence[Message]) -> int:
    # Tool results are wrapped in a user turn but are not a new query, as in Qwen3.
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            return i
    return -1


def _system_block(system: str | None, tools: Sequence[Mapping[str, Any]] | None) -> str:
    if not tools:
        return f"{IM_START}system\n{system}{IM_END}\n" if system is not None else ""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    head = f"{system}\n\n" if system else ""
    return f"{IM_START}system\n{head}{TOOLS_PREAMBLE}{lines}{TOOLS_POSTAMBLE}{IM_END}\n"


def render(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render a conversation as the prompt text a Qwen3-style server would tokenize."""
    system = None
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    out = [_system_block(system, tools)]
    last_user = _last_user_index(messages)
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "assistant":
            body = _assistant_body(
                m.get("content"),
                m.get("reasoning_content"),
                m.get("tool_calls"),
                keep_reasoning=i > last_user,
            )
            out.append(f"{IM_START}assistant\n{body}{IM_END}\n")
        elif role == "tool":
            # Consecutive tool results share one user turn, as in Qwen's template.
            first = i == 0 or messages[i - 1]["role"] != "tool"
            last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
            out.append(
                (f"{IM_START}user" if first else "")
                + f"\n{TOOL_RESPONSE_START}\n{m['content']}\n{TOOL_RESPONSE_END}"
                + (f"{IM_END}\n" if last else "")
            )
        else:
            out.append(f"{IM_START}{role}\n{m['content']}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


def parse_assistant_output(text: str) -> Message:
    """Turn the model's output text into the assistant message a harness sees.

    Like vLLM's reasoning and hermes tool parsers: reasoning goes to
    ``reasoning_content``, each tool call's JSON is parsed and its arguments re-serialized
    with ``json.dumps`` (the output transformation of the paper's mechanism 3). Canonical
    output parses to a message that renders back to exactly ``text``.
    """
    text = text.removesuffix(IM_END)
    reasoning = None
    if text.startswith(THINK_START) and THINK_END in text:
        head, _, text = text.partition(THINK_END)
        reasoning = head.removeprefix(THINK_START).strip("\n")
        text = text.lstrip("\n")
    calls = []
    for raw in _TOOL_CALL_RE.findall(text):
        parsed = json.loads(raw)
        arguments = json.dumps(parsed["arguments"], ensure_ascii=False)
        calls.append(
            {"type": "function", "function": {"name": parsed["name"], "arguments": arguments}}
        )
    content = text
    if calls:
        # The separator newline before the first call belongs to the template, not to content.
        content = text[: text.index(TOOL_CALL_START)].removesuffix("\n")
    message: Message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message
