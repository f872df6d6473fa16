"""Rollout-level token mean (slime, the paper's choice, eq. 16): each rollout weighs 1 / R,
spread over all action tokens of all its samples, whatever its sample count."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from agl.core.contracts.samples import Sample
from agl.strategies.registry import register
from agl.strategies.weights import per_token


@register("loss", "rollout_mean")
def rollout_mean(samples: Sequence[Sample]) -> list[list[float]]:
    tokens: Counter[str] = Counter()
    for s in samples:
        tokens[s.rollout_id] += s.num_actions
    rollouts = sum(1 for n in tokens.values() if n)
    return per_token(samples, lambda s: 1.0 / (rollouts * tokens[s.rollout_id]))
