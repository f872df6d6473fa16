"""What every dialect shares: its error, its interface, the event-stream framing and the
one log line for what a request asked that the translation leaves out."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import orjson

from agl.core.http_errors import ApiError

log = logging.getLogger("agl.core.gateway.dialects")


class DialectError(ApiError):
    """A request the translation cannot express; answer it with ``status`` (4xx) and
    ``message`` in the dialect's error shape (:meth:`Dialect.error_body`)."""


class StreamTranslator(Protocol):
    """Turns one chat answer's stream of ``chat.completion.chunk`` dicts into the
    dialect's event stream. Each returned ``bytes`` is one whole server-sent event.

    ``feed`` raises ValueError (or KeyError/TypeError) on chunks no chat server sends,
    e.g. arguments for a tool call after the next one started."""

    def feed(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def finish(self) -> list[bytes]: ...

    def fail(self, status: int, message: str) -> list[bytes]:
        """The events that end the stream when the upstream breaks off mid-answer."""
        ...


class Dialect(Protocol):
    name: str

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def from_chat(self, answer: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]: ...

    def stream(self, request: dict[str, Any]) -> StreamTranslator: ...

    def error_body(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> dict[str, Any]:
        """The gateway's error shape (``agl.core.http_errors``) with the dialect's types."""
        ...


def sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# Field names already reported at INFO: harnesses send the same ones on every call, and
# one line per call would drown the log (later ones go to DEBUG).
_reported: set[tuple[str, str]] = set()


def note_ignored(dialect: str, names: set[str]) -> None:
    """One log line naming the request fields the translation leaves out."""
    if not names:
        return
    fresh = {(dialect, n) for n in names} - _reported
    _reported.update(fresh)
    level = logging.INFO if fresh else logging.DEBUG
    log.log(level, "%s request: ignoring %s", dialect, ", ".join(sorted(names)))
