"""Group baselines for outcome rewards, with verl's conventions so the two agree:

- grpo: (r - mean) / (std + eps), std unbiased (Bessel); ``scale=False`` drops the
  division (Dr. GRPO).
- rloo: r - mean of the others, i.e. (r - mean) * n / (n - 1).

A group of one has no baseline, so no signal: advantage 0 under both (verl gives grpo's
lone member its raw score, mean 0 and std 1, and rloo's its reward: a baseline-free
advantage that would differ between rollout and sample level exactly where a rollout
split). A group whose rewards are equal gets 0 as well, by the formulas. So advantages are
invariant to adding a constant to every reward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

EPS = 1e-6


def grpo(rewards: Sequence[float], scale: bool = True, eps: float = EPS) -> list[float]:
    n = len(rewards)
    if n == 1:
        return [0.0]
    mean = math.fsum(rewards) / n
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (n - 1))
    if not scale:
        return [r - mean for r in rewards]
    return [(r - mean) / (std + eps) for r in rewards]


def rloo(rewards: Sequence[float]) -> list[float]:
    n = len(rewards)
    if n == 1:
        return [0.0]
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
