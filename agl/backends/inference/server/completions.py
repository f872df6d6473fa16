"""``POST /v1/completions``: a text completion of one prompt as vLLM answers it, whole or
streamed, with completions-style logprobs and, when asked, token ids on each choice."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from agl.backends.inference.engine import Engine, EngineError, Generation
from agl.backends.inference.server.prompts import completion_prompt, fit_to_context
from agl.backends.inference.server.requests import (
    COMPLETION_MAX_TOKENS,
    CompletionRequest,
    parse_completion_request,
    read_json_body,
)
from agl.backends.inference.server.responses import json_response, token_usage, version_header
from agl.backends.inference.server.streaming import event_stream, first_deltas
from agl.backends.inference.server.text import ChoiceOutput, collect
from agl.backends.inference.server.tokens import TokenCodec
from agl.core.http_errors import error_response


class TextCompletions:
    """The text completion endpoint, over one engine serving one model under one name."""

    def __init__(self, engine: Engine, tokens: TokenCodec, model_name: str) -> None:
        self.engine = engine
        self.tokens = tokens
        self.model_name = model_name

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``: a text completion of one prompt, as vLLM answers it."""
        body = await read_json_body(request)
        text = parse_completion_request(body, self.model_name, self.engine.max_batch_size)
        prompt_ids = completion_prompt(self.tokens, text.prompt, text.add_special_tokens)
        max_tokens = text.max_tokens
        if max_tokens is None:  # the default cap, or what the context leaves of it
            max_tokens = max(
                1, min(COMPLETION_MAX_TOKENS, self.engine.max_context - len(prompt_ids))
            )
        params = fit_to_context(
            text.params, max_tokens, prompt_ids, "the prompt", self.engine.max_context
        )
        try:
            generation = self.engine.submit(
                prompt_ids, params, stream=text.stream or bool(text.stop)
            )
        except EngineError as error:
            return error_response(503, str(error))
        outputs = [
            ChoiceOutput(i, self.tokens, prompt_ids, text.stop, text.text_rule, tool_parser=None)
            for i in range(params.n)
        ]
        try:
            if text.stream:
                return await self._stream_text(text, generation, prompt_ids, outputs)
            await collect(generation, outputs, bool(text.stop))
            return self._text_answer(text, generation, prompt_ids, outputs)
        except EngineError as error:
            return error_response(500, f"generation failed: {error}")
        finally:
            if not text.stream and not generation.finished:
                generation.cancel()

    def _text_answer(
        self,
        text: CompletionRequest,
        generation: Generation,
        prompt_ids: list[int],
        outputs: list[ChoiceOutput],
    ) -> Response:
        choices = []
        for out in outputs:
            choice: dict[str, Any] = {
                "index": out.index,
                "text": out.text,
                "logprobs": self._text_logprobs(out.token_ids, out.logprobs, 0)
                if text.logprobs is not None
                else None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            if text.want_token_ids:
                choice["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = out.token_ids
            choices.append(choice)
        answer = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": token_usage(prompt_ids, outputs),
        }
        return json_response(answer, headers=version_header(generation))

    async def _stream_text(
        self,
        text: CompletionRequest,
        generation: Generation,
        prompt_ids: list[int],
        outputs: list[ChoiceOutput],
    ) -> Response:
        deltas, first = await first_deltas(generation)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        offsets = [0] * len(outputs)  # text_offset of each choice's next token
        opened = [False] * len(outputs)  # each choice's first chunk carries the prompt ids

        def step(delta: Any) -> list[dict[str, Any]]:
            out = outputs[delta.index]
            if out.finish_reason:
                return []
            before = len(out.token_ids)
            if out.add(delta.token_ids, delta.logprobs, delta.finish_reason):
                generation.cancel(delta.index)
            new_ids = out.token_ids[before:]
            new_text = out.take_text()
            if not (new_ids or new_text or out.finish_reason):
                return []
            choice: dict[str, Any] = {
                "index": out.index,
                "text": new_text,
                "logprobs": None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            if text.logprobs is not None:
                logprobs = self._text_logprobs(new_ids, out.logprobs[before:], offsets[out.index])
                offsets[out.index] += sum(len(t) for t in logprobs["tokens"])
                choice["logprobs"] = logprobs
            if text.want_token_ids:
                if not opened[out.index]:
                    choice["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = new_ids
            opened[out.index] = True
            return [choice]

        return event_stream(
            generation,
            deltas,
            first,
            head,
            step,
            (lambda: token_usage(prompt_ids, outputs)) if text.include_usage else None,
        )

    def _text_logprobs(
        self, token_ids: list[int], logprobs: list[float], offset: int
    ) -> dict[str, Any]:
        """Completions-style logprobs. The engine keeps the sampled token's logprob only,
        so ``top_logprobs`` holds that one token whatever number was asked (vLLM's
        answer to ``logprobs: 0``)."""
        tokens, offsets = [], []
        for token in token_ids:
            piece, _ = self.tokens.entry(token)
            tokens.append(piece)
            offsets.append(offset)
            offset += len(piece)
        return {
            "text_offset": offsets,
            "token_logprobs": list(logprobs),
            "tokens": tokens,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)],
        }
