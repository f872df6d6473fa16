"""Sample-level advantage (slime, AReaL): every sample inherits its rollout's reward and
baselines are taken over the group's *samples*, so a rollout that split into more
samples weighs more in its group's baseline (the paper's Figure 4: 3/4 instead of 1/2)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agl.core.contracts.samples import Sample
from agl.strategies.estimators import estimate, reward_of
from agl.strategies.registry import register


@register("advantage", "sample")
def sample_advantage(
    samples: Sequence[Sample],
    rewards: Mapping[str, float],
    estimator: str = "grpo",
    scale: bool = True,
) -> list[float]:
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group_id, []).append(i)
    advantage = [0.0] * len(samples)
    for members in groups.values():
        values = estimate(
            [reward_of(rewards, samples[i].rollout_id) for i in members], estimator, scale
        )
        for i, value in zip(members, values, strict=True):
            advantage[i] = value
    return advantage
