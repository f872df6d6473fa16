"""Scripted model answers for the fake vLLM server's ``raw_next``: a bash tool call."""

from __future__ import annotations

import json


def scripted_tool_call(text: str, command: str, call_id: str) -> bytes:
    """A vLLM-style answer, for the fake's ``raw_next``: ``text`` then a bash tool call,
    sampled as the bytes of the text and of the call's JSON."""
    from agl.testing.fake_vllm import EOS, encode, logprob

    arguments = json.dumps({"command": command})
    ids = [*encode(text + arguments), EOS]
    call = {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": arguments}}
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text, "tool_calls": [call]},
        "logprobs": {"content": [{"token": "x", "logprob": logprob(i)} for i in range(len(ids))]},
        "finish_reason": "tool_calls",
        "token_ids": ids,
    }
    usage = {"prompt_tokens": 1, "completion_tokens": len(ids), "total_tokens": len(ids) + 1}
    return json.dumps(
        {
            "id": f"chatcmpl-{call_id}",
            "object": "chat.completion",
            "created": 0,
            "model": "fake-model",
            "prompt_token_ids": [1],
            "choices": [choice],
            "usage": usage,
        }
    ).encode()
