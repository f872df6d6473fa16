"""What a client's connection may hold of the gateway: a request whose head (request line
and headers) is not in after ``header_timeout_s``, or whose body goes ``body_timeout_s``
without a byte while the gateway waits for it, is answered 408 and its connection closed.
Without this, a socket that sent half a request line, headers without the blank line or
half a body held its slot (and memory) for as long as the client liked.

And what a refused client may cost: :class:`RefusalDelay` answers a refusal (a bad or
misused key, a rate limit, a body over the limit) only after a delay, holding nothing of
the request meanwhile, so that a client looping on refusals waits instead of taking the
gateway's CPU from everyone else.

Two layers for the timeouts, because uvicorn has no timeout of its own between a
request's first byte and its last header (its keep-alive timeout covers only the idle time
between requests):

- :func:`http_protocol`: uvicorn's httptools protocol with a header deadline, armed when
  the connection opens and when a request's first byte arrives, disarmed by its last
  header. The app never sees such a request.
- :class:`BodyTimeout`: ASGI, around the app: it times the waits for the body the app
  asks for, so a slow handler is never blamed on its client.

A body the app answers before it has read it whole (a refused upload: a bad key, over
the size limit or the bodies budget) closes the connection with the answer when what is
left may be big (streamed, or announced past ``UNREAD_KEPT_BYTES``): uvicorn would
otherwise read and discard the rest, and 100 agents streaming 33 MiB each held the
gateway's CPU doing just that. A small rest is discarded, and the connection kept.
"""

from __future__ import annotations

import asyncio
from asyncio import TimerHandle, Transport

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from agl.core.http_errors import ApiError, error_response

# After a stall of the event loop, bytes that came in time may still be unread when a
# deadline fires (uvloop runs its timers before it polls the sockets): one more short
# wait lets them in before the connection is judged.
_GRACE_S = 0.05
# An unread body rest up to this size is cheaper to discard than a new connection.
UNREAD_KEPT_BYTES = 64 * 1024


def http_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's ``http`` protocol class, with a header deadline of ``header_timeout_s``."""

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _deadline: TimerHandle | None = None
        _in_head = False  # a request's first byte came, its last header not yet

        def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True
            if self._deadline is None:  # a fresh connection's deadline runs from its start
                self._arm()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._disarm()
            super().on_headers_complete()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = self.loop.call_later(_GRACE_S, self._close)

        def _close(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            # A request half in gets its answer, unless an earlier one on the connection
            # (pipelined) is still being written; an idle connection is just closed.
            if self._in_head and (self.cycle is None or self.cycle.response_complete):
                message = f"the request's headers did not arrive within {header_timeout_s:g} s"
                self.transport.write(_request_timeout(message))
            self.transport.close()

    return HeaderDeadlineProtocol


def _request_timeout(message: str) -> bytes:
    """A 408 in the gateway's error shape, as the bytes of an HTTP/1.1 answer that closes
    (written straight to the socket: no app has the request)."""
    response = error_response(408, message)
    head = [
        b"HTTP/1.1 408 Request Timeout",
        *(name + b": " + value for name, value in response.raw_headers),
        b"connection: close",
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + response.body


class BodyTimeout:
    """ASGI middleware: a body the app waits on for ``timeout_s`` without a byte is a 408
    (raised from ``receive``, so the route answers it as any :class:`ApiError`) whose
    answer closes the connection; so does an answer that leaves a big body unread (the
    module's doc)."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = not _has_body(scope)
        big = _may_be_big(scope)
        stalled = False

        async def timed_receive() -> Message:
            nonlocal body_done, stalled
            if body_done:  # what is left to wait for is a disconnect: no deadline
                return await receive()
            try:
                async with asyncio.timeout(self.timeout_s):
                    message = await receive()
            except TimeoutError:
                stalled = True
                raise ApiError(
                    408, f"the request's body stalled: no byte for {self.timeout_s:g} s"
                ) from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        async def closing_send(message: Message) -> None:
            # Stalled: the client is not sending, so nothing unread is lost by closing at
            # once. A big rest unread: the answer is all it gets, reading on costs CPU.
            if (stalled or (big and not body_done)) and message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"connection", b"close")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, timed_receive, closing_send)


def _may_be_big(scope: Scope) -> bool:
    """The body streams (no length) or announces more than ``UNREAD_KEPT_BYTES``."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            return not value.strip().isdigit() or int(value) > UNREAD_KEPT_BYTES
    return False


def _has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (
            name == b"content-length" and value.strip() not in (b"", b"0")
        ):
            return True
    return False


REFUSALS = frozenset({401, 403, 413, 429})


class RefusalDelay:
    """ASGI middleware: a response with a status in ``REFUSALS`` starts ``delay_s`` late.

    An honest agent is never refused (it holds its own keys and keeps to its rate), while
    100 attackers looping on refused requests took the gateway's one core from the honest
    calls beside them: each refusal is cheap, but as many as the gateway can answer are
    not. Delayed, a client that waits for its answers gets at most one refusal a
    ``delay_s`` per connection, and the wait costs the gateway a timer, not CPU. What the
    refused request held is let go before the wait (``BodyLimit`` releases its bytes when
    the answer starts, and the connection is not read on meanwhile); ``delay_s=0`` turns
    it off."""

    def __init__(self, app: ASGIApp, delay_s: float) -> None:
        self.app = app
        self.delay_s = delay_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.delay_s <= 0:
            await self.app(scope, receive, send)
            return

        async def delayed_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in REFUSALS:
                await asyncio.sleep(self.delay_s)
            await send(message)

        await self.app(scope, receive, delayed_send)
