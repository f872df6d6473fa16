"""The viewer's login: a browser cannot send a Bearer header, so the admin token is typed
into a form once and the browser keeps a cookie instead.

The cookie holds an HMAC of the admin token, not the token: a cookie that leaks (a
proxy's log, a shared profile) opens the read-only viewer, never the API, and it stops
working when the admin token changes. It is HttpOnly (no script reads it) and
SameSite=Strict (no other site's page makes the browser send it).
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import parse_qs, quote

from starlette.requests import Request

COOKIE = "agl_ui"
LOGIN = "/ui/login"
MAX_FORM_BYTES = 8192
_PURPOSE = b"agl ui session v1"
# What a redirect target keeps as it is; anything else (non-ASCII, spaces, quotes) is
# percent-encoded, since an HTTP header is Latin-1 and a Location must be a URL.
_URL_CHARACTERS = "/?&=%#+:@!$'()*,;~"


def session_value(admin_token: str) -> str:
    return hmac.new(admin_token.encode(), _PURPOSE, hashlib.sha256).hexdigest()


def valid_session(cookie: str | None, admin_token: str) -> bool:
    return cookie is not None and hmac.compare_digest(
        cookie.encode(), session_value(admin_token).encode()
    )


def valid_token(typed: str, admin_token: str) -> bool:
    return hmac.compare_digest(typed.strip().encode(), admin_token.encode())


def cookie_header(admin_token: str) -> str:
    # No Secure flag: the gateway serves plain HTTP (loopback, a port-forward); a Secure
    # cookie would never come back over it.
    return f"{COOKIE}={session_value(admin_token)}; Path=/ui; HttpOnly; SameSite=Strict"


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
