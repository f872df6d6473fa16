"""Who may do what: one admin token, and two keys per rollout attempt.

- The **model key** (``agl-...``) calls the model through the attempt's proxy and nothing
  else. It is the agent's ``OPENAI_API_KEY``, so harnesses hand it to the model's shell
  tools: whatever the model can run holds it.
- The **report key** (``aglr-...``) also posts the attempt's events (the reward), ends the
  attempt and reads the rollout. Only the harness wrapper holds it (``agl.agent``): it is
  never in an agent's environment, so a tool that posts a reward with everything it can
  find there is refused.

Each key is an HMAC of (role, rollout id, attempt) under the gateway's secret, so the
gateway checks it without storing it, it dies with its attempt, and it cannot be forged
for another rollout or turned into the other role. Keys and tokens are never logged.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from agl.core.gateway.private_files import FILE_MODE, private_dir, private_file

ATTEMPT_KEY_PREFIX = "agl-"
REPORT_KEY_PREFIX = "aglr-"
# Domain separation: a report key's MAC is over this and the scope, a model key's over the
# scope alone, so neither MAC verifies as the other.
_REPORT_DOMAIN = b"report\x00"


@dataclass(frozen=True)
class Principal:
    """The holder of a request's bearer token: the admin, or one rollout attempt with its
    model key (``reports`` False) or its report key (True)."""

    admin: bool
    rollout_id: str | None = None
    attempt: int | None = None
    reports: bool = False

    def may_act_for(self, rollout_id: str, attempt: int) -> bool:
        return self.admin or (self.rollout_id == rollout_id and self.attempt == attempt)


ADMIN = Principal(admin=True, reports=True)


class Keyring:
    """Attempt keys read ``agl-<base64url(attempt:rollout_id)>.<base64url(hmac)>`` (model)
    and ``aglr-...`` alike (report): the ids in the clear let the gateway tell a valid key
    used out of its scope (403) from a forged one (401) without any lookup."""

    def __init__(self, admin_token: str, secret: bytes) -> None:
        self._admin = admin_token.encode()
        self._secret = secret

    def _mac(self, scope: bytes) -> bytes:
        return hmac.new(self._secret, scope, hashlib.sha256).digest()

    def attempt_key(self, rollout_id: str, attempt: int) -> str:
        """The attempt's model key: the proxy only."""
        scope = f"{attempt}:{rollout_id}".encode()
        return f"{ATTEMPT_KEY_PREFIX}{_b64(scope)}.{_b64(self._mac(scope))}"

    def report_key(self, rollout_id: str, attempt: int) -> str:
        """The attempt's report key: the proxy, its events, its end, its rollout."""
        scope = f"{attempt}:{rollout_id}".encode()
        return f"{REPORT_KEY_PREFIX}{_b64(scope)}.{_b64(self._mac(_REPORT_DOMAIN + scope))}"

    def identify(self, token: str) -> Principal | None:
        if hmac.compare_digest(token.encode(), self._admin):
            return ADMIN
        for prefix, domain, reports in (
            (REPORT_KEY_PREFIX, _REPORT_DOMAIN, True),
            (ATTEMPT_KEY_PREFIX, b"", False),
        ):
            if token.startswith(prefix):
                return self._attempt(token[len(prefix) :], domain, reports)
        return None

    def _attempt(self, body: str, domain: bytes, reports: bool) -> Principal | None:
        encoded_scope, _, encoded_mac = body.partition(".")
        try:
            scope = _unb64(encoded_scope)
            if not hmac.compare_digest(_unb64(encoded_mac), self._mac(domain + scope)):
                return None
            attempt, _, rollout_id = scope.decode().partition(":")
            return Principal(False, rollout_id, int(attempt), reports)
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
    from_env = os.environ.get("AGL_ADMIN_TOKEN")
    if from_env:
        return from_env, "AGL_ADMIN_TOKEN"
    path = run_dir / "admin_token"
    if not path.exists():
        private_dir(run_dir)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    private_file(path)  # one an earlier version left 0644 is tightened
    return path.read_text().strip(), str(path)
