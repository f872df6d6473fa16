"""A request's prompt ids (a chat rendered with the tokenizer's template, or a text or
token-id prompt), and the sampling limit the model's context leaves after them."""

from __future__ import annotations

import dataclasses
from typing import Any

from agl.backends.inference.engine import SamplingParams
from agl.backends.inference.server.tokens import TokenCodec
from agl.core.http_errors import ApiError


def chat_prompt(
    tokens: TokenCodec,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The chat template rendered to text, then tokenized without added special tokens
    (the template holds its own), as vLLM does."""
    try:
        text = tokens.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as error:  # jinja: a conversation this template cannot render
        raise ApiError(400, f"the chat template cannot render these messages: {error}") from None
    return tokens.encode_prompt(text)


def completion_prompt(
    tokens: TokenCodec, prompt: str | list[int], add_special_tokens: bool
) -> list[int]:
    """A text completion's prompt ids: a text tokenized, or token ids checked against
    the vocabulary."""
    if isinstance(prompt, str):
        return tokens.encode_text(prompt, add_special_tokens)
    vocabulary = len(tokens.tokenizer)
    bad = next((t for t in prompt if not 0 <= t < vocabulary), None)
    if bad is not None:
        raise ApiError(400, f"prompt token id {bad} is not in the vocabulary (0-{vocabulary - 1})")
    return list(prompt)


def fit_to_context(
    p: SamplingParams, max_tokens: int | None, prompt_ids: list[int], what: str, context: int
) -> SamplingParams:
    """``p`` with its ``max_tokens``: as asked, or all the room the context leaves after
    ``prompt_ids`` (``what`` names them in the error when they leave none or too little)."""
    room = context - len(prompt_ids)
    if room < 1:
        raise ApiError(
            400,
            f"this model's maximum context length is {context} tokens; {what} "
            f"have {len(prompt_ids)}",
        )
    if max_tokens is not None and max_tokens > room:
        raise ApiError(
            400,
            f"this model's maximum context length is {context} tokens; you requested "
            f"{len(prompt_ids) + max_tokens} ({len(prompt_ids)} in {what}, "
            f"{max_tokens} in the completion)",
        )
    return dataclasses.replace(p, max_tokens=max_tokens or room)
