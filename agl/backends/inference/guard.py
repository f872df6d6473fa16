"""Only the key's holders reach inference: an ASGI middleware that refuses (401) every
request but the health check unless it carries ``Authorization: Bearer <key>``.

Who holds the key: the trainer makes one per run and gives it to the gateway, which sends
it on every upstream call, and to the inference servers; agents never get it. So a model
call that did not pass the gateway's proxy (recorded, held by the admission gate, rate
limited) is refused, whoever on the machine makes it.

The embedded server (``server.app``, hence ``agl.serve`` too) puts ``RequireKey`` in front
of its routes. vLLM replicas get ``RequireVllmKey`` through ``--middleware``, with the key
in ``$VLLM_API_KEY`` (an environment variable: a command line is visible to every user of
the machine). vLLM's own check of that variable guards only paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere``; its ``/tokenize``, ``/invocations`` (a generation),
``/pause``, ``/sleep`` and, in dev mode, ``/collective_rpc`` and ``/update_weights`` would
stay open without this one.

Standard library only: vLLM's interpreter (its own environment, without agl) imports a
copy of this file (``vllm.install_guard``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

# ASGI's types, as Starlette spells them (this module cannot import Starlette).
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

VLLM_KEY_VAR = "VLLM_API_KEY"
# Liveness only, for probes and the trainer's wait at start: it samples nothing.
OPEN_PATHS = frozenset({"/health"})
MISSING_KEY = "missing key: send 'Authorization: Bearer <key>' (the inference key)"
WRONG_KEY = "invalid inference key"
# RFC 6455's "policy violation": a WebSocket refused before it is accepted.
_WS_POLICY_VIOLATION = 1008


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of a request's first ``Authorization`` header if it is a Bearer one."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return (token.strip() or None) if scheme.lower() == "bearer" else None
    return None


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def refusal(scope: Scope, key_digest: bytes) -> str | None:
    """Why the request of ``scope`` must be refused, or None to let it through."""
    if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
        return None
    token = bearer(scope["headers"])
    if token is None:
        return MISSING_KEY
    # Digests have one length, compared in constant time: the answer's timing tells
    # nothing about how much of the key a guess got right.
    return None if hmac.compare_digest(digest(token), key_digest) else WRONG_KEY


def error_body(message: str) -> bytes:
    """A 401 in OpenAI's ``ErrorResponse`` shape, the embedded server's one error shape
    (``agl.core.http_errors``), which the ``openai`` client reads."""
    error = {"message": message, "type": "authentication_error", "param": None, "code": None}
    return json.dumps({"error": error}).encode()


class RequireKey:
    """Passes a request on only with ``Authorization: Bearer <key>``, the health check
    (``OPEN_PATHS``) and the server's lifespan excepted; answers any other 401 (a
    WebSocket: closed with 1008) without reading its body."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        if not key.strip():
            raise ValueError("the inference key is empty")
        self.app = app
        self._digest = digest(key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reason = refusal(scope, self._digest)
        if reason is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": _WS_POLICY_VIOLATION, "reason": reason})
        else:
            body = error_body(reason)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})


class RequireVllmKey(RequireKey):
    """``RequireKey`` with the key of ``$VLLM_API_KEY``: vLLM's ``--middleware`` builds a
    middleware from the app alone. Without the variable the server does not start."""

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get(VLLM_KEY_VAR, "")
        if not key.strip():
            raise RuntimeError(f"{VLLM_KEY_VAR} is not set: the inference guard has no key")
        super().__init__(app, key)
