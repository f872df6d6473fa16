"""Cross-checks of agl's loss weights and advantages against verl 0.9.1 itself.

verl's conventions (verl 0.9.1, ``verl/trainer/ppo/core_algos.py``), which agl follows:

- ``agg_loss(.., "token-mean")`` (local call: ``dp_size=1``, ``batch_num_tokens=None``):
  ``sum(loss * mask) / sum(mask)`` over the whole batch.
- ``agg_loss(.., "seq-mean-token-mean")``: each sequence's token mean
  ``sum_t(loss * mask) / (L_j + 1e-8)``, then the mean over the sequences with at least
  one loss token: a fully masked sequence is left out of N as well as of the sum (so N is
  the number of samples with action tokens, not of all samples passed).
- ``compute_grpo_outcome_advantage``: score = sum of the row's ``token_level_rewards``;
  per group ``(r - mean) / (std + epsilon)`` with ``epsilon = 1e-6`` added to the std
  (not under a square root) and ``torch.std``'s *unbiased* std (Bessel, n - 1). A group
  of one has mean 0 and std 1, so its advantage is ``r / (1 + 1e-6)``, not 0. A group
  whose rewards are all equal gets 0. ``norm_adv_by_std_in_grpo=False``: ``r - mean``.
- ``compute_rloo_outcome_advantage``: ``(r - mean) * n / (n - 1)``, i.e. r minus the
  mean of the *other* members. A group of one keeps its raw reward r (no baseline).
  (verl's ``rloo_vectorized`` gives 0 there instead; the registered "rloo" is this one.)
- Both broadcast the scalar over the response tokens (``adv * response_mask``).

The module is skipped where verl is not installed; verl is computed in float64 here so the
comparison is not limited by float32 rounding.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

# Before anything verl-only (numpy and torch come with verl, not with agl's test extras).
pytest.importorskip(
    "verl",
    reason="verl 0.9.1 is not installed: the cross-checks against verl's agg_loss and "
    "GRPO/RLOO advantages need it (pip install --no-deps verl==0.9.1 plus its import deps)",
)

import numpy as np
import torch
from verl.trainer.ppo import core_algos

from agl.core.registry import get
from agl.core.types import Sample

TOL = 1e-5
CHECKS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

finite = st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False)


# ----------------------------------------------------------------------------- helpers


def _sample(rng: random.Random, mask: list[int], rollout_id: str, group_id: str) -> Sample:
    tokens = [rng.randrange(1, 300) for _ in mask]
    logprobs = [-rng.random() * 5 if a else 0.0 for a in mask]
    return Sample(
        tokens=tokens,
        action_mask=list(mask),
        logprobs=logprobs,
        rollout_id=rollout_id,
        group_id=group_id,
    )


def _right_padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's (bs, response_length) layout: each row right-padded, mask 1 on real entries.

    The padding holds garbage on purpose: verl must ignore it through the mask.
    """
    width = max(1, *(len(r) for r in rows))
    mat = torch.full((len(rows), width), 123.0, dtype=torch.float64)
    mask = torch.zeros((len(rows), width), dtype=torch.float64)
    for i, row in enumerate(rows):
        if row:
            mat[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
            mask[i, : len(row)] = 1.0
    return mat, mask


def _check_weights_shape(samples: list[Sample], weights: list[list[float]]) -> None:
    assert len(weights) == len(samples)
    for s, w in zip(samples, weights, strict=True):
        assert len(w) == len(s.tokens)
        for a, x in zip(s.action_mask, w, strict=True):
            if not a:
                assert x == 0.0


def _ours_vs_verl(
    samples: list[Sample], token_losses: list[list[float]], ours: str, theirs: str
) -> tuple[float, float]:
    weights = get("loss", ours)(samples)
    _check_weights_shape(samples, weights)
    total = sum(
        w * x
        for ws, xs in zip(weights, token_losses, strict=True)
        for w, x in zip(ws, xs, strict=True)
    )
    action_rows = [
        [x for a, x in zip(s.action_mask, xs, strict=True) if a]
        for s, xs in zip(samples, token_losses, strict=True)
    ]
    loss_mat, loss_mask = _right_padded(action_rows)
    ref = core_algos.agg_loss(loss_mat=loss_mat, loss_mask=loss_mask, loss_agg_mode=theirs)
    return float(total), float(ref)


@st.composite
def loss_batches(draw, allow_no_action_samples: bool):
    """Samples with per-token losses; at least one action token over the batch."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 8))
    samples, losses = [], []
    for j in range(n):
        length = draw(st.integers(1, 12))
        mask = draw(st.lists(st.sampled_from([0, 1]), min_size=length, max_size=length))
        if not allow_no_action_samples and not any(mask):
            mask[draw(st.integers(0, length - 1))] = 1
        samples.append(_sample(rng, mask, rollout_id=f"r{j}", group_id=f"g{j % 3}"))
        losses.append(draw(st.lists(finite, min_size=length, max_size=length)))
    assume(any(s.num_actions for s in samples))
    return samples, losses


# ----------------------------------------------------------------------------- losses


@CHECKS
@given(loss_batches(allow_no_action_samples=True))
def test_token_mean_equals_verl_token_mean(batch):
    samples, losses = batch
    ours, ref = _ours_vs_verl(samples, losses, "token_mean", "token-mean")
    assert ours == pytest.approx(ref, rel=TOL, abs=TOL)


@CHECKS
@given(loss_batches(allow_no_action_samples=False))
def test_seq_mean_equals_verl_seq_mean_token_mean(batch):
    samples, losses = batch
    ours, ref = _ours_vs_verl(samples, losses, "seq_mean", "seq-mean-token-mean")
    assert ours == pytest.approx(ref, rel=TOL, abs=TOL)


@CHECKS
@given(loss_batches(allow_no_action_samples=True))
def test_seq_mean_leaves_out_samples_without_actions_like_verl(batch):
    """verl's N counts only the sequences with loss tokens; so must ours."""
    samples, losses = batch
    ours, ref = _ours_vs_verl(samples, losses, "seq_mean", "seq-mean-token-mean")
    assert ours == pytest.approx(ref, rel=TOL, abs=TOL)


def test_seq_mean_with_an_empty_sample_example():
    rng = random.Random(0)
    samples = [
        _sample(rng, [0, 1, 1], "a", "g"),
        _sample(rng, [0, 0], "b", "g"),  # no action token: not in N
        _sample(rng, [1, 0, 1, 1], "c", "g"),
    ]
    losses = [[9.0, 1.0, 3.0], [7.0, 7.0], [5.0, 9.0, 2.0, 2.0]]
    ours, ref = _ours_vs_verl(samples, losses, "seq_mean", "seq-mean-token-mean")
    assert ref == pytest.approx((2.0 + 3.0) / 2, rel=1e-7)
    assert ours == pytest.approx(ref, rel=TOL, abs=TOL)
    ours, ref = _ours_vs_verl(samples, losses, "token_mean", "token-mean")
    assert ref == pytest.approx((1.0 + 3.0 + 5.0 + 2.0 + 2.0) / 5, rel=1e-7)
    assert ours == pytest.approx(ref, rel=TOL, abs=TOL)


# ----------------------------------------------------------------------------- advantages


def _one_sample_per_rollout(
    group_rewards: list[list[float]], seed: int
) -> tuple[list[Sample], dict[str, float]]:
    """Groups interleaved in random order, one sample (with >= 1 action) per rollout."""
    rng = random.Random(seed)
    samples, rewards = [], {}
    for g, members in enumerate(group_rewards):
        for k, reward in enumerate(members):
            rollout_id = f"g{g}-r{k}"
            length = rng.randint(1, 10)
            mask = [rng.randint(0, 1) for _ in range(length)]
            mask[rng.randrange(length)] = 1
            samples.append(_sample(rng, mask, rollout_id=rollout_id, group_id=f"group-{g}"))
            rewards[rollout_id] = reward
    rng.shuffle(samples)
    return samples, rewards


def _verl_advantages(
    samples: list[Sample], rewards: dict[str, float], estimator: str
) -> np.ndarray:
    """verl on the same batch: reward on each row's last response token, index = group ids."""
    lengths = [s.num_actions for s in samples]
    width = max(lengths)
    token_level_rewards = torch.zeros((len(samples), width), dtype=torch.float64)
    response_mask = torch.zeros((len(samples), width), dtype=torch.float64)
    for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        response_mask[i, :n] = 1.0
        token_level_rewards[i, n - 1] = rewards[s.rollout_id]
    index = np.array([s.group_id for s in samples], dtype=object)
    fn = {
        "grpo": core_algos.compute_grpo_outcome_advantage,
        "rloo": core_algos.compute_rloo_outcome_advantage,
    }[estimator]
    adv, returns = fn(
        token_level_rewards=token_level_rewards, response_mask=response_mask, index=index
    )
    assert torch.equal(adv, returns)
    per_row = []
    for i, n in enumerate(lengths):
        row = adv[i, :n]
        assert torch.all(row == row[0])  # a scalar broadcast over the response
        assert torch.all(adv[i, n:] == 0)
        per_row.append(float(row[0]))
    return np.array(per_row)


group_rewards = st.lists(
    st.lists(
        # binary rewards, near-ties (a spread of 1e-4 tells where epsilon goes), anything
        st.one_of(st.sampled_from([0.0, 1.0, 1.0 + 1e-4, 1e-5]), finite),
        min_size=1,
        max_size=6,
    ),
    min_size=1,
    max_size=6,
)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@CHECKS
@given(groups=group_rewards, seed=st.integers(0, 2**32 - 1))
def test_rollout_advantage_equals_verl_at_one_sample_per_rollout(estimator, groups, seed):
    samples, rewards = _one_sample_per_rollout(groups, seed)
    ours = get("advantage", "rollout")(samples, rewards, estimator=estimator)
    assert len(ours) == len(samples)
    ref = _verl_advantages(samples, rewards, estimator)
    np.testing.assert_allclose(np.array(ours, dtype=np.float64), ref, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    ("estimator", "groups", "expected"),
    [
        # singleton groups: grpo uses mean 0, std 1 -> r / (1 + eps); rloo keeps r
        ("grpo", [[0.7]], [0.7 / (1 + 1e-6)]),
        ("rloo", [[0.7]], [0.7]),
        # all equal: 0 (0 / (0 + eps) for grpo)
        ("grpo", [[1.0, 1.0, 1.0]], [0.0, 0.0, 0.0]),
        ("rloo", [[1.0, 1.0, 1.0]], [0.0, 0.0, 0.0]),
        # unbiased std: [0, 1] has std 0.7071 (population std 0.5 would give +-1)
        ("grpo", [[0.0, 1.0]], [-0.5 / (0.5**0.5 + 1e-6), 0.5 / (0.5**0.5 + 1e-6)]),
        # eps added to the std, not under the root: [1, 1 + 1e-4] -> +-0.6970
        (
            "grpo",
            [[1.0, 1.0 + 1e-4]],
            [-0.5e-4 / (0.5**0.5 * 1e-4 + 1e-6), 0.5e-4 / (0.5**0.5 * 1e-4 + 1e-6)],
        ),
        # rloo: r minus the mean of the others
        ("rloo", [[1.0, 0.0, 0.0, 1.0]], [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]),
    ],
)
def test_rollout_advantage_conventions_examples(estimator, groups, expected):
    rewards = {f"r{k}": r for k, r in enumerate(groups[0])}
    rng = random.Random(1)
    samples = [_sample(rng, [0, 1, 1], rollout_id=rid, group_id="g") for rid in rewards]
    ref = _verl_advantages(samples, rewards, estimator)
    # verl as documented (its singleton std is a float32 1.0, hence rtol 1e-7, not 1e-9)
    np.testing.assert_allclose(ref, expected, rtol=1e-7, atol=1e-9)
    ours = get("advantage", "rollout")(samples, rewards, estimator=estimator)
    np.testing.assert_allclose(np.array(ours, dtype=np.float64), ref, rtol=TOL, atol=TOL)
