"""The torch backend's loss is exactly the formula, for every sampling setting and guard:
each sample run alone, its tokens scored under their own sampling transform, the PPO term
against the recorded (or, with a rollout correction, the trainer's own) logprobs, times
the IS weight, minus the entropy bonus, plus the KL to the frozen reference — gradients
compared with the backend's packed, micro-batched step."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import zlib

import pytest
import torch

from agl.backends.sampling import transformed_logprobs
from agl.backends.training.correction import CorrectionConfig, correct
from agl.backends.training.packing import packed_logprobs
from agl.backends.training.penalties import kl_penalty
from agl.backends.training.torch import TorchBackend, TorchBackendConfig
from agl.core.contracts.samples import NO_TRANSFORM, Sample, Sampling
from agl.strategies.registry import get
from tests.helpers.torch_models import VOCAB_SIZE, linear, make_model, one_thread  # noqa: F401

HOT = Sampling(temperature=0.7)
NUCLEUS = Sampling(temperature=0.7, top_p=0.9)
TOP_K = Sampling(top_k=5)


def sampled_batch(model: torch.nn.Module, rng: random.Random, noise: float) -> list[Sample]:
    """Samples whose action tokens come from calls with different sampling settings, the
    recorded logprob being the model's own under that setting, plus noise (a stand-in for
    a mismatched inference engine)."""
    settings = [NO_TRANSFORM, HOT, NUCLEUS, TOP_K]
    samples = []
    for r in range(4):
        prompt = [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(2, 6))]
        response = [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(3, 7))]
        s = linear(prompt, response, f"r{r}")
        per_token = [rng.choice(settings) if a else NO_TRANSFORM for a in s.action_mask]
        samples.append(dataclasses.replace(s, sampling=per_token))
    # A top-p/top-k token the model would not sample cannot be recorded: use the mode.
    samples = [_in_support(model, s) for s in samples]
    with torch.no_grad():
        own = packed_logprobs(model, samples)
    out = []
    for s, lp in zip(samples, own, strict=True):
        recorded = [
            float(x) + rng.uniform(-noise, noise) if a else 0.0
            for x, a in zip(lp.tolist(), s.action_mask, strict=True)
        ]
        out.append(dataclasses.replace(s, logprobs=recorded))
    return out


def _in_support(model: torch.nn.Module, sample: Sample) -> Sample:
    """Replace each action token outside its truncated support with the mode."""
    assert sample.sampling is not None
    tokens = list(sample.tokens)
    for i, (a, setting) in enumerate(zip(sample.action_mask, sample.sampling, strict=True)):
        if not a or not setting.truncates:
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens[:i]])).logits[0, -1:].float()
        lp = _transform(logits, [setting])[0]
        if not math.isfinite(lp[tokens[i]].item()):
            tokens[i] = int(lp.argmax())
    return dataclasses.replace(sample, tokens=tokens)


def _transform(logits: torch.Tensor, rows: list[Sampling]) -> torch.Tensor:
    scored = [r.scored for r in rows]
    return transformed_logprobs(
        logits,
        torch.tensor([r.temperature for r in scored]),
        torch.tensor([r.top_k for r in scored]),
        torch.tensor([r.top_p for r in scored]),
    )


def reference_loss(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    samples: list[Sample],
    advantages: list[float],
    config: TorchBackendConfig,
) -> torch.Tensor:
    """The whole step's loss written out, each sample alone, no packing."""
    correction = config.correction
    masks = [list(s.action_mask) for s in samples]
    old: list[list[float]] = [list(s.logprobs) for s in samples]
    is_weight = [[1.0] * len(s.tokens) for s in samples]
    if correction.enabled:
        with torch.no_grad():
            own = [_alone(model, s)[0] for s in samples]
        positions = [[i for i, a in enumerate(s.action_mask) if a] for s in samples]
        ratios = [
            [own[j][i].item() - samples[j].logprobs[i] for i in positions[j]]
            for j in range(len(samples))
        ]
        result = correct(ratios, correction)
        for j, pos in enumerate(positions):
            for k, i in enumerate(pos):
                old[j][i] = own[j][i].item()
                is_weight[j][i] = result.weights[j][k]
                masks[j][i] = int(result.keep[j][k])
    kept = [dataclasses.replace(s, action_mask=m) for s, m in zip(samples, masks, strict=True)]
    weights = get("loss", "token_mean")(kept)
    total = torch.zeros(())
    for j, s in enumerate(kept):
        logp, entropy = _alone(model, s)
        with torch.no_grad():
            ref, _ = _alone(reference, s)
        for i, a in enumerate(s.action_mask):
            if not a or i == 0:
                continue
            ratio = torch.exp(logp[i] - old[j][i])
            adv = advantages[j]
            ppo = torch.maximum(
                -adv * ratio,
                -adv * ratio.clamp(1 - config.clip_low, 1 + config.clip_high),
            )
            term = is_weight[j][i] * ppo - config.entropy_coef * entropy[i]
            if config.kl_coef:
                term = term + config.kl_coef * kl_penalty(logp[i], ref[i], config.kl_type)
            total = total + weights[j][i] * term
    return total


