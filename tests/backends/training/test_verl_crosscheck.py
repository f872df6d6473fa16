"""Cross-checks of agl's loss weights, advantages, KL estimators and rollout correction
against verl 0.9.1 itself.

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

One deliberate deviation: agl gives a group of one advantage 0 under both estimators
(``agl/strategies/estimators.py``: no baseline, so no signal), where verl gives grpo's lone
member ``r / (1 + 1e-6)`` and rloo's ``r``. The tests state it where it shows.

- ``kl_penalty`` (``core_algos``): agl's ``agl/backends/training/penalties.kl_penalty``
  is the same function, every kind with and without the ``+`` (straight-through k2
  gradient) suffix: values and gradients.
- Rollout correction (``verl/trainer/ppo/rollout_corr_helper.py``): agl's list version
  (``agl/backends/training/correction.py``) gives the weights of
  ``compute_rollout_correction_weights`` (token and sequence TIS, IcePop) and the masks of
  ``compute_rollout_rejection_mask`` (every ``rollout_rs`` option, chained, with one or
  per-option thresholds).

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
    "GRPO/RLOO advantages need it: pip install -e '.[verl]' && pip install --no-deps verl==0.9.1",
)

import numpy as np
import torch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)

from agl.backends.training.correction import RS_OPTIONS, CorrectionConfig, correct
from agl.backends.training.penalties import KL_KINDS, kl_penalty
from agl.core.contracts.samples import Sample
from agl.strategies.registry import get

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


def _alone(samples: list[Sample]) -> np.ndarray:
    """Which samples are the only member of their group (agl: advantage 0, not verl's)."""
    sizes: dict[str, int] = {}
    for s in samples:
        sizes[s.group_id] = sizes.get(s.group_id, 0) + 1
    return np.array([sizes[s.group_id] == 1 for s in samples])


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@CHECKS
@given(groups=group_rewards, seed=st.integers(0, 2**32 - 1))
def test_rollout_advantage_equals_verl_at_one_sample_per_rollout(estimator, groups, seed):
    samples, rewards = _one_sample_per_rollout(groups, seed)
    ours = get("advantage", "rollout")(samples, rewards, estimator=estimator)
    assert len(ours) == len(samples)
    ref = _verl_advantages(samples, rewards, estimator)
    # the deviation: a group of one gets 0 from agl, its (scaled) reward from verl
    ref = np.where(_alone(samples), 0.0, ref)
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
    if len(samples) == 1:  # the deviation: agl gives a group of one no signal
        ref = np.zeros_like(ref)
    np.testing.assert_allclose(np.array(ours, dtype=np.float64), ref, rtol=TOL, atol=TOL)


# ----------------------------------------------------------------------------- KL estimators


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k + plus for k in KL_KINDS for plus in ("", "+")])
@CHECKS
@given(
    pairs=st.lists(st.tuples(st.floats(-30.0, 0.0), st.floats(-30.0, 0.0)), min_size=1, max_size=20)
)
def test_kl_penalty_equals_verl_values_and_gradients(kind, pairs):
    def run(fn):
        logp = torch.tensor([p for p, _ in pairs], dtype=torch.float64, requires_grad=True)
        ref = torch.tensor([r for _, r in pairs], dtype=torch.float64)
        value = fn(logp, ref, kind)
        (value * torch.linspace(0.5, 1.5, len(pairs), dtype=torch.float64)).sum().backward()
        return value.detach(), logp.grad

    ours, theirs = run(kl_penalty), run(core_algos.kl_penalty)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b), (kind, a, b)


# ----------------------------------------------------------------------------- rollout correction

# Log-ratios on a grid of 1/8 (and past verl's ±20 clamp), thresholds off it: a statistic
# never sits within rounding of a bound, where verl's float sums and its masked mean's
# 1e-8 in the denominator could tip a comparison that agl's exact sums do not.
grid_ratios = st.one_of(
    st.integers(-40, 40).map(lambda k: k / 8), st.sampled_from([-27.5, 23.0, 21.125])
)
# verl needs one valid token in the batch (its metrics divide by the count)
ratio_rows = st.lists(st.lists(grid_ratios, min_size=0, max_size=8), min_size=1, max_size=6).filter(
    lambda rows: any(rows)
)


