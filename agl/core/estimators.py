"""Group baselines for outcome rewards, with verl's conventions so the two agree:

- grpo: (r - mean) / (std + eps), std unbiased (Bessel); ``scale=False`` drops the
  division (Dr. GRPO). A group of one has mean 0 and std 1.
- rloo: r - mean of the others, i.e. (r - mean) * n / (n - 1). A group of one keeps r.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

EPS = 1e-6


def grpo(rewards: Sequence[float], scale: bool = True, eps: float = EPS) -> list[float]:
    n = len(rewards)
    if n == 1:
        mean, std = 0.0, 1.0
    else:
        mean = math.fsum(rewards) / n
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (n - 1))
    if not scale:
        return [r - mean for r in rewards]
    return [(r - mean) / (std + eps) for r in rewards]


def rloo(rewards: Sequence[float]) -> list[float]:
    n = len(rewards)
    if n == 1:
        return [float(rewards[0])]
    mean = math.fsum(rewards) / n
    return [(r - mean) * n / (n - 1) for r in rewards]


def estimate(rewards: Sequence[float], estimator: str, scale: bool = True) -> list[float]:
    if estimator == "grpo":
        return grpo(rewards, scale)
    if estimator == "rloo":
        return rloo(rewards)
    raise ValueError(f"unknown advantage estimator {estimator!r}; use grpo or rloo")


def reward_of(rewards: Mapping[str, float], rollout_id: str) -> float:
    if rollout_id not in rewards:
        raise ValueError(f"no reward for rollout {rollout_id!r}")
    return float(rewards[rollout_id])
