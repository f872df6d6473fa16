"""A vLLM-shaped inference server for tests and benchmarks of the gateway.

It answers ``/v1/chat/completions`` as vLLM does when asked for ``logprobs`` and
``return_token_ids``: ``prompt_token_ids`` at the top, ``token_ids`` and
``logprobs.content`` on each choice, the same fields chunk by chunk when streaming.
``/v1/completions`` (text completions) likewise, in vLLM's completions shape:
``prompt_token_ids`` and ``token_ids`` on each choice, completions-style ``logprobs``.
``/tokenize`` counts a prompt as vLLM's does.
Tokens are bytes of a tiny fixed chat template, so tests can predict every id. With
``token_bytes`` > 1 (benchmarks at coding-agent scale) a token is that many bytes of
text instead, each message's ids cached (:class:`WideTokens`): a conversation's next
prompt then starts with its last prompt and the ids sampled for its answer.
Failures and delays are injected through attributes (in process) or ``POST /control``.

``python -m agl.testing.fake_vllm port=8001 [token_bytes=4]`` runs it standalone.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

BOS, EOS = 1, 2
ROLE_IDS = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
BYTE_OFFSET = 16  # token id of byte b is b + 16


def encode(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode()]


def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
    """The fake chat template: <bos> role content <eos> per message, then <bos> assistant."""
    ids: list[int] = []
    for m in messages:
        content = m.get("content")
        text = content if isinstance(content, str) else orjson.dumps(content).decode()
        ids += [BOS, ROLE_IDS.get(m.get("role", "user"), 7), *encode(text), EOS]
    return [*ids, BOS, ROLE_IDS["assistant"]]


class WideTokens:
    """One token per ``width`` bytes of text, as a real tokenizer's ~4: a chat's prompt
    ids are its messages' templates (as :func:`prompt_ids`) joined, each message's cached
    (least recently used dropped past ``cache_size``), so the ids of a long conversation
    cost the server only its new messages. An answer's text becomes the same ids when it
    comes back as an assistant message: every prompt extends the last one and its answer."""

    VOCAB = 1 << 17  # ids of width-byte chunks: 256 + BYTE_OFFSET up to this

    def __init__(self, width: int, cache_size: int = 4096) -> None:
        if width < 2:
            raise ValueError(f"width must be at least 2 bytes a token, not {width}")
        self.width = width
        self.cache_size = cache_size
        self._messages: OrderedDict[tuple[str, str], list[int]] = OrderedDict()

    def encode(self, text: str) -> list[int]:
        data, w, top = text.encode(), self.width, self.VOCAB - 256 - BYTE_OFFSET
        first = 256 + BYTE_OFFSET
        return [first + int.from_bytes(data[i : i + w]) % top for i in range(0, len(data), w)]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        ids: list[int] = []
        for m in messages:
            content = m.get("content")
            text = content if isinstance(content, str) else orjson.dumps(content).decode()
            role = m.get("role", "user")
            key = (str(role), text)
            cached = self._messages.get(key)
            if cached is None:
                cached = [BOS, ROLE_IDS.get(role, 7), *self.encode(text), EOS]
                self._messages[key] = cached
                if len(self._messages) > self.cache_size:
                    self._messages.popitem(last=False)
            else:
                self._messages.move_to_end(key)
            ids += cached
        return [*ids, BOS, ROLE_IDS["assistant"]]

    def pieces(self, text: str) -> list[str]:
        """The text of each of ``encode(text)``'s tokens, as a stream sends them."""
        data, w = text.encode(), self.width
        return [data[i : i + w].decode(errors="ignore") for i in range(0, len(data), w)]


def logprob(position: int) -> float:
    return -0.01 - 0.25 * (position % 5)


def completion_for(prompt: str) -> str:
    """The text completion of a prompt: deterministic, and says what it continued."""
    return f" after {len(prompt)}: {prompt[-16:]}"


# vLLM's (and OpenAI's) cap of a text completion that sets no max_tokens.
COMPLETION_MAX_TOKENS = 16


