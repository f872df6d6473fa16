"""Rollout-level advantage (the paper's choice): baselines over the group's *rollouts*,
broadcast to every sample of a rollout. How many samples a rollout happened to split
into (retokenization, subagents, summaries) cannot move the baseline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agl.core.contracts.samples import Sample
from agl.strategies.estimators import estimate, reward_of
from agl.strategies.registry import register


@register("advantage", "rollout")
def rollout_advantage(
    samples: Sequence[Sample],
    rewards: Mapping[str, float],
    estimator: str = "grpo",
    scale: bool = True,
) -> list[float]:
    groups: dict[str, list[str]] = {}
    for s in samples:
        members = groups.setdefault(s.group_id, [])
        if s.rollout_id not in members:
            members.append(s.rollout_id)
    advantage: dict[str, float] = {}
    for members in groups.values():
        values = estimate([reward_of(rewards, r) for r in members], estimator, scale)
        advantage.update(zip(members, values, strict=True))
    return [advantage[s.rollout_id] for s in samples]
