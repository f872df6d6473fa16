"""Calls to inference endpoints, retried on transient failures, with the inference key.

Connection errors, 5xx and 429 are retried with exponential backoff and jitter; any
other answer is final. A stream is retried only until its first byte, since after that
the harness has seen part of the answer.

Every call carries the inference key, when the gateway has one, as ``Authorization:
Bearer <key>``; a harness's own headers (its attempt key) never go upstream. The key comes
from a file or from ``$AGL_INFERENCE_KEY`` (``load_key``), never from a command line,
which every user of the machine can read. ``python -m agl.train`` hands its gateway the
run's key that way; for a gateway of your own, it is your endpoint's key.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

log = logging.getLogger(__name__)

RETRYABLE = frozenset({429, 500, 502, 503, 504})
KEY_ENV_VAR = "AGL_INFERENCE_KEY"


def checked_key(text: str, source: str) -> str:
    """``text`` as a key: surrounding whitespace left out, none inside (it goes in a
    header), not empty. The errors name ``source``, never the key."""
    key = text.strip()
    if not key:
        raise ValueError(f"{source} holds no key")
    if any(c.isspace() for c in key):
        raise ValueError(f"{source} holds a key with whitespace inside: a key is one word")
    return key


def read_key_file(path: str) -> str:
    """The key the file ``path`` holds (OSError; ValueError, naming the file: no key, or
    not text)."""
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text") from None
    return checked_key(text, path)


def load_key(key_file: str = "", environ: Mapping[str, str] = os.environ) -> str | None:
    """The inference key: the file ``key_file`` names if given, else ``$AGL_INFERENCE_KEY``
    unless unset or blank, else None (no key). ValueError or OSError for a bad one."""
    if key_file:
        return read_key_file(key_file)
    value = environ.get(KEY_ENV_VAR, "")
    return checked_key(value, f"${KEY_ENV_VAR}") if value.strip() else None


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 3
    backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        if retry_after is not None:
            try:
                return min(float(retry_after), self.max_backoff_s)
            except ValueError:
                pass
        base = min(self.backoff_s * 2**attempt, self.max_backoff_s)
        return base * (0.5 + random.random() / 2)


class UpstreamUnavailable(Exception):
    """The endpoint could not be reached after every retry."""


class Upstream:
    """POSTs to inference endpoints; with ``key``, each carries ``Authorization: Bearer``."""

    def __init__(
        self, policy: RetryPolicy, read_timeout_s: float = 600.0, key: str | None = None
    ) -> None:
        self.policy = policy
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._headers = {"Content-Type": "application/json"}
        if key is not None:
            self._headers["Authorization"] = f"Bearer {key}"

    async def start(self) -> None:
        # No connection cap: the admission gate and the harnesses bound concurrency.
        # Idle connections are dropped before the servers' own 5 s keep-alive (uvicorn's
        # default, vLLM's too) ends them: a connection the server closed while idle would
        # be reused and fail with ServerDisconnectedError (then retried).
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=True
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def open(self, url: str, body: bytes) -> aiohttp.ClientResponse:
        """POST ``body``; the response of the last try (headers read, body unread).

        The caller owns the response and must release it.
        """
        assert self._session is not None, "Upstream.start() was not called"
        for attempt in range(self.policy.retries + 1):
            last = attempt == self.policy.retries
            try:
                response = await self._session.post(url, data=body, headers=self._headers)
            except (aiohttp.ClientConnectionError, TimeoutError) as error:
                if last:
                    raise UpstreamUnavailable(f"{url}: {error!r}") from error
                log.warning("upstream %s unreachable (%r); retrying", url, error)
                await asyncio.sleep(self.policy.delay(attempt))
                continue
            if response.status in RETRYABLE and not last:
                retry_after = response.headers.get("Retry-After")
                log.warning("upstream %s answered %d; retrying", url, response.status)
                response.release()
                await asyncio.sleep(self.policy.delay(attempt, retry_after))
                continue
            return response
        raise AssertionError("unreachable")
