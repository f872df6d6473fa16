"""Batch assembly: failed rollouts leave their group, stale calls leave the loss."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agl.core.assemble import FinishedRollout, MergeStrategy, assemble
from agl.core.records import Status
from agl.core.registry import get
from agl.core.types import ModelCall


def _calls(versions: list[int]) -> list[ModelCall]:
    calls, prompt = [], [1, 2]
    for i, v in enumerate(versions):
        response = [10 + i, 3]
        calls.append(ModelCall(list(prompt), response, [-0.5, -0.1], policy_version=v))
        prompt = prompt + response + [4]
    return calls


def _rollout(rid: str, reward: float | None, versions=(0,), status=Status.SUCCEEDED):
    return FinishedRollout(rid, "g", "train", status, reward, _calls(list(versions)))


def _advantage(name: str):
    return lambda samples, rewards: get("advantage", name)(samples, rewards)


def test_failed_and_unrewarded_rollouts_leave_the_group() -> None:
    rollouts = [
        _rollout("a", 1.0),
        _rollout("b", 0.0),
        _rollout("c", None, status=Status.FAILED),
        _rollout("d", None),
    ]
    batch = assemble(rollouts, MergeStrategy(get("merge", "prefix")), _advantage("rollout"))
    assert {s.rollout_id for s in batch.samples} == {"a", "b"}
    assert batch.rewards == {"a": 1.0, "b": 0.0}
    assert batch.metrics["rollouts/failed"] == 1
    assert batch.metrics["rollouts/no_reward"] == 1
    assert batch.metrics["reward/mean"] == 0.5
    # The baseline is over a and b only: symmetric advantages.
    by_rollout = dict(zip((s.rollout_id for s in batch.samples), batch.advantages, strict=True))
    assert by_rollout["a"] == -by_rollout["b"] > 0


@settings(max_examples=50, deadline=None)
@given(
    versions=st.lists(st.integers(0, 5), min_size=1, max_size=5),
    current=st.integers(0, 6),
    limit=st.integers(0, 3),
    merge=st.sampled_from(["independent", "prefix", "tree"]),
)
def test_stale_calls_get_zero_scale_on_their_action_tokens_only(
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
    for sample, scale in zip(batch.samples, batch.token_scale, strict=True):
        for action, call, weight in zip(sample.action_mask, sample.call_index, scale, strict=True):
            assert weight == (0.0 if action and call in stale else 1.0)
    assert batch.metrics["staleness/dropped_calls"] == len(stale) / len(versions)
    assert batch.metrics["staleness/max"] == max(max(0, current - v) for v in versions)


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
