"""A generation as a server-sent event stream, chat or text alike: it opens once the first
tokens are there, sends one choice per chunk and ends with ``[DONE]``, or breaks off on an
engine error."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.responses import StreamingResponse

from agl.backends.inference.engine import Delta, EngineError, Generation
from agl.backends.inference.server.responses import version_header
from agl.core.http_errors import error_body


async def first_deltas(
    generation: Generation,
) -> tuple[AsyncIterator[list[Delta]], list[Delta]]:
    """A stream's deltas and the first of them. A stream answers only once the first
    tokens are there: by then the request is admitted, so the policy version is known (a
    header), and an engine failure is a plain 500."""
    deltas = generation.deltas()
    try:
        first = await anext(deltas)
    except BaseException:
        if not generation.finished:  # cancelled: the client went away meanwhile
            generation.cancel()
        raise
    return deltas, first


def _stream_error(error: EngineError) -> bytes:
    return _sse(error_body(500, f"generation failed: {error}"))


def event_stream(
    generation: Generation,
    deltas: AsyncIterator[list[Delta]],
    first: list[Delta] | None,
    head: dict[str, Any],
    choices: Callable[[Any], list[dict[str, Any]]],
    usage: Callable[[], dict[str, Any]] | None,
    opening: dict[str, Any] | None = None,
) -> StreamingResponse:
    """The event stream of a generation, chat or text: ``opening``, then each engine
    delta's ``choices`` one per chunk, the usage chunk if asked, ``[DONE]``.

    One choice per chunk, as vLLM streams: clients read ``choices[0]`` only, so a chunk
    holding a choice's last tokens and then its finish_reason would hide the end (Qwen
    Code, OpenCode never saw it). An engine error ends the stream without ``[DONE]``: a
    proxy must see a broken stream, not a short answer.
    """

    async def events() -> AsyncIterator[bytes]:
        try:
            if opening is not None:
                yield _sse(opening)
            batch = first
            while batch is not None:
                for delta in batch:
                    for choice in choices(delta):
                        yield _sse({**head, "choices": [choice]})
                batch = await anext(deltas, None)
            if usage is not None:
                yield _sse({**head, "choices": [], "usage": usage()})
            yield b"data: [DONE]\n\n"
        except EngineError as error:
            yield _stream_error(error)
        finally:
            if not generation.finished:  # the client went away
                generation.cancel()

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", **version_header(generation)},
    )


def _sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