def _verl_layout(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(B, W)`` log-ratios (garbage on padding) and the response mask."""
    width = max(1, *(len(r) for r in rows))
    ratio = torch.full((len(rows), width), 3.25, dtype=torch.float64)
    mask = torch.zeros((len(rows), width), dtype=torch.float64)
    for i, row in enumerate(rows):
        ratio[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
        mask[i, : len(row)] = 1.0
    return ratio, mask


@CHECKS
@given(
    rows=ratio_rows,
    level=st.sampled_from(["token", "sequence"]),
    threshold=st.sampled_from([2.0, 1.37, 5.5, "0.5_2.0", "0.83_1.21", "0.1_9.3"]),
)
def test_correction_weights_equal_verl(rows, level, threshold):
    ours = correct(rows, CorrectionConfig(rollout_is=level, rollout_is_threshold=threshold))
    ratio, mask = _verl_layout(rows)
    try:
        theirs, _ = compute_rollout_correction_weights(ratio, mask, level, threshold)
    except ZeroDivisionError:
        # verl's effective-sample-size metric divides by the weights' mean square: when
        # IcePop zeroes every weight verl fails; agl answers the zeros
        assert all(w == 0.0 for row in ours.weights for w in row)
        return
    for i, row in enumerate(ours.weights):
        np.testing.assert_allclose(row, theirs[i, : len(row)].numpy(), rtol=1e-12, atol=0)
        assert not theirs[i, len(row) :].any()  # verl zeroes the padding; agl has none
    assert all(all(k) for k in ours.keep)  # weights alone reject nothing


K1_THRESHOLDS = [1.2, 1.7, 3.0, 20.0, "0.6_1.4", "0.31_1.09"]
UPPER_THRESHOLDS = [0.3137, 1.0718, 7.7391, 0.0517, 0.8123, 4.0311]
SHARED_THRESHOLDS = [1.2, 1.7, 3.0, 20.0, 1.0718, 4.0311, 7.7391]


@st.composite
def rs_specs(draw):
    """One to three ``rollout_rs`` options with one shared or one per-option threshold."""
    options = draw(st.lists(st.sampled_from(RS_OPTIONS), min_size=1, max_size=3, unique=True))

    def threshold(option: str) -> float | str:
        return draw(st.sampled_from(K1_THRESHOLDS if option.endswith("k1") else UPPER_THRESHOLDS))

    if draw(st.booleans()):  # one number for all: a k1 ratio bound must be >= 1
        spec: float | str = draw(st.sampled_from(SHARED_THRESHOLDS))
    else:
        spec = ",".join(str(threshold(o)) for o in options)
    return ",".join(options), spec


@CHECKS
@given(rows=ratio_rows, spec=rs_specs())
def test_rejection_masks_equal_verl(rows, spec):
    options, threshold = spec
    ours = correct(rows, CorrectionConfig(rollout_rs=options, rollout_rs_threshold=threshold))
    ratio, mask = _verl_layout(rows)
    theirs, _ = compute_rollout_rejection_mask(ratio, mask, options, threshold)
    for i, keep in enumerate(ours.keep):
        assert keep == [bool(x) for x in theirs[i, : len(keep)]], (i, rows[i])
    assert all(w == 1.0 for row in ours.weights for w in row)  # no IS: weight 1


def test_rejection_example_by_hand():
    """token_k1 at 2 keeps ratios in [1/2, 2]; seq_mean_k3 rejects a whole sample."""
    rows = [[0.0, 0.75, -0.75], [2.0, 0.125]]
    config = CorrectionConfig(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="2.0,0.5")
    assert correct(rows, config).keep == [[True, False, False], [False, False]]
    ratio, mask = _verl_layout(rows)
    theirs, _ = compute_rollout_rejection_mask(ratio, mask, config.rollout_rs, "2.0,0.5")
    assert theirs[0, :3].tolist() == [1.0, 0.0, 0.0] and not theirs[1].any()
