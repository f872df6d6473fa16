"""Calls per attempt key: a token bucket each, and the 429 a call over it gets; in the
process (one gateway) or in a store that replicas share."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from agl.core.gateway.store.base import SharedStore
from agl.core.http_errors import ApiError


class RateLimit(Protocol):
    """What the gateway asks of a rate limit, in the process or shared (see below)."""

    rate: float
    burst: float

    async def admit(self, key: tuple[str, int]) -> float:
        """Spend a token of ``key``'s bucket: 0.0 if the call is admitted, else the
        seconds until it would be."""
        ...

    async def spend(self, key: tuple[str, int], cost: float) -> None:
        """Spend ``cost`` more tokens of an admitted call, into debt if need be."""
        ...


class AttemptRateLimit:
    """A token bucket per attempt: ``burst`` tokens at once, then ``rate`` a second.

    A call is admitted while its bucket holds a token and spends one; an event batch then
    spends one more per further event (``charge``), which may leave the bucket in debt:
    a batch at the events cap still passes, and the attempt's next calls wait until the
    debt is paid back, so events, not requests, are what the rate bounds.

    Buckets live in least-recently-used order; one idle long enough to have refilled
    (``burst / rate`` seconds, 2 s by default, longer for one in debt) is the same as no
    bucket and is dropped on the next call, so memory follows the attempts active in the
    last few seconds, with ``max_buckets`` as a hard cap under a flood of distinct
    attempts. A finished attempt's bucket simply expires that way."""

    def __init__(
        self,
        rate: float,
        burst: int,
        max_buckets: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_buckets = max_buckets
        self.clock = clock
        self._buckets: OrderedDict[tuple[str, int], tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: tuple[str, int]) -> float:
        """Spend one token of ``key``'s bucket: 0.0 if the call is admitted, else the
        seconds until it would be."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        tokens = self._tokens(key, now)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        return wait

    def charge(self, key: tuple[str, int], cost: float) -> None:
        """Spend ``cost`` more tokens of an admitted call, into debt if need be."""
        if self.rate <= 0 or cost <= 0:
            return
        now = self.clock()
        self._buckets[key] = (self._tokens(key, now) - cost, now)

    async def admit(self, key: tuple[str, int]) -> float:
        return self.take(key)

    async def spend(self, key: tuple[str, int], cost: float) -> None:
        self.charge(key, cost)

    def _tokens(self, key: tuple[str, int], now: float) -> float:
        """What ``key``'s bucket holds now, taken out of the LRU order to be put back."""
        bucket = self._buckets.pop(key, None)
        self._expire(now)
        if bucket is None:
            return self.burst
        return min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)

    def _expire(self, now: float) -> None:
        """Drop the buckets that have refilled, oldest first, and make room for one."""
        buckets = self._buckets
        while buckets:
            key, (tokens, last) = next(iter(buckets.items()))
            refilled = now - last >= (self.burst - min(tokens, 0.0)) / self.rate
            if not refilled and len(buckets) < self.max_buckets:
                return
            del buckets[key]


class SharedRateLimit:
    """:class:`AttemptRateLimit`'s buckets kept in a store that replicas share, so that
    an attempt calling several replicas is held to one rate, not one per replica. Each
    take and charge is one atomic upsert of the attempt's bucket, refilled by the
    database's clock; a bucket that has refilled to its burst is the same as none, and
    the replicas' heartbeats delete it, so the store holds the active attempts' only."""

    def __init__(self, store: SharedStore, rate: float, burst: int) -> None:
        self.store = store
        self.rate = rate
        self.burst = float(burst)

    async def admit(self, key: tuple[str, int]) -> float:
        """As :meth:`AttemptRateLimit.take`."""
        if self.rate <= 0:
            return 0.0
        return await self.store.take_token(key, self.rate, self.burst)

    async def spend(self, key: tuple[str, int], cost: float) -> None:
        """As :meth:`AttemptRateLimit.charge`."""
        if self.rate <= 0 or cost <= 0:
            return
        await self.store.charge_tokens(key, self.rate, self.burst, cost)


class RateLimited(ApiError):
    """429 with ``Retry-After`` (whole seconds, as HTTP has it) and ``retry-after-ms``
    (which the openai client prefers), OpenAI's ``rate_limit_error`` type."""

    def __init__(self, message: str, wait_s: float) -> None:
        super().__init__(
            429,
            message,
            code="rate_limit_exceeded",
            headers={
                "Retry-After": str(max(1, math.ceil(wait_s))),
                "retry-after-ms": str(max(1, math.ceil(wait_s * 1000))),
            },
            retry_after_s=round(wait_s, 3),
        )
        self.wait_s = wait_s