def reply_for(messages: list[dict[str, Any]]) -> str:
    """The answer to a conversation: deterministic and different per turn."""
    last = messages[-1].get("content") if messages else ""
    return f"turn {len(messages)}: {str(last)[:24]}"


@dataclass
class _Answer:
    text: str | None
    tool_calls: list[dict[str, Any]] | None
    ids: list[int]
    finish_reason: str


class FakeVllm:
    """The server's state; tests change ``fail_next`` / ``delay_s`` between calls."""

    def __init__(self, model: str = "fake-model", token_bytes: int = 1) -> None:
        self.model = model
        # None: a token per byte (tests predict every id); else WideTokens.
        self.wide = WideTokens(token_bytes) if token_bytes > 1 else None
        self.fail_next: list[int] = []
        self.fail_rate = 0.0  # this share of calls, at random, answer 500
        self.delay_s = 0.0
        self.stream_break_after: int | None = None
        self.chunk_delay_s = 0.0
        # 200 answers with these bodies, verbatim (an event stream if the call streams)
        self.raw_next: list[bytes] = []
        # A scripted agent: the reply to a conversation, or None for the default one.
        # Concurrent rollouts each get their own script's turn (raw_next is one queue).
        self.script: Callable[[list[dict[str, Any]]], str | None] | None = None
        self.requests: list[dict[str, Any]] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_post("/control", self.control)
        self.app.router.add_get("/v1/models", self.models)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model}]})

    async def control(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.fail_next = list(body.get("fail_next", self.fail_next))
        self.delay_s = float(body.get("delay_s", self.delay_s))
        self.fail_rate = float(body.get("fail_rate", self.fail_rate))
        return web.json_response({"ok": True})

    def _answer(self, body: dict[str, Any]) -> _Answer:
        messages = body["messages"]
        last = str(messages[-1].get("content") or "") if messages else ""
        tools = body.get("tools") or []
        if tools and last.startswith("use-tool"):
            arguments = orjson.dumps({"query": last[8:].strip() or "x"}).decode()
            name = tools[0]["function"]["name"]
            call = {
                "id": f"call_{len(messages)}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            return _Answer(None, [call], [*encode(arguments), EOS], "tool_calls")
        scripted = self.script(messages) if self.script is not None else None
        text = scripted if scripted is not None else reply_for(messages)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if self.wide is not None:
            ids = self.wide.encode(text)
            if max_tokens is not None and max_tokens < len(ids):
                text = text.encode()[: max_tokens * self.wide.width].decode(errors="ignore")
                return _Answer(text, None, self.wide.encode(text), "length")
            return _Answer(text, None, [*ids, EOS], "stop")
        if max_tokens is not None and max_tokens < len(text.encode()):
            text = text.encode()[:max_tokens].decode(errors="ignore")
            return _Answer(text, None, encode(text), "length")
        return _Answer(text, None, [*encode(text), EOS], "stop")

    async def _take(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The request's body, or the answer the tests' injected failures make of it."""
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as error:
            return _bad_request(f"body is not valid JSON: {error}")
        if not isinstance(body, dict):
            return _bad_request("body must be a JSON object")
        self.requests.append(body)
        if self.fail_rate and random.random() < self.fail_rate:
            self.fail_next.insert(0, 500)
        if self.fail_next:
            status = self.fail_next.pop(0)
            return web.json_response(
                {"error": {"message": f"injected failure {status}", "code": status}},
                status=status,
            )
        if self.raw_next:
            kind = "text/event-stream" if body.get("stream") else "application/json"
            return web.Response(body=self.raw_next.pop(0), content_type=kind)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._take(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return web.json_response(
                {"error": {"message": "messages must be a non-empty list"}}, status=400
            )
        messages = body["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("role", ""), str) for m in messages):
            return _bad_request("each message must be an object with a string 'role'")
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            return _bad_request("max_tokens must be a positive integer")
        try:
            answer = self._answer(body)
        except (LookupError, TypeError, ValueError, AttributeError) as error:
            return _bad_request(f"invalid request: {error!r}")  # vLLM answers 400, not 500
        want_ids = bool(body.get("return_token_ids"))
        want_logprobs = bool(body.get("logprobs"))
        messages = body["messages"]
        prompt = self.wide.prompt_ids(messages) if self.wide else prompt_ids(messages)
        if body.get("stream"):
            return await self._stream(request, body, answer, prompt, want_ids, want_logprobs)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": answer.text,
                "tool_calls": answer.tool_calls or [],
            },
            "logprobs": {"content": [_logprob_entry(i, t) for i, t in enumerate(answer.ids)]}
            if want_logprobs
            else None,
            "finish_reason": answer.finish_reason,
            "stop_reason": None,
        }
        if want_ids:
            choice["token_ids"] = answer.ids
        payload: dict[str, Any] = {
            "id": f"chatcmpl-{time.monotonic_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", self.model),
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(answer.ids),
                "total_tokens": len(prompt) + len(answer.ids),
            },
        }
        if want_ids:
            payload["prompt_token_ids"] = prompt
        return web.Response(body=orjson.dumps(payload), content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        answer: _Answer,
        prompt: list[int],
        want_ids: bool,
        want_logprobs: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {
            "id": f"chatcmpl-{time.monotonic_ns()}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model", self.model),
        }

        async def send(choice: dict[str, Any], **top: Any) -> None:
            await response.write(
                b"data: " + orjson.dumps({**base, **top, "choices": [choice]}) + b"\n\n"
            )

        first: dict[str, Any] = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        await send(first, **({"prompt_token_ids": prompt} if want_ids else {}))
        pieces = _pieces(answer, self.wide)
        for i, (token, delta) in enumerate(pieces):
            if self.stream_break_after is not None and i >= self.stream_break_after:
                request.transport.close()  # type: ignore[union-attr]
                return response
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "finish_reason": None,
                "logprobs": {"content": [_logprob_entry(i, token)]} if want_logprobs else None,
            }
            if want_ids:
                choice["token_ids"] = [token]
            await send(choice)
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
        await send(
            {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": answer.finish_reason,
                **({"token_ids": []} if want_ids else {}),
            }
        )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """A text completion, shaped as vLLM's: ids on each choice, completions-style
        logprobs (``logprobs`` is an integer), one choice per streamed chunk."""
        body = await self._take(request)
        if isinstance(body, web.Response):
            return body
        prompt = _prompt_of(body.get("prompt"))
        if prompt is None:
            return _bad_request("prompt must be a non-empty string or list of token ids")
        max_tokens = body.get("max_tokens", COMPLETION_MAX_TOKENS)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _bad_request("max_tokens must be a positive integer")
        logprobs = body.get("logprobs")
        if logprobs is not None and (not isinstance(logprobs, int) or logprobs < 0):
            return _bad_request("logprobs must be a non-negative integer")
        ids = encode(prompt) if isinstance(prompt, str) else prompt
        text = completion_for(prompt if isinstance(prompt, str) else _decode(prompt))
        if max_tokens < len(text.encode()):
            text = text.encode()[:max_tokens].decode(errors="ignore")
            answer = _Answer(text, None, encode(text), "length")
        else:
            answer = _Answer(text, None, [*encode(text), EOS], "stop")
        want_ids = bool(body.get("return_token_ids"))
        head = {
            "id": f"cmpl-{time.monotonic_ns()}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", self.model),
        }
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i, (token, delta) in enumerate(_pieces(answer)):
                if self.stream_break_after is not None and i >= self.stream_break_after:
                    request.transport.close()  # type: ignore[union-attr]
                    return response
                last = i == len(answer.ids) - 1
                choice = _text_choice(
                    delta.get("content", ""),
                    [token],
                    i,
                    answer.finish_reason if last else None,
                    logprobs is not None,
                )
                if want_ids:
                    choice.update({"prompt_token_ids": ids} if i == 0 else {})
                    choice["token_ids"] = [token]
                chunk = {**head, "choices": [choice]}
                await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        choice = _text_choice(
            answer.text or "", answer.ids, 0, answer.finish_reason, logprobs is not None
        )
        if want_ids:
            choice.update(prompt_token_ids=ids, token_ids=answer.ids)
        payload = {
            **head,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(answer.ids),
                "total_tokens": len(ids) + len(answer.ids),
            },
        }
        return web.Response(body=orjson.dumps(payload), content_type="application/json")

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: ``messages`` through the chat template (with the
        generation prompt, which this template always adds), or a ``prompt``."""
        body = await self._take(request)
        if isinstance(body, web.Response):
            return body
        messages = body.get("messages")
        if messages is not None:
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                return _bad_request("messages must be a list of objects")
            tokens = prompt_ids(messages)
        else:
            prompt = _prompt_of(body.get("prompt"))
            if prompt is None:
                return _bad_request("give messages or a prompt")
            tokens = encode(prompt) if isinstance(prompt, str) else prompt
        return web.json_response({"count": len(tokens), "tokens": tokens, "max_model_len": 4096})


def _prompt_of(prompt: object) -> str | list[int] | None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


def _decode(ids: list[int]) -> str:
    return bytes(t - BYTE_OFFSET for t in ids if BYTE_OFFSET <= t < BYTE_OFFSET + 256).decode(
        errors="replace"
    )


def _text_choice(
    text: str, ids: list[int], first: int, finish_reason: str | None, want_logprobs: bool
) -> dict[str, Any]:
    """One choice of a text completion; ``first`` is the position of its first token."""
    logprobs = None
    if want_logprobs:
        tokens = [f"<{t}>" for t in ids]
        values = [logprob(first + i) for i in range(len(ids))]
        logprobs = {
            "text_offset": list(range(first, first + len(ids))),
            "token_logprobs": values,
            "tokens": tokens,
            "top_logprobs": [{t: v} for t, v in zip(tokens, values, strict=True)],
        }
    return {
        "index": 0,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": 400}}, status=400)


def _pieces(answer: _Answer, wide: WideTokens | None = None) -> list[tuple[int, dict[str, Any]]]:
    """(token id, delta) per sampled token, as vLLM streams them."""
    if wide is not None and not answer.tool_calls:
        texts = wide.pieces(answer.text or "")
        return [
            (t, {"content": texts[i]} if i < len(texts) else {}) for i, t in enumerate(answer.ids)
        ]
    if answer.tool_calls:
        call = answer.tool_calls[0]
        arguments = call["function"]["arguments"]
        pieces = [
            (
                answer.ids[0],
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": call["id"],
                            "type": "function",
                            "function": {
                                "name": call["function"]["name"],
                                "arguments": arguments[0],
                            },
                        }
                    ]
                },
            )
        ]
        pieces += [
            (t, {"tool_calls": [{"index": 0, "function": {"arguments": ch}}]})
            for t, ch in zip(answer.ids[1:], arguments[1:], strict=False)
        ]
        return pieces + [(t, {}) for t in answer.ids[len(arguments) :]]
    text = (answer.text or "").encode()
    return [
        (t, {"content": chr(text[i])} if i < len(text) else {}) for i, t in enumerate(answer.ids)
    ]


def _logprob_entry(position: int, token: int) -> dict[str, Any]:
    return {"token": f"<{token}>", "logprob": logprob(position), "bytes": None, "top_logprobs": []}


@contextmanager
def serve_in_thread(
    fake: FakeVllm | None = None, host: str = "127.0.0.1"
) -> Iterator[tuple[str, FakeVllm]]:
    """Run a fake server on a free port in a thread; yields (base URL ending in /v1, state)."""
    fake = fake or FakeVllm()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def start() -> None:
        runner = web.AppRunner(fake.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        holder["runner"] = runner
        holder["port"] = runner.addresses[0][1]
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    ready.wait()
    try:
        yield f"http://{host}:{holder['port']}/v1", fake
    finally:
        asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def main(argv: list[str]) -> None:
    options = dict(arg.split("=", 1) for arg in argv)
    fake = FakeVllm(token_bytes=int(options.get("token_bytes", "1")))
    fake.fail_rate = float(options.get("fail_rate", "0"))
    web.run_app(
        fake.app,
        host=options.get("host", "127.0.0.1"),
        port=int(options.get("port", "8001")),
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
