"""``POST /v1/chat/completions``: a chat completion as vLLM answers it, whole or streamed,
with its tool calls parsed and, when asked, token ids and logprobs."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from agl.backends.inference.engine import Engine, EngineError, Generation
from agl.backends.inference.server.prompts import chat_prompt, fit_to_context
from agl.backends.inference.server.requests import (
    ChatRequest,
    parse_chat_request,
    read_json_body,
)
from agl.backends.inference.server.responses import json_response, token_usage, version_header
from agl.backends.inference.server.streaming import event_stream, first_deltas
from agl.backends.inference.server.text import ChoiceOutput, collect
from agl.backends.inference.server.tokens import TokenCodec
from agl.backends.inference.server.tools import ToolParser
from agl.core.http_errors import error_response


class ChatCompletions:
    """The chat endpoint, over one engine serving one model under one name."""

    def __init__(
        self, engine: Engine, tokens: TokenCodec, model_name: str, tool_parser: ToolParser | None
    ) -> None:
        self.engine = engine
        self.tokens = tokens
        self.model_name = model_name
        self.tool_parser = tool_parser

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``: the messages rendered with the chat template."""
        body = await read_json_body(request)
        chat = parse_chat_request(body, self.model_name, self.engine.max_batch_size)
        prompt_ids = chat_prompt(self.tokens, chat.messages, chat.tools)
        params = fit_to_context(
            chat.params, chat.max_tokens, prompt_ids, "the messages", self.engine.max_context
        )
        parser = self.tool_parser if chat.parse_tools else None
        rule = chat.text_rule
        if parser is not None and parser.keeps_special_tokens:  # as vLLM's adjust_request
            rule = replace(rule, skip_special_tokens=False)
        try:
            # Stop strings are found as the text grows: the engine streams them.
            generation = self.engine.submit(
                prompt_ids, params, stream=chat.stream or bool(chat.stop)
            )
        except EngineError as error:  # closed: the server is shutting down
            return error_response(503, str(error))
        outputs = [
            ChoiceOutput(i, self.tokens, prompt_ids, chat.stop, rule, parser)
            for i in range(params.n)
        ]
        try:
            if chat.stream:
                return await self._stream(chat, generation, prompt_ids, outputs)
            return await self._unary(chat, generation, prompt_ids, outputs)
        except EngineError as error:
            return error_response(500, f"generation failed: {error}")
        finally:
            if not chat.stream and not generation.finished:
                generation.cancel()

    async def _unary(
        self,
        chat: ChatRequest,
        generation: Generation,
        prompt_ids: list[int],
        outputs: list[ChoiceOutput],
    ) -> Response:
        await collect(generation, outputs, bool(chat.stop))
        choices = []
        for out in outputs:
            content, tool_calls = out.message()
            choice: dict[str, Any] = {
                "index": out.index,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": tool_calls or [],
                },
                "logprobs": self._logprobs(out.token_ids, out.logprobs)
                if chat.want_logprobs
                else None,
                "finish_reason": out.final_reason(tool_calls),
                "stop_reason": out.stop_reason,
            }
            if chat.want_token_ids:
                choice["token_ids"] = out.token_ids
            choices.append(choice)
        answer: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": token_usage(prompt_ids, outputs),
        }
        if chat.want_token_ids:
            answer["prompt_token_ids"] = prompt_ids
        return json_response(answer, headers=version_header(generation))

    async def _stream(
        self,
        chat: ChatRequest,
        generation: Generation,
        prompt_ids: list[int],
        outputs: list[ChoiceOutput],
    ) -> Response:
        deltas, first = await first_deltas(generation)
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_name,
        }
        role = [
            {
                "index": o.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for o in outputs
        ]
        opening = {**head, "choices": role}
        if chat.want_token_ids:
            opening["prompt_token_ids"] = prompt_ids
        return event_stream(
            generation,
            deltas,
            first,
            head,
            lambda delta: self._step(chat, generation, outputs, delta),
            (lambda: token_usage(prompt_ids, outputs)) if chat.include_usage else None,
            opening,
        )

    def _step(
        self, chat: ChatRequest, generation: Generation, outputs: list[ChoiceOutput], delta: Any
    ) -> list[dict[str, Any]]:
        """The chunk choices one engine delta turns into: its tokens (with the text now
        safe to show), then, if the choice ended, a closing one with its finish reason."""
        out = outputs[delta.index]
        if out.finish_reason:
            return []
        before = len(out.token_ids)
        if out.add(delta.token_ids, delta.logprobs, delta.finish_reason):
            generation.cancel(delta.index)
        new_ids = out.token_ids[before:]
        text, tool_calls = out.emit()
        chunks = []
        if new_ids or (text and not tool_calls):
            chunk: dict[str, Any] = {
                "index": out.index,
                "delta": {"content": text} if text and not tool_calls else {},
                "logprobs": self._logprobs(new_ids, out.logprobs[before:])
                if chat.want_logprobs
                else None,
                "finish_reason": None,
            }
            if chat.want_token_ids:
                chunk["token_ids"] = new_ids
            chunks.append(chunk)
        if out.finish_reason:
            closing: dict[str, Any] = {"index": out.index, "delta": {}, "logprobs": None}
            if tool_calls:
                calls = [{"index": k, **call} for k, call in enumerate(tool_calls)]
                closing["delta"] = (
                    {"content": text, "tool_calls": calls} if text else {"tool_calls": calls}
                )
            closing["finish_reason"] = out.final_reason(tool_calls)
            closing["stop_reason"] = out.stop_reason
            if chat.want_token_ids:
                closing["token_ids"] = []
            chunks.append(closing)
        return chunks

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        content = []
        for token, logprob in zip(token_ids, logprobs, strict=True):
            text, raw = self.tokens.entry(token)
            content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": []})
        return {"content": content}
