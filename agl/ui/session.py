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
from urllib.parse import parse_qs

COOKIE = "agl_ui"
LOGIN = "/ui/login"
MAX_FORM_BYTES = 8192
_PURPOSE = b"agl ui session v1"


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


def read_form(body: bytes) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body: the first value of each field."""
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0] for name, values in fields.items()}


def safe_next(target: str | None) -> str:
    """Where to go after the login: a viewer page, never another site (an open redirect
    would let a link show a look-alike page after a real login)."""
    if not target or not target.startswith("/ui") or target.startswith("//"):
        return "/ui"
    if any(c in target for c in "\\\r\n"):
        return "/ui"
    return target