def _alone(model: torch.nn.Module, s: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: its logprob and the entropy of the distribution it was drawn from, each
    under the token's own transform (position 0 has no parent: zeros)."""
    logits = model(input_ids=torch.tensor([s.tokens])).logits[0].float()
    rows = [s.sampling[i] if s.sampling else NO_TRANSFORM for i in range(1, len(s.tokens))]
    lp = _transform(logits[:-1], rows)
    picked = lp.gather(1, torch.tensor(s.tokens[1:])[:, None]).squeeze(1)
    p = lp.exp()
    entropy = -(p * lp.masked_fill(torch.isinf(lp), 0.0)).sum(-1)
    zero = torch.zeros(1)
    return torch.cat([zero, picked]), torch.cat([zero, entropy])


CASES = {
    "sampling only": {},
    "entropy bonus": {"entropy_coef": 0.05},
    "kl k1": {"kl_coef": 0.3, "kl_type": "k1"},
    "kl low_var_kl": {"kl_coef": 0.3, "kl_type": "low_var_kl"},
    "tis token": {"rollout_is": "token", "rollout_is_threshold": 1.1},
    "tis sequence": {"rollout_is": "sequence", "rollout_is_threshold": 1.5},
    "masked token_k1": {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.95_1.05"},
    "everything": {
        "entropy_coef": 0.02,
        "kl_coef": 0.1,
        "rollout_is": "token",
        "rollout_is_threshold": 1.2,
        "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.002,
    },
}


@pytest.mark.parametrize("case", CASES)
def test_the_backend_step_is_the_formula(case: str) -> None:
    # A stable seed: str hashes change from one process to the next (PYTHONHASHSEED).
    rng = random.Random(zlib.crc32(case.encode()))
    model = make_model(seed=11)
    config = TorchBackendConfig(
        lr=1e-2, grad_clip=0.0, max_tokens_per_micro_batch=24, **CASES[case]
    )
    reference = copy.deepcopy(model)
    if config.kl_coef:
        # A KL needs the policy to have moved from its reference: one step first.
        TorchBackend(model, TorchBackendConfig(lr=5e-2)).train(
            sampled_batch(model, rng, 0.0), [1.0, -1.0, 0.5, -0.5], get("loss", "token_mean")
        )
    samples = sampled_batch(model, rng, noise=0.1)
    advantages = [1.0, -0.5, 0.8, -1.0]

    expected_model = copy.deepcopy(model)
    expected_model.train()
    reference_loss(expected_model, reference, samples, advantages, config).backward()
    expected = {n: p.grad.clone() for n, p in expected_model.named_parameters()}

    backend = TorchBackend(model, config)
    backend.reference = copy.deepcopy(reference) if config.kl_coef else None
    if backend.reference is not None:
        backend.reference.requires_grad_(False)
    seen: list[dict[str, torch.Tensor]] = []
    step = backend.optimizer.step

    def recording(*args: object, **kwargs: object) -> object:
        seen.append({n: p.grad.clone() for n, p in backend.model.named_parameters()})
        return step(*args, **kwargs)

    backend.optimizer.step = recording  # type: ignore[method-assign]
    metrics = backend.train(samples, advantages, get("loss", "token_mean"))
    (got,) = seen
    largest = max(v.abs().max().item() for v in expected.values())
    assert largest > 1e-4  # a gradient to compare
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-4)
    if config.kl_coef:
        assert metrics["kl_reference"] > 0
    if config.correction.rollout_rs:
        assert "correction/rs_masked_fraction" in metrics


def test_an_unchanged_policy_scores_ratio_one_under_its_sampling() -> None:
    """The recorded logprobs are the model's own under each token's transform: at the
    first step every ratio is 1. Scored at T = 1 instead (the bug this fixes), the same
    batch is off by far more than the tolerance."""
    model = make_model(seed=3)
    samples = sampled_batch(model, random.Random(0), noise=0.0)
    lr0 = TorchBackendConfig(lr=0.0)
    metrics = TorchBackend(model, lr0).train(samples, [1.0] * 4, get("loss", "token_mean"))
    assert metrics["logprob_mismatch"] < 1e-5
    assert metrics["clip_fraction"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    untransformed = [dataclasses.replace(s, sampling=None) for s in samples]
    wrong = TorchBackend(model, lr0).train(untransformed, [1.0] * 4, get("loss", "token_mean"))
    assert wrong["logprob_mismatch"] > 1e-2


def test_rejected_tokens_leave_the_normaliser() -> None:
    """Masked IS takes tokens out before token_mean divides: the kept tokens' weights
    still sum to 1 (scaling them after would have shrunk the step)."""
    model = make_model(seed=4)
    samples = sampled_batch(model, random.Random(1), noise=0.5)
    config = CorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")
    with torch.no_grad():
        own = packed_logprobs(model, samples)
    ratios = [
        [own[j][i].item() - s.logprobs[i] for i, a in enumerate(s.action_mask) if a]
        for j, s in enumerate(samples)
    ]
    result = correct(ratios, config)
    assert 0 < result.metrics["correction/rs_masked_fraction"] < 1
    backend = TorchBackend(
        model, TorchBackendConfig(lr=0.0, rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")
    )
    seen: list[list[Sample]] = []

    def loss(batch: list[Sample]) -> list[list[float]]:
        seen.append(batch)
        return get("loss", "token_mean")(batch)

    backend.train(samples, [1.0] * 4, loss)
    (batch,) = seen
    kept = sum(k for row in result.keep for k in row)
    assert sum(s.num_actions for s in batch) == kept
    assert math.fsum(w for row in loss(batch) for w in row) == pytest.approx(1.0)
