"""Sampling seeds per request, so that a run's rollouts are a function of its seed.

An engine that samples every request from one shared generator makes a rollout depend
on what else ran before it and in which order the requests arrived: two runs with the
same seed diverge at the first race. The gateway gives each request that does not set a
``seed`` itself one of its own instead, derived from

- the run's seed (``GatewayConfig.sampling_seed``),
- the rollout and the attempt,
- the request's bytes (what the harness asked), and
- how many times this attempt sent those same bytes before (a harness that retries a
  request gets a new sample, as it would from an unseeded engine),

so a call's seed does not depend on when it arrived or on the calls of other rollouts.
Both engines honour a request's seed (vLLM's per-request generator; the embedded engine's
``torch.Generator`` per request, ``agl/backends/inference/engine.py``).

What this cannot make exact: the order of two identical requests sent at once by one
attempt (they get the two seeds in arrival order), and counts after a gateway restart
(the repeat counter lives in memory: a request repeated across a restart may get its
first seed again).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

# Repeat counts kept: plenty for the attempts in flight; an evicted count restarts at 0.
CAPACITY = 1 << 16
# A seed below 2**62: room for the engines' seed + choice index in a signed 64-bit int.
SEED_BITS = 62


def request_seed(
    run_seed: int, rollout_id: str, attempt: int, request_hash: bytes, repeat: int
) -> int:
    """The seed of the ``repeat``-th sending (from 0) of a request by one attempt."""
    head = f"agl-seed\n{run_seed}\n{rollout_id}\n{attempt}\n{repeat}\n".encode()
    digest = hashlib.sha256(head + request_hash).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)


class RequestSeeds:
    """Hands out :func:`request_seed` values, counting each attempt's repeats."""

    def __init__(self, run_seed: int, capacity: int = CAPACITY) -> None:
        if run_seed < 0:
            raise ValueError(f"a run seed is a non-negative integer, not {run_seed}")
        self.run_seed = run_seed
        self._capacity = capacity
        self._repeats: OrderedDict[tuple[str, int, bytes], int] = OrderedDict()

    def __len__(self) -> int:
        """How many (rollout, attempt, request) counts are kept."""
        return len(self._repeats)

    def next(self, rollout_id: str, attempt: int, request_hash: bytes) -> int:
        key = (rollout_id, attempt, request_hash)
        repeat = self._repeats.pop(key, 0)
        self._repeats[key] = repeat + 1
        if len(self._repeats) > self._capacity:
            self._repeats.popitem(last=False)
        return request_seed(self.run_seed, rollout_id, attempt, request_hash, repeat)
