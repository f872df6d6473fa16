"""Failed logins slow down, per client address: after ``free_failures`` in a row, each
further try waits out a backoff that doubles with every failure (up to ``max_wait_s``),
and is refused with 429 until it has passed, whatever token it carries. A right token
clears the address's record. Guessing at loopback speed (~1,600 a second before this)
becomes one guess a minute.

Behind a port-forward every browser shares one address, so someone guessing there also
makes the admin wait; the admin token as a Bearer header (curl) never waits.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Record:
    failures: int
    last_failure: float
    blocked_until: float


class LoginThrottle:
    """``clock`` is monotonic seconds (injectable, so a test needs no sleeping)."""

    def __init__(
        self,
        free_failures: int = 5,
        first_wait_s: float = 1.0,
        max_wait_s: float = 60.0,
        forget_after_s: float = 600.0,
        max_addresses: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.free_failures = free_failures
        self.first_wait_s = first_wait_s
        self.max_wait_s = max_wait_s
        self.forget_after_s = forget_after_s
        self.max_addresses = max_addresses
        self.clock = clock
        self._records: OrderedDict[str, _Record] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def wait(self, address: str) -> float:
        """Seconds before ``address`` may try again; 0.0 if it may now."""
        record = self._records.get(address)
        return 0.0 if record is None else max(0.0, record.blocked_until - self.clock())

    def failed(self, address: str) -> None:
        now = self.clock()
        self._forget(now)
        record = self._records.pop(address, None) or _Record(0, now, now)
        record.failures += 1
        record.last_failure = now
        over = record.failures - self.free_failures
        if over >= 0:
            record.blocked_until = now + min(self.max_wait_s, self.first_wait_s * 2.0**over)
        self._records[address] = record  # most recent last

    def succeeded(self, address: str) -> None:
        self._records.pop(address, None)

    def _forget(self, now: float) -> None:
        """Drop the addresses quiet for ``forget_after_s``, oldest first, and make room
        for one (under a flood of addresses the oldest go first)."""
        records = self._records
        while records:
            address, record = next(iter(records.items()))
            quiet = now - max(record.last_failure, record.blocked_until)
            if quiet < self.forget_after_s and len(records) < self.max_addresses:
                return
            del records[address]
