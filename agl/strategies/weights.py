"""Per-token loss weights, one place for every normalization (cf. verl's ``agg_loss``).

Weights are computed once for a whole optimizer mini-batch, so that
``loss = Σ weight · token_loss`` is the same however the mini-batch is later cut into
micro-batches or spread over ranks: each piece just sums its share. Non-action tokens
weigh 0; samples without action tokens do not count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agl.core.contracts.samples import Sample


def per_token(samples: Sequence[Sample], weight: Callable[[Sample], float]) -> list[list[float]]:
    """``weight(sample)`` on each action token of each sample, 0 elsewhere."""
    out = []
    for s in samples:
        w = weight(s) if s.num_actions else 0.0
        out.append([w if a else 0.0 for a in s.action_mask])
    return out
