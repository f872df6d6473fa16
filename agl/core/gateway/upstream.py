"""Calls to inference endpoints, retried on transient failures.

Connection errors, 5xx and 429 are retried with exponential backoff and jitter; any
other answer is final. A stream is retried only until its first byte, since after that
the harness has seen part of the answer.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

import aiohttp

log = logging.getLogger(__name__)

RETRYABLE = frozenset({429, 500, 502, 503, 504})


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
    def __init__(self, policy: RetryPolicy, read_timeout_s: float = 600.0) -> None:
        self.policy = policy
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

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
        headers = {"Content-Type": "application/json"}
        for attempt in range(self.policy.retries + 1):
            last = attempt == self.policy.retries
            try:
                response = await self._session.post(url, data=body, headers=headers)
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
