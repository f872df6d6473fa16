"""The ASGI app: the server's routes, each to its endpoint, its errors in OpenAI's shape,
and the inference key in front of them all (``guard``)."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agl.backends.inference.engine import Engine
from agl.backends.inference.guard import RequireKey
from agl.backends.inference.server.chat import ChatCompletions
from agl.backends.inference.server.completions import TextCompletions
from agl.backends.inference.server.model_info import ModelInfo
from agl.backends.inference.server.tokens import TokenCodec
from agl.backends.inference.server.tools import tool_parser as tool_parser_named
from agl.core.http_errors import ApiError, error_response


def create_app(
    engine: Engine,
    tokenizer: Any,
    model_name: str,
    tool_parser: str | None = "hermes",
    *,
    api_key: str | None,
) -> Starlette:
    """The ASGI app serving ``engine``'s model as ``model_name``; ``tool_parser`` names
    the format of the model's tool calls (``server.tools``; None: never parsed).

    With ``api_key``, every route but ``/health`` answers 401 to a request without
    ``Authorization: Bearer <api_key>``; None serves anyone who can connect (no default:
    each caller says which it wants)."""
    tokens = TokenCodec(tokenizer)  # one for all endpoints: it caches each token's entry
    chat = ChatCompletions(engine, tokens, model_name, tool_parser_named(tool_parser))
    text = TextCompletions(engine, tokens, model_name)
    info = ModelInfo(engine, tokens, model_name)
    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat.chat, methods=["POST"]),
            Route("/v1/completions", text.completions, methods=["POST"]),
            Route("/tokenize", info.tokenize, methods=["POST"]),
            Route("/v1/models", info.models, methods=["GET"]),
            Route("/health", info.health, methods=["GET"]),
        ],
        exception_handlers={ApiError: _api_error, 404: _not_found, 405: _not_allowed},
        # Outside the routing: a path that does not exist is refused as one that does,
        # so a request without the key learns nothing of the routes.
        middleware=[] if api_key is None else [Middleware(RequireKey, key=api_key)],
    )


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    return error.response()


async def _not_found(request: Request, error: Exception) -> Response:
    return error_response(404, f"no route {request.method} {request.url.path}")


async def _not_allowed(request: Request, error: Exception) -> Response:
    return error_response(405, f"method {request.method} not allowed on {request.url.path}")
