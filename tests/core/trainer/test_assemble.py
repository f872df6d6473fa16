"""Batch assembly: failures scored by cause, groups without signal, stale calls out of the
loss before it normalises, each token's sampling carried to the trainer."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.core.contracts.records import Status
from agl.core.contracts.samples import NO_TRANSFORM, ModelCall, Sampling
from agl.core.trainer.assemble import FinishedRollout, MergeStrategy, assemble
from agl.strategies.registry import get


def _calls(versions: list[int], sampling: Sampling = NO_TRANSFORM) -> list[ModelCall]:
    calls, prompt = [], [1, 2]
    for i, v in enumerate(versions):
        response = [10 + i, 3]
        calls.append(
            ModelCall(list(prompt), response, [-0.5, -0.1], policy_version=v, sampling=sampling)
        )
        prompt = prompt + response + [4]
    return calls


def _rollout(
    rid: str,
    reward: float | None,
    versions=(0,),
    status=Status.SUCCEEDED,
    error: str | None = None,
    group: str = "g",
):
    return FinishedRollout(rid, group, "train", status, reward, _calls(list(versions)), error=error)


def _advantage(name: str, estimator: str = "grpo"):
    return lambda samples, rewards: get("advantage", name)(samples, rewards, estimator)


PREFIX = MergeStrategy(get("merge", "prefix"))


def _by_rollout(batch) -> dict[str, float]:
    return dict(zip((s.rollout_id for s in batch.samples), batch.advantages, strict=True))


def test_agent_failures_score_zero_and_infrastructure_failures_leave_the_group() -> None:
    rollouts = [
        _rollout("won", 1.0),
        _rollout("raised", None, status=Status.FAILED, error="ValueError: no guess"),
        _rollout("silent", None),  # succeeded without a reward
        _rollout("slow", None, status=Status.FAILED, error="timed out after 60 s"),
        _rollout("lost", None, status=Status.FAILED, error="worker exited with code -9"),
    ]
    batch = assemble(rollouts, PREFIX, _advantage("rollout"))
    assert batch.rewards == {"won": 1.0, "raised": 0.0, "silent": 0.0, "slow": 0.0}
    advantages = _by_rollout(batch)
    assert advantages["won"] > 0 > advantages["raised"]  # crashing the harness is punished
    assert advantages["raised"] == advantages["silent"] == advantages["slow"]
    m = batch.metrics
    assert (m["rollouts/failed"], m["rollouts/scored_zero"], m["rollouts/left_out"]) == (3, 3, 1)
    assert m["rollouts/failed/harness_error"] == 1
    assert m["rollouts/failed/no_reward"] == m["rollouts/no_reward"] == 1
    assert m["rollouts/failed/timeout"] == 1
    assert m["rollouts/failed/executor"] == 1
    assert m["reward/mean"] == 0.25


def test_drop_keeps_the_old_rule_failures_leave_their_group() -> None:
    rollouts = [
        _rollout("a", 1.0),
        _rollout("b", 0.0),
        _rollout("c", None, status=Status.FAILED, error="ValueError: boom"),
        _rollout("d", None),
    ]
    batch = assemble(rollouts, PREFIX, _advantage("rollout"), agent_failures="drop")
    assert batch.rewards == {"a": 1.0, "b": 0.0}
    advantages = _by_rollout(batch)
    assert advantages["a"] == -advantages["b"] > 0
    with pytest.raises(ValueError, match="agent_failures"):
        assemble(rollouts, PREFIX, _advantage("rollout"), agent_failures="ignore")


@pytest.mark.parametrize("level", ["rollout", "sample"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_lone_survivor_gets_no_advantage_at_either_level(level: str, estimator: str) -> None:
    """Before: mean 0 / std 1 gave the survivor its raw reward (+1) at rollout level, and 0
    at sample level once it split — the two levels disagreed."""
    # The survivor's second prompt does not continue its first call: two samples.
    split = [ModelCall([1, 2], [5, 3], [-0.5, -0.1]), ModelCall([7, 8], [6], [-0.3])]
    survivor = FinishedRollout("s", "g", "train", Status.SUCCEEDED, 1.0, split)
    infra = _rollout("x", None, status=Status.FAILED, error="no live worker to run it")
    batch = assemble([survivor, infra], PREFIX, _advantage(level, estimator))
    assert len(batch.samples) == 2
    assert batch.advantages == [0.0, 0.0]
    assert batch.metrics["groups/no_signal"] == 1


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=5), min_size=1, max_size=4
    ),
    shift=st.floats(-3, 3),
    level=st.sampled_from(["rollout", "sample"]),
    estimator=st.sampled_from(["grpo", "rloo"]),
)
def test_advantages_are_invariant_to_a_constant_reward_shift(
    groups: list[list[float]], shift: float, level: str, estimator: str
) -> None:
    def batch(offset: float):
        rollouts = [
            _rollout(f"{g}.{i}", r + offset, group=f"g{g}")
            for g, rewards in enumerate(groups)
            for i, r in enumerate(rewards)
        ]
        return assemble(rollouts, PREFIX, _advantage(level, estimator))

    plain, shifted = batch(0.0), batch(shift)
    assert shifted.advantages == pytest.approx(plain.advantages, abs=1e-6)
    silent = sum(len(set(g)) == 1 for g in groups)
    assert plain.metrics["groups/no_signal"] == silent


@settings(max_examples=50, deadline=None)
@given(
    versions=st.lists(st.integers(0, 5), min_size=1, max_size=5),
    current=st.integers(0, 6),
    limit=st.integers(0, 3),
    merge=st.sampled_from(["independent", "prefix", "tree"]),
)
def test_stale_calls_leave_the_loss_before_it_normalises(
    versions: list[int], current: int, limit: int, merge: str
) -> None:
    rollouts = [_rollout("a", 1.0, versions), _rollout("b", 0.0, versions)]
    batch = assemble(
        rollouts,
        MergeStrategy(get("merge", merge)),
        _advantage("rollout"),
        policy_version=current,
        max_staleness=limit,
    )
    stale = {i for i, v in enumerate(versions) if current - v > limit}
    fresh = [
        (action, call)
        for s in batch.samples
        for action, call in zip(s.action_mask, s.call_index, strict=True)
    ]
    # A stale call's tokens stay as context (later prompts hold them) but are no actions.
    assert all(not action for action, call in fresh if call in stale)
    assert all(action for action, call in fresh if call >= 0 and call not in stale)
    if len(stale) < len(versions):
        # Before: the stale tokens were scaled to 0 after token_mean normalised over them
        # too, so the surviving weights summed to less than 1.
        weights = get("loss", "token_mean")(batch.samples)
        assert math.fsum(w for row in weights for w in row) == pytest.approx(1.0)
    assert batch.metrics["staleness/dropped_calls"] == len(stale) / len(versions)
    assert batch.metrics["staleness/max"] == max(max(0, current - v) for v in versions)


def test_each_token_carries_the_sampling_of_its_call() -> None:
    hot, cold = Sampling(temperature=0.7, top_p=0.9), Sampling(top_k=5)
    calls = [*_calls([0], hot), *_calls([0], cold)]
    calls[1] = ModelCall(
        calls[0].prompt_ids + calls[0].response_ids + [4], [11, 3], [-0.2, -0.1], sampling=cold
    )
    rollout = FinishedRollout("a", "g", "train", Status.SUCCEEDED, 1.0, calls)
    (sample,) = assemble([rollout], PREFIX, _advantage("rollout")).samples
    expected = {-1: Sampling(), 0: hot, 1: cold}
    assert sample.sampling == [expected[c] for c in sample.call_index]


def test_task_metrics_are_averaged_over_the_rollouts_that_report_them() -> None:
    rollouts = [
        FinishedRollout("a", "g", "train", Status.SUCCEEDED, 1.0, [], metrics={"in_range": 1.0}),
        FinishedRollout("b", "g", "train", Status.SUCCEEDED, 0.0, [], metrics={"in_range": 0.5}),
        FinishedRollout("c", "g", "train", Status.SUCCEEDED, 0.0, []),
    ]
    assert assemble(rollouts, PREFIX, _advantage("rollout")).metrics["task/in_range"] == 0.75


def test_decode_reaches_only_strategies_that_take_it() -> None:
    decoded = []

    def decode(ids):
        decoded.append(ids)
        return "".join(chr(65 + i % 26) for i in ids)

    first = ModelCall([1, 2], [10, 3], [-0.5, -0.1])
    # The response came back retokenized: stitch must compare the texts.
    second = ModelCall([1, 2, 36, 3, 4], [11], [-0.2])
    rollouts = [FinishedRollout("a", "g", "train", Status.SUCCEEDED, 1.0, [first, second])]
    for name in ("independent", "prefix", "stitch", "tree"):
        assemble(rollouts, MergeStrategy(get("merge", name), decode=decode), _advantage("sample"))
    assert decoded  # stitch compared texts; the others ran without the keyword
