"""Token mean (DAPO, eq. 14): every action token of the mini-batch weighs the same,
1 / Σ L. Long samples dominate."""

from __future__ import annotations

from collections.abc import Sequence

from agl.core.contracts.samples import Sample
from agl.strategies.registry import register
from agl.strategies.weights import per_token


@register("loss", "token_mean")
def token_mean(samples: Sequence[Sample]) -> list[list[float]]:
    total = sum(s.num_actions for s in samples)
    return per_token(samples, lambda s: 1.0 / total)
