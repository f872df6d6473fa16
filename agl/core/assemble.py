"""From finished rollouts to one training batch: dedup → merge → advantage, plus the
per-token scale that drops stale calls. Pure (no HTTP, no torch).

Invariants:
- only rollouts that succeeded with a reward enter a batch; the others are counted
  (``rollouts/failed``, ``rollouts/no_reward``) and left out of their group's baseline;
- every sample's ``token_scale`` is 1 on tokens of calls at most ``max_staleness``
  versions behind ``policy_version``, 0 on the action tokens of older calls.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.core.calls import dedup
from agl.core.metrics import merge_metrics
from agl.core.records import Status
from agl.core.types import ModelCall, Sample

Merge = Callable[..., list[Sample]]
Advantage = Callable[..., list[float]]


@dataclass(frozen=True)
class FinishedRollout:
    """A rollout in its final state: succeeded, or failed with no attempt left."""

    rollout_id: str
    group_id: str
    mode: str
    status: Status
    reward: float | None
    calls: list[ModelCall]
    error: str | None = None
    invalid_calls: Mapping[str, int] = field(default_factory=dict)  # reason -> left out

    @property
    def usable(self) -> bool:
        return self.status is Status.SUCCEEDED and self.reward is not None


@dataclass
class Batch:
    samples: list[Sample]
    advantages: list[float]
    token_scale: list[list[float]]
    rewards: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MergeStrategy:
    """A merge function and its options; ``decode`` is passed to strategies that take it
    (stitch compares texts), so a new strategy needs no change here."""

    merge: Merge
    options: Mapping[str, Any] = field(default_factory=dict)
    decode: Callable[[Sequence[int]], str] | None = None

    def __call__(self, calls: list[ModelCall], rollout_id: str, group_id: str) -> list[Sample]:
        options = dict(self.options)
        if self.decode is not None and "decode" in inspect.signature(self.merge).parameters:
            options.setdefault("decode", self.decode)
        return self.merge(calls, rollout_id, group_id, **options)


def assemble(
    rollouts: Sequence[FinishedRollout],
    merge: Callable[[list[ModelCall], str, str], list[Sample]],
    advantage: Callable[[list[Sample], dict[str, float]], list[float]],
    *,
    policy_version: int = 0,
    max_staleness: int | None = None,
) -> Batch:
    """One batch from ``rollouts`` (any mix of groups)."""
    kept = [r for r in rollouts if r.usable]
    per_rollout: list[list[Sample]] = []
    scales: list[list[float]] = []
    staleness: list[int] = []
    dropped = calls_total = 0
    for r in kept:
        calls = dedup(r.calls)
        calls_total += len(calls)
        lags = [max(0, policy_version - c.policy_version) for c in calls]
        staleness.extend(lags)
        limit = math.inf if max_staleness is None else max_staleness
        stale = {i for i, lag in enumerate(lags) if lag > limit}
        dropped += len(stale)
        samples = merge(calls, r.rollout_id, r.group_id) if calls else []
        per_rollout.append(samples)
        scales.extend(_scale(s, stale) for s in samples)
    samples = [s for group in per_rollout for s in group]
    rewards = {r.rollout_id: float(r.reward) for r in kept if r.reward is not None}
    advantages = advantage(samples, rewards) if samples else []
    metrics = {
        "rollouts/finished": float(len(rollouts)),
        "rollouts/failed": float(sum(r.status is Status.FAILED for r in rollouts)),
        "rollouts/no_reward": float(
            sum(r.status is Status.SUCCEEDED and r.reward is None for r in rollouts)
        ),
        "rollouts/without_calls": float(sum(not r.calls for r in kept)),
        "reward/mean": _mean(list(rewards.values())),
        "calls/per_rollout": calls_total / max(len(kept), 1),
        **_invalid_metrics(kept),
        "staleness/mean": _mean([float(x) for x in staleness]),
        "staleness/max": float(max(staleness, default=0)),
        "staleness/dropped_calls": dropped / max(calls_total, 1),
        **merge_metrics(per_rollout, calls_total),
    }
    return Batch(samples, advantages, scales, rewards, metrics)


def _invalid_metrics(rollouts: Sequence[FinishedRollout]) -> dict[str, float]:
    """Calls left out as untrainable, in all and by reason (``agl.core.calls``)."""
    by_reason: dict[str, float] = {}
    for r in rollouts:
        for reason, n in r.invalid_calls.items():
            by_reason[f"calls/invalid/{reason}"] = by_reason.get(f"calls/invalid/{reason}", 0) + n
    return {"calls/invalid": sum(by_reason.values()), **by_reason}


def _scale(sample: Sample, stale: set[int]) -> list[float]:
    if not stale:
        return [1.0] * len(sample.tokens)
    return [
        0.0 if action and call in stale else 1.0
        for action, call in zip(sample.action_mask, sample.call_index, strict=True)
    ]


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0
