"""Client-side pacing of Job creations: ``create_qps`` a second on average, ``create_burst``
at once. Pure bookkeeping over a clock; the executor offers only the slots it would let
through now."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` acquisitions per second on average, ``burst`` at once."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.stamp = float(burst), clock()
        self.lock = asyncio.Lock()

    def available(self) -> int:
        """How many acquisitions would not wait now."""
        self._refill()
        return int(self.tokens)

    async def take(self) -> None:
        async with self.lock:
            self._refill()
            if self.tokens < 1:
                await asyncio.sleep((1 - self.tokens) / self.rate)
                self._refill()
            self.tokens -= 1

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
