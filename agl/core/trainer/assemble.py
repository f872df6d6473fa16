"""From finished rollouts to one training batch: dedup → merge → advantage, with stale
calls taken out of the loss. Pure (no HTTP, no torch).

Invariants:
- a rollout enters the batch when it succeeded with a reward, or when its agent failed it
  (``agl.core.contracts.failures``: the harness raised, ended without a reward, timed out) and
  ``agent_failures`` is ``zero``: then with reward 0, so a policy that breaks its harness
  is scored for it. Infrastructure failures (after their retries) are left out. Each is
  counted by cause (``rollouts/failed/<cause>``);
- a group with no signal (one rollout in the batch, or all its rewards equal) gives its
  samples advantage 0 under every estimator and level (``agl.strategies.estimators``; counted
  as ``groups/no_signal``), so advantages are invariant to a constant shift of rewards;
- the action tokens of calls more than ``max_staleness`` versions behind
  ``policy_version`` are context, not actions, before any loss strategy normalises, so
  staleness never shrinks the other tokens' weights;
- every sample carries the sampling transform of each of its tokens' calls.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from agl.core.contracts.failures import Cause, failure_cause
from agl.core.contracts.records import Status
from agl.core.contracts.samples import NO_TRANSFORM, ModelCall, Sample, Sampling
from agl.core.contracts.strategies import Advantage, Decode, Merge
from agl.strategies.dedup import dedup
from agl.strategies.merge_metrics import merge_metrics, unique_tokens

AgentFailures = Literal["zero", "drop"]
AGENT_FAILURES = ("zero", "drop")


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
    # Why it gave no reward (None: it did). Left unset, it is read from the status, the
    # error and the reward alone (the collector also looks at the failed calls).
    cause: Cause | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)  # the task's, with the reward
    input: Any = None  # the rollout's input, for what shows rollouts (not for training)

    def __post_init__(self) -> None:
        if self.cause is None:
            cause = failure_cause(self.status, self.error, self.reward is not None)
            object.__setattr__(self, "cause", cause)

    def scored_reward(self, agent_failures: AgentFailures = "zero") -> float | None:
        """The reward it is trained and validated with; None: left out."""
        if self.cause is None:
            return self.reward
        return 0.0 if self.cause.agent and agent_failures == "zero" else None


@dataclass
class Batch:
    samples: list[Sample]
    advantages: list[float]
    rewards: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MergeStrategy:
    """A merge function and its options; ``decode`` is passed to strategies that take it
    (stitch compares texts), so a new strategy needs no change here."""

    merge: Callable[..., list[Sample]]  # a registered merge: Merge, plus its options
    options: Mapping[str, Any] = field(default_factory=dict)
    decode: Decode | None = None

    def __call__(self, calls: list[ModelCall], rollout_id: str, group_id: str) -> list[Sample]:
        options = dict(self.options)
        if self.decode is not None and "decode" in inspect.signature(self.merge).parameters:
            options.setdefault("decode", self.decode)
        return self.merge(calls, rollout_id, group_id, **options)


def assemble(
    rollouts: Sequence[FinishedRollout],
    merge: Merge,
    advantage: Advantage,
    *,
    policy_version: int = 0,
    max_staleness: int | None = None,
    agent_failures: AgentFailures = "zero",
    dedup_rule: str = "continued",
) -> Batch:
    """One batch from ``rollouts`` (any mix of groups)."""
    if agent_failures not in AGENT_FAILURES:
        raise ValueError(f"agent_failures must be one of {AGENT_FAILURES}, not {agent_failures!r}")
    rewards = {
        r.rollout_id: reward
        for r in rollouts
        if (reward := r.scored_reward(agent_failures)) is not None
    }
    kept = [r for r in rollouts if r.rollout_id in rewards]
    per_rollout: list[list[Sample]] = []
    staleness: list[int] = []
    dropped = calls_total = unique = 0
    limit = math.inf if max_staleness is None else max_staleness
    for r in kept:
        calls = dedup(r.calls, dedup_rule)
        calls_total += len(calls)
        unique += unique_tokens([[*c.prompt_ids, *c.response_ids] for c in calls])
        lags = [max(0, policy_version - c.policy_version) for c in calls]
        staleness.extend(lags)
        stale = {i for i, lag in enumerate(lags) if lag > limit}
        dropped += len(stale)
        samples = merge(calls, r.rollout_id, r.group_id) if calls else []
        per_rollout.append([_prepared(s, calls, stale) for s in samples])
    samples = [s for group in per_rollout for s in group]
    advantages = advantage(samples, rewards) if samples else []
    metrics = {
        "rollouts/finished": float(len(rollouts)),
        "rollouts/failed": float(sum(r.status is Status.FAILED for r in rollouts)),
        "rollouts/no_reward": float(sum(r.cause is Cause.NO_REWARD for r in rollouts)),
        "rollouts/scored_zero": float(
            sum(r.cause is not None and r.rollout_id in rewards for r in rollouts)
        ),
        "rollouts/left_out": float(len(rollouts) - len(kept)),
        **_cause_metrics(rollouts),
        "rollouts/without_calls": float(sum(not r.calls for r in kept)),
        "reward/mean": _mean(list(rewards.values())),
        "groups/no_signal": float(len(no_signal_groups(kept, rewards))),
        "calls/per_rollout": calls_total / max(len(kept), 1),
        **_invalid_metrics(kept),
        **task_metrics(kept, "task"),
        "staleness/mean": _mean([float(x) for x in staleness]),
        "staleness/max": float(max(staleness, default=0)),
        "staleness/dropped_calls": dropped / max(calls_total, 1),
        **merge_metrics(per_rollout, calls_total, unique),
    }
    return Batch(samples, advantages, rewards, metrics)


def no_signal_groups(rollouts: Sequence[FinishedRollout], rewards: Mapping[str, float]) -> set[str]:
    """Groups of ``rollouts`` with one scored rollout, or whose scored rewards are equal."""
    by_group: dict[str, list[float]] = {}
    for r in rollouts:
        if r.rollout_id in rewards:
            by_group.setdefault(r.group_id, []).append(rewards[r.rollout_id])
    return {g for g, values in by_group.items() if len(values) < 2 or len(set(values)) == 1}


def task_metrics(rollouts: Sequence[FinishedRollout], prefix: str) -> dict[str, float]:
    """The mean of each metric the task reported with its rewards (over the rollouts that
    reported it), as ``<prefix>/<name>``."""
    values: dict[str, list[float]] = {}
    for r in rollouts:
        for name, value in r.metrics.items():
            values.setdefault(name, []).append(value)
    return {f"{prefix}/{name}": _mean(v) for name, v in sorted(values.items())}


def _cause_metrics(rollouts: Sequence[FinishedRollout]) -> dict[str, float]:
    counts = {f"rollouts/failed/{cause.value}": 0.0 for cause in Cause}
    for r in rollouts:
        if r.cause is not None:
            counts[f"rollouts/failed/{r.cause.value}"] += 1
    return counts


def _prepared(sample: Sample, calls: Sequence[ModelCall], stale: set[int]) -> Sample:
    """The sample with its stale calls' tokens made context, and its tokens' sampling
    (None when every call was sampled untransformed: the backends' plain path)."""
    transforms = [NO_TRANSFORM if c < 0 else calls[c].sampling for c in sample.call_index]
    sampling: list[Sampling] | None = transforms
    if all(x == NO_TRANSFORM for x in transforms):
        sampling = None
    if not stale:
        return replace(sample, sampling=sampling)
    mask = [
        0 if action and call in stale else action
        for action, call in zip(sample.action_mask, sample.call_index, strict=True)
    ]
    logprobs = [lp if m else 0.0 for lp, m in zip(sample.logprobs, mask, strict=True)]
    return replace(sample, action_mask=mask, logprobs=logprobs, sampling=sampling)


def _invalid_metrics(rollouts: Sequence[FinishedRollout]) -> dict[str, float]:
    """Calls left out as untrainable, in all and by reason (``agl.core.trainer.calls``)."""
    by_reason: dict[str, float] = {}
    for r in rollouts:
        for reason, n in r.invalid_calls.items():
            by_reason[f"calls/invalid/{reason}"] = by_reason.get(f"calls/invalid/{reason}", 0) + n
    return {"calls/invalid": sum(by_reason.values()), **by_reason}


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0
