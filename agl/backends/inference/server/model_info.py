"""The endpoints that sample nothing: ``GET /health`` (the engine's state), ``GET
/v1/models`` (the one model served) and ``POST /tokenize`` (a prompt counted as vLLM's
counts it)."""

from __future__ import annotations

import dataclasses
import time

from starlette.requests import Request
from starlette.responses import Response

from agl.backends.inference.engine import Engine
from agl.backends.inference.server.prompts import chat_prompt, completion_prompt
from agl.backends.inference.server.requests import (
    optional_field,
    parse_chat_request,
    parse_prompt,
    read_json_body,
)
from agl.backends.inference.server.responses import json_response
from agl.backends.inference.server.tokens import TokenCodec
from agl.core.http_errors import ApiError


class ModelInfo:
    """The served model's state, card and tokenizer, over one engine under one name."""

    def __init__(self, engine: Engine, tokens: TokenCodec, model_name: str) -> None:
        self.engine = engine
        self.tokens = tokens
        self.model_name = model_name
        self.created = int(time.time())

    async def health(self, request: Request) -> Response:
        engine = self.engine
        return json_response(
            {
                "status": "ok",
                "model": self.model_name,
                "policy_version": engine.policy_version,
                "running": engine.running,
                "stats": dataclasses.asdict(engine.stats),
            }
        )

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "agl",
            "max_model_len": self.engine.max_context,
        }
        return json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` as vLLM serves it: ``messages`` (rendered with the chat
        template, as a chat completion would be) or ``prompt``; answers ``count``,
        ``tokens`` and ``max_model_len``."""
        body = await read_json_body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if "messages" in body:
            chat = parse_chat_request(body, self.model_name, self.engine.max_batch_size)
            add_generation_prompt = optional_field(body, "add_generation_prompt", bool) is not False
            tokens = chat_prompt(self.tokens, chat.messages, chat.tools, add_generation_prompt)
        else:
            special = optional_field(body, "add_special_tokens", bool) is not False
            tokens = completion_prompt(self.tokens, parse_prompt(body.get("prompt")), special)
        return json_response(
            {"count": len(tokens), "tokens": tokens, "max_model_len": self.engine.max_context}
        )
