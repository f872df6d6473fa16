"""Sequence mean of token means (GRPO, eq. 15): each sample weighs 1 / N, spread over its
L_j tokens. A rollout that split into more samples weighs more."""

from __future__ import annotations

from collections.abc import Sequence

from agl.core.contracts.samples import Sample
from agl.strategies.registry import register
from agl.strategies.weights import per_token


@register("loss", "seq_mean")
def seq_mean(samples: Sequence[Sample]) -> list[list[float]]:
    n = sum(1 for s in samples if s.num_actions)
    return per_token(samples, lambda s: 1.0 / (n * s.num_actions))
