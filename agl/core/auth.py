"""Who may do what: one admin token, and one key per rollout attempt.

An attempt key is an HMAC of (rollout id, attempt) under the gateway's secret, so the
gateway checks it without storing it, it dies with its attempt, and it cannot be forged
for another rollout. Keys and tokens are never logged.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from agl.core.private_files import FILE_MODE, private_dir, private_file

ATTEMPT_KEY_PREFIX = "agl-"


@dataclass(frozen=True)
class Principal:
    """The holder of a request's bearer token: the admin, or one rollout attempt."""

    admin: bool
    rollout_id: str | None = None
    attempt: int | None = None

    def may_act_for(self, rollout_id: str, attempt: int) -> bool:
        return self.admin or (self.rollout_id == rollout_id and self.attempt == attempt)


ADMIN = Principal(admin=True)


class Keyring:
    """Attempt keys read ``agl-<base64url(attempt:rollout_id)>.<base64url(hmac)>``: the ids
    in the clear let the gateway tell a valid key used out of its scope (403) from a
    forged one (401) without any lookup."""

    def __init__(self, admin_token: str, secret: bytes) -> None:
        self._admin = admin_token.encode()
        self._secret = secret

    def _mac(self, scope: bytes) -> bytes:
        return hmac.new(self._secret, scope, hashlib.sha256).digest()

    def attempt_key(self, rollout_id: str, attempt: int) -> str:
        scope = f"{attempt}:{rollout_id}".encode()
        return f"{ATTEMPT_KEY_PREFIX}{_b64(scope)}.{_b64(self._mac(scope))}"

    def identify(self, token: str) -> Principal | None:
        if hmac.compare_digest(token.encode(), self._admin):
            return ADMIN
        if not token.startswith(ATTEMPT_KEY_PREFIX):
            return None
        encoded_scope, _, encoded_mac = token[len(ATTEMPT_KEY_PREFIX) :].partition(".")
        try:
            scope = _unb64(encoded_scope)
            valid = hmac.compare_digest(_unb64(encoded_mac), self._mac(scope))
            attempt, _, rollout_id = scope.decode().partition(":")
            return (
                Principal(admin=False, rollout_id=rollout_id, attempt=int(attempt))
                if valid
                else None
            )
        except ValueError:
            return None


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def bearer(header: str | None) -> str | None:
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def load_admin_token(run_dir: Path, token_file: str = "") -> tuple[str, str]:
    """The admin token and where it came from: the file ``token_file`` names if given
    (source ``admin_token_file``), else ``AGL_ADMIN_TOKEN`` if set, else the token kept
    in ``run_dir/admin_token`` (made once, mode 600; its path is the source). The first
    two count as a secret configured (see ``GatewayConfig``); the last does not."""
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"admin_token_file {token_file} is empty")
        return token, "admin_token_file"
    token = os.environ.get("AGL_ADMIN_TOKEN")
    if token:
        return token, "AGL_ADMIN_TOKEN"
    path = run_dir / "admin_token"
    if not path.exists():
        private_dir(run_dir)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    private_file(path)  # one an earlier version left 0644 is tightened
    return path.read_text().strip(), str(path)
