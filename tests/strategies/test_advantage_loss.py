"""Advantage and loss strategies: the paper's Figures 4 and 5, and their invariants."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from agl.core.contracts.samples import Sample
from agl.strategies.registry import KINDS, get, names
from agl.strategies.weights import push


def sample(rollout: str, actions: int, group: str = "g", context: int = 2) -> Sample:
    n = context + actions
    return Sample(
        tokens=list(range(n)),
        action_mask=[0] * context + [1] * actions,
        logprobs=[0.0] * n,
        rollout_id=rollout,
        group_id=group,
    )


# -- advantage -----------------------------------------------------------------------


def test_figure_4_rollout_vs_sample_baselines() -> None:
    """Rollout 1 (reward 1) split into three samples, rollout 2 (reward 0) into one."""
    samples = [sample("r1", 3), sample("r1", 3), sample("r1", 3), sample("r2", 3)]
    rewards = {"r1": 1.0, "r2": 0.0}
    rollout = get("advantage", "rollout")(samples, rewards, scale=False)
    per_sample = get("advantage", "sample")(samples, rewards, scale=False)
    assert rollout == pytest.approx([0.5, 0.5, 0.5, -0.5])  # baseline 1/2
    assert per_sample == pytest.approx([0.25, 0.25, 0.25, -0.75])  # baseline 3/4


@st.composite
def groups(draw: st.DrawFn) -> tuple[dict[str, float], dict[str, str]]:
    n_groups = draw(st.integers(1, 3))
    rewards, group_of = {}, {}
    for g in range(n_groups):
        for r in range(draw(st.integers(1, 5))):
            rid = f"g{g}r{r}"
            rewards[rid] = draw(st.sampled_from([0.0, 0.5, 1.0, -1.0]))
            group_of[rid] = f"g{g}"
    return rewards, group_of


def split(rng: random.Random, rewards: dict[str, float], group_of: dict[str, str]) -> list[Sample]:
    out = []
    for rid in rewards:
        out += [sample(rid, rng.randint(1, 9), group_of[rid]) for _ in range(rng.randint(1, 4))]
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@given(data=groups(), seed_a=st.integers(0, 10**6), seed_b=st.integers(0, 10**6))
def test_rollout_advantage_ignores_how_rollouts_split(
    estimator: str, data: tuple[dict[str, float], dict[str, str]], seed_a: int, seed_b: int
) -> None:
    rewards, group_of = data
    per_rollout = []
    for seed in (seed_a, seed_b):
        samples = split(random.Random(seed), rewards, group_of)
        values = get("advantage", "rollout")(samples, rewards, estimator=estimator)
        by_rollout: dict[str, set[float]] = {}
        for s, v in zip(samples, values, strict=True):
            by_rollout.setdefault(s.rollout_id, set()).add(round(v, 9))
        assert all(len(v) == 1 for v in by_rollout.values())  # broadcast within a rollout
        per_rollout.append(by_rollout)
    assert per_rollout[0] == per_rollout[1]


def test_sample_advantage_does_change_with_the_split() -> None:
    rewards = {"a": 1.0, "b": 0.0}
    one_each = get("advantage", "sample")([sample("a", 2), sample("b", 2)], rewards)
    a_split = get("advantage", "sample")([sample("a", 2), sample("a", 2), sample("b", 2)], rewards)
    assert one_each[0] != pytest.approx(a_split[0])


def test_estimators_on_a_known_group() -> None:
    samples = [sample(r, 1) for r in "abcd"]
    rewards = {"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0}
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    grpo = get("advantage", "rollout")(samples, rewards, estimator="grpo")
    assert grpo == pytest.approx([x / (std + 1e-6) for x in (0.5, -0.5, -0.5, 0.5)])
    rloo = get("advantage", "rollout")(samples, rewards, estimator="rloo")
    assert rloo == pytest.approx([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])
    with pytest.raises(ValueError, match="estimator"):
        get("advantage", "rollout")(samples, rewards, estimator="ppo")
    with pytest.raises(ValueError, match="no reward for rollout 'a'"):
        get("advantage", "sample")(samples, {})


# -- loss ----------------------------------------------------------------------------


def total(weights: list[list[float]], losses: list[list[float]]) -> float:
    return math.fsum(
        w * x for ws, xs in zip(weights, losses, strict=True) for w, x in zip(ws, xs, strict=True)
    )


def sum_losses(s: Sample, losses: list[float]) -> float:
    return math.fsum(x for x, a in zip(losses, s.action_mask, strict=True) if a)


def test_figure_5_exact_numbers() -> None:
    batch = [
        sample("A", 50),
        sample("A", 100),
        sample("B", 30),
        sample("B", 30),
        sample("B", 30),
        sample("C", 40),
    ]
    rng = random.Random(5)
    losses = [[rng.uniform(-1, 1) for _ in s.tokens] for s in batch]
    A1, A2, B1, B2, B3, C1 = (sum_losses(s, x) for s, x in zip(batch, losses, strict=True))
    expected = {
        "token_mean": (A1 + A2 + B1 + B2 + B3 + C1) / (50 + 100 + 30 + 30 + 30 + 40),
        "seq_mean": (A1 / 50 + A2 / 100 + B1 / 30 + B2 / 30 + B3 / 30 + C1 / 40) / 6,
        "rollout_mean": ((A1 + A2) / 150 + (B1 + B2 + B3) / 90 + C1 / 40) / 3,
    }
    for name, value in expected.items():
        assert total(get("loss", name)(batch), losses) == pytest.approx(value, rel=1e-12)
    # The per-token weights themselves, as the figure's denominators say.
    w = get("loss", "rollout_mean")(batch)
    assert w[0][-1] == pytest.approx(1 / (3 * 150)) and w[5][-1] == pytest.approx(1 / (3 * 40))
    assert w[0][0] == 0.0  # context tokens never weigh


@st.composite
def batches(draw: st.DrawFn) -> list[Sample]:
    n = draw(st.integers(1, 12))
    return [
        sample(
            f"r{draw(st.integers(0, 4))}", draw(st.integers(0, 20)), context=draw(st.integers(0, 3))
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("name", ["token_mean", "seq_mean", "rollout_mean"])
@given(batch=batches(), cuts=st.lists(st.integers(0, 12), max_size=5), seed=st.integers(0, 99))
def test_any_cut_into_micro_batches_gives_the_same_total(
    name: str, batch: list[Sample], cuts: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    losses = [[rng.uniform(-1, 1) for _ in s.tokens] for s in batch]
    weights = get("loss", name)(batch)  # once per mini-batch
    whole = total(weights, losses)
    order = list(range(len(batch)))
    rng.shuffle(order)  # ranks get samples in any order
    bounds = sorted({0, len(order), *(c for c in cuts if c <= len(order))})
    pieces = [order[a:b] for a, b in itertools.pairwise(bounds)]
    summed = math.fsum(total([weights[i] for i in p], [losses[i] for i in p]) for p in pieces)
    assert summed == pytest.approx(whole, abs=1e-12)
    if any(s.num_actions for s in batch):  # weights of a mean: they sum to 1
        assert math.fsum(map(math.fsum, weights)) == pytest.approx(1.0)


@given(batch=batches())
def test_rollout_mean_gives_each_rollout_one_rth(batch: list[Sample]) -> None:
    weights = get("loss", "rollout_mean")(batch)
    per_rollout: dict[str, float] = {}
    for s, w in zip(batch, weights, strict=True):
        per_rollout[s.rollout_id] = per_rollout.get(s.rollout_id, 0.0) + math.fsum(w)
    trained = [
        r for r, v in per_rollout.items() if any(s.num_actions for s in batch if s.rollout_id == r)
    ]
    for r, v in per_rollout.items():
        assert v == pytest.approx(1 / len(trained) if r in trained else 0.0)


def test_seq_mean_favours_rollouts_with_more_samples() -> None:
    batch = [sample("split", 10), sample("split", 10), sample("whole", 20)]
    weight = get("loss", "seq_mean")(batch)
    assert math.fsum(weight[0]) + math.fsum(weight[1]) == pytest.approx(2 * math.fsum(weight[2]))


# -- registry and config -------------------------------------------------------------


def test_every_strategy_has_a_yaml_of_its_name_and_back() -> None:
    conf = Path(__file__).resolve().parents[2] / "conf"
    for kind in KINDS:
        files = {p.stem: yaml.safe_load(p.read_text()) for p in (conf / kind).glob("*.yaml")}
        assert sorted(files) == names(kind), kind
        for name, options in files.items():
            assert options["name"] == name
            extra = {k: v for k, v in options.items() if k != "name"}
            get(kind, name)  # options are keyword arguments of the strategy
            if kind == "advantage":
                won, lost = get(kind, name)(
                    [sample("r", 1), sample("s", 1)], {"r": 1.0, "s": 0.0}, **extra
                )
                assert won == pytest.approx(-lost) and won > 0


# -- push: which way a batch's loss pushes --------------------------------------------


def test_push_by_hand() -> None:
    """A win of 1 sample (4 tokens) and a loss of 3 samples (4 tokens each), rollout-level
    advantages +0.5 / -0.5: token-mean weighs each token 1/16, so Σ w·A = (4 - 12) / 32."""
    samples = [sample("win", 4), *(sample("loss", 4) for _ in range(3))]
    advantages = [0.5, -0.5, -0.5, -0.5]
    pushed = push(get("loss", "token_mean")(samples), advantages)
    assert pushed["net_push"] == pytest.approx(-0.5)  # (4 - 12) / (4 + 12)
    assert pushed["negative_weight"] == pytest.approx(0.75)
    balanced = push(get("loss", "rollout_mean")(samples), advantages)
    assert balanced["net_push"] == pytest.approx(0.0, abs=1e-12)
    assert balanced["negative_weight"] == pytest.approx(0.5)


@given(groups(), st.integers(0, 2**32 - 1))
def test_rollout_advantage_and_rollout_mean_push_neither_way(
    drawn: tuple[dict[str, float], dict[str, str]], seed: int
) -> None:
    """Each rollout weighs the same and a group's rollout advantages sum to 0, however its
    rollouts are split: the net push is 0."""
    rewards, group_of = drawn
    samples = split(random.Random(seed), rewards, group_of)
    advantages = get("advantage", "rollout")(samples, rewards)
    pushed = push(get("loss", "rollout_mean")(samples), advantages)
    assert pushed["net_push"] == pytest.approx(0.0, abs=1e-9)
    assert -1.0 <= push(get("loss", "token_mean")(samples), advantages)["net_push"] <= 1.0


def test_push_refuses_rows_that_do_not_match() -> None:
    with pytest.raises(ValueError, match="2 weight rows for 1 advantages"):
        push([[1.0], [1.0]], [0.5])
    assert push([[0.0]], [0.0]) == {"net_push": 0.0, "negative_weight": 0.0}
