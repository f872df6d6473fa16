"""The viewer's login: a browser cannot send a Bearer header, so the admin token is typed
into a form once and the browser keeps a cookie instead.

The cookie holds its issue time, a nonce and an HMAC of both under the admin token, not
the token: a cookie that leaks (a proxy's log, a shared profile) opens the read-only
viewer, never the API, only until it expires (the issue time is checked here, not left to
the browser's ``Max-Age``), and it stops working when the admin token changes. It is
HttpOnly (no script reads it) and SameSite=Strict (no other site's page makes the browser
send it). Logging out clears it and refuses that cookie from then on, a copy of it too
(in this gateway process's memory: after a restart it is good until it expires).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from urllib.parse import parse_qs, quote

from starlette.requests import Request

COOKIE = "agl_ui"
LOGIN = "/ui/login"
MAX_FORM_BYTES = 8192
_PURPOSE = b"agl ui session v2"
_VALUE = re.compile(r"([0-9]{1,12})\.([0-9a-f]{16})\.[0-9a-f]{64}")  # issued.nonce.mac
# A cookie issued up to this far "in the future" (the clock stepped back) still counts.
_CLOCK_SKEW_S = 60
# What a redirect target keeps as it is; anything else (non-ASCII, spaces, quotes) is
# percent-encoded, since an HTTP header is Latin-1 and a Location must be a URL.
_URL_CHARACTERS = "/?&=%#+:@!$'()*,;~"


def session_value(admin_token: str, issued: int, nonce: str | None = None) -> str:
    """The cookie of a session issued at ``issued`` (Unix seconds); the nonce (random by
    default) tells apart two sessions of the same second, so a logout ends only its own."""
    nonce = secrets.token_hex(8) if nonce is None else nonce
    signed = b"%s|%d|%s" % (_PURPOSE, issued, nonce.encode())
    return f"{issued}.{nonce}.{hmac.new(admin_token.encode(), signed, hashlib.sha256).hexdigest()}"


class Sessions:
    """Sessions of ``lifetime_s`` seconds, signed with the admin token; ``clock`` is the
    wall clock (a session outlives a gateway restart)."""

    def __init__(
        self, admin_token: str, lifetime_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.admin_token = admin_token
        self.lifetime_s = lifetime_s
        self.clock = clock
        self._ended: dict[str, float] = {}  # logged-out cookies, until they would expire

    def is_admin_token(self, typed: str) -> bool:
        return hmac.compare_digest(typed.strip().encode(), self.admin_token.encode())

    def valid(self, cookie: str | None) -> bool:
        return self._issued(cookie) is not None and cookie not in self._ended

    def start(self) -> str:
        """The ``Set-Cookie`` of a new session."""
        value = session_value(self.admin_token, int(self.clock()))
        return _cookie(value, max_age=int(self.lifetime_s))

    def end(self, cookie: str | None) -> str:
        """Refuse ``cookie`` from now on; the ``Set-Cookie`` that clears it."""
        now = self.clock()
        self._ended = {c: until for c, until in self._ended.items() if until > now}
        issued = self._issued(cookie)
        if cookie is not None and issued is not None:
            self._ended[cookie] = issued + self.lifetime_s
        return _cookie("", max_age=0)

    def _issued(self, cookie: str | None) -> int | None:
        """The issue time of a genuine, unexpired cookie, else None."""
        if cookie is None or (parts := _VALUE.fullmatch(cookie)) is None:
            return None
        issued = int(parts[1])
        genuine = hmac.compare_digest(
            cookie.encode(), session_value(self.admin_token, issued, parts[2]).encode()
        )
        age = self.clock() - issued
        return issued if genuine and -_CLOCK_SKEW_S <= age < self.lifetime_s else None


def _cookie(value: str, max_age: int) -> str:
    # No Secure flag: the gateway serves plain HTTP (loopback, a port-forward); a Secure
    # cookie would never come back over it.
    return f"{COOKIE}={value}; Max-Age={max_age}; Path=/ui; HttpOnly; SameSite=Strict"


class FormTooLarge(Exception):
    pass


async def read_small_body(request: Request, limit: int = MAX_FORM_BYTES) -> bytes:
    """The request's body if it is at most ``limit`` bytes, else :class:`FormTooLarge`
    with no more read than that: an announced length over it is refused before a byte is
    read, a chunked body once it passes it (the gateway's own limit is far larger, and a
    login needs no authentication to send)."""
    length = request.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > limit:
        raise FormTooLarge
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise FormTooLarge
    return bytes(body)


def read_form(body: bytes) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body: the first value of each field."""
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0] for name, values in fields.items()}


def safe_next(target: str | None) -> str:
    """Where to go after the login, as a ``Location`` can carry it: a viewer page, never
    another site (an open redirect would let a link show a look-alike page after a real
    login), percent-encoded (a group id in CJK is a valid page)."""
    if not target or not target.startswith("/ui") or target.startswith("//"):
        return "/ui"
    if any(c in target for c in "\\\r\n"):
        return "/ui"
    return quote(target, safe=_URL_CHARACTERS)
