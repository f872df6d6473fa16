"""The embedded PPO backend: exact packing, exact accumulation, the clip, and learning."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

from agl.backends.training.packing import packed_logprobs
from agl.backends.training.torch import TorchBackend, TorchBackendConfig
from agl.backends.training.tree import additive_mask, linear_parents, token_logprobs
from agl.core.contracts.samples import ModelCall, Sample, Sampling
from agl.strategies.dedup import dedup
from agl.strategies.registry import get
from tests.helpers.torch_models import (
    VOCAB_SIZE,
    linear,
    make_model,
    one_thread,  # noqa: F401 - an autouse fixture
    random_batch,
    token_mean,
)
from tests.helpers.toy_traces import traces

METRICS = {
    "loss",
    "entropy",
    "clip_fraction",
    "kl_behaviour",
    "kl_reference",
    "logprob_mismatch",
    "ratio_mean",
    "grad_norm",
    "tokens_computed",
    "tokens_trained",
    "micro_batches",
    "mini_batches",
    "train_s",
    "lr",
}


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request: pytest.FixtureRequest) -> Qwen2ForCausalLM:
    return make_model(request.param)


def alone(model: torch.nn.Module, sample: Sample) -> torch.Tensor:
    """Logprobs of a sample run on its own: plain causal, or its tree mask."""
    tokens = torch.tensor(sample.tokens)
    with torch.no_grad():
        if sample.parents is None:
            logits = model(input_ids=tokens[None]).logits[0]
            return token_logprobs(logits, tokens, linear_parents(len(tokens)))
        logits = model(
            input_ids=tokens[None],
            attention_mask=additive_mask(sample.parents),
            position_ids=torch.tensor(sample.position_ids)[None],
        ).logits[0]
        return token_logprobs(logits, tokens, sample.parents)


def unit_weights(samples: list[Sample]) -> list[list[float]]:
    """Weight 1 on every action token: dropping one token changes no other's weight."""
    return [[float(a) for a in s.action_mask] for s in samples]


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_params_close(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float, rtol: float = 0.0
) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(
            a[name], b[name], atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.fixture
def capture_grads() -> Iterator[Callable[[TorchBackend], list[dict[str, torch.Tensor]]]]:
    """Record the gradient each optimizer step sees (after clipping)."""

    def attach(backend: TorchBackend) -> list[dict[str, torch.Tensor]]:
        seen: list[dict[str, torch.Tensor]] = []
        step = backend.optimizer.step

        def recording_step(*args: object, **kwargs: object) -> object:
            seen.append(
                {
                    name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                    for name, p in backend.model.named_parameters()
                }
            )
            return step(*args, **kwargs)

        backend.optimizer.step = recording_step  # type: ignore[method-assign]
        return seen

    yield attach


def with_behaviour(
    model: torch.nn.Module, samples: list[Sample], noise: float, rng: random.Random
) -> list[Sample]:
    """Behaviour logprobs = the model's own, plus noise on action tokens."""
    with torch.no_grad():
        current = packed_logprobs(model, samples)
    out = []
    for s, lp in zip(samples, current, strict=True):
        values = [
            float(x) + rng.uniform(-noise, noise) if a else 0.0
            for x, a in zip(lp.tolist(), s.action_mask, strict=True)
        ]
        out.append(dataclasses.replace(s, logprobs=values))
    return out


# --- 1. packing is exact -------------------------------------------------------------------


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tree_calls=traces(max_calls=4),
    linear_calls=traces(max_calls=3),
    order=st.randoms(use_true_random=False),
)
def test_packed_logprobs_equal_each_sample_alone(
    model: Qwen2ForCausalLM,
    tree_calls: list[ModelCall],
    linear_calls: list[ModelCall],
    order: random.Random,
) -> None:
    (tree,) = get("merge", "tree")(dedup(tree_calls), "t", "g")
    samples = [tree, *get("merge", "independent")(dedup(linear_calls), "l", "g")]
    order.shuffle(samples)
    with torch.no_grad():
        packed = packed_logprobs(model, samples)
    for s, lp in zip(samples, packed, strict=True):
        torch.testing.assert_close(lp, alone(model, s), atol=1e-5, rtol=0)


def test_packing_works_for_llama() -> None:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(1)
    llama = LlamaForCausalLM(config).eval()
    calls = [ModelCall([9, 1, 2], [3, 4], [-1.0, -1.0]), ModelCall([9, 1, 6], [10], [-1.0])]
    (tree,) = get("merge", "tree")(calls, "t", "g")
    samples = [linear([5, 6, 7], [8, 9], "a"), tree, linear([1], [2, 3, 4], "b")]
    with torch.no_grad():
        packed = packed_logprobs(llama, samples)
    for s, lp in zip(samples, packed, strict=True):
        torch.testing.assert_close(lp, alone(llama, s), atol=1e-5, rtol=0)


# --- 2. gradient accumulation is exact -----------------------------------------------------


def _one_step_each(
    rollouts: int, seed: int, configs: list[TorchBackendConfig]
) -> tuple[dict[str, torch.Tensor], list[tuple[dict[str, torch.Tensor], dict[str, float]]]]:
    """One train() of the same random batch from the same float64 model under each config:
    the model's parameters before, and each config's parameters and metrics after.
    float64: Adam's first step is ~lr·sign(g), which amplifies float32 summation-order
    noise on tiny gradients; the properties under test are the arithmetic, not rounding."""
    base = make_model(dtype=torch.float64, seed=3)
    rng = random.Random(seed)
    samples = with_behaviour(base, random_batch(rng, rollouts=rollouts), noise=0.5, rng=rng)
    advantages = [rng.uniform(-1.0, 1.0) for _ in samples]
    results = []
    for config in configs:
        model = copy.deepcopy(base)
        metrics = TorchBackend(model, config).train(samples, advantages, token_mean)
        results.append((params_of(model), metrics))
    return params_of(base), results


@pytest.mark.parametrize("num_mini_batches", [1, 2])
def test_micro_batching_does_not_change_the_update(num_mini_batches: int) -> None:
    configs = [
        TorchBackendConfig(
            lr=1e-2,
            grad_clip=0.0,
            num_mini_batches=num_mini_batches,
            max_tokens_per_micro_batch=cap,
        )
        for cap in (4096, 12)
    ]
    before, [(one, one_metrics), (many, many_metrics)] = _one_step_each(6, 0, configs)
    assert one_metrics["micro_batches"] == num_mini_batches
    assert many_metrics["micro_batches"] > 2 * num_mini_batches
    assert_params_close(one, many, atol=1e-6)
    assert max((one[k] - before[k]).abs().max().item() for k in one) > 1e-3
    for key in ("loss", "kl_behaviour", "clip_fraction", "grad_norm", "tokens_trained"):
        assert one_metrics[key] == pytest.approx(many_metrics[key], abs=1e-9)


def test_a_step_with_fewer_rollouts_than_mini_batches_takes_one_update_each() -> None:
    """A rollout its agent failed before any call enters with no sample, so a small step can
    have fewer rollouts than ``num_mini_batches``: it trains as if it asked for that many."""
    configs = [TorchBackendConfig(lr=1e-2, num_mini_batches=asked) for asked in (3, 8)]
    _, [(exact, exact_metrics), (more, more_metrics)] = _one_step_each(3, 1, configs)
    assert exact_metrics["mini_batches"] == more_metrics["mini_batches"] == 3
    assert_params_close(exact, more, atol=1e-12)


# --- 3. the PPO clip -----------------------------------------------------------------------


def clip_case(model: torch.nn.Module) -> tuple[list[Sample], list[float]]:
    """Two samples of two action tokens each; the first token of each is clipped.

    A = +1: token 0 has ratio e^2 > 1.2 (clipped), token 1 ratio 1 (not).
    A = -1: token 0 has ratio e^-2 < 0.8 (clipped), token 1 ratio e^2 (not: for A < 0 a
    large ratio is never clipped, its loss keeps growing).
    """
    raw = [linear([1, 2, 3], [4, 5], "up"), linear([6, 7], [8, 9], "down")]
    with torch.no_grad():
        current = [lp.tolist() for lp in packed_logprobs(model, raw)]
    shifts = [[-2.0, 0.0], [2.0, -2.0]]
    samples = []
    for s, lp, shift in zip(raw, current, shifts, strict=True):
        n = len(s.tokens)
        behaviour = [0.0] * (n - 2) + [lp[n - 2] + shift[0], lp[n - 1] + shift[1]]
        samples.append(dataclasses.replace(s, logprobs=behaviour))
    return samples, [1.0, -1.0]


def test_clipped_tokens_contribute_no_gradient(
    capture_grads: Callable[[TorchBackend], list[dict[str, torch.Tensor]]],
) -> None:
    base = make_model(seed=5)
    samples, advantages = clip_case(base)
    config = TorchBackendConfig(lr=1e-3, grad_clip=0.0)

    def grads(keep: list[list[int]] | None) -> tuple[dict[str, torch.Tensor], dict]:
        backend = TorchBackend(copy.deepcopy(base), config)
        seen = capture_grads(backend)
        batch = (
            samples
            if keep is None
            else [
                dataclasses.replace(
                    s, action_mask=[a * k for a, k in zip(s.action_mask, row, strict=True)]
                )
                for s, row in zip(samples, keep, strict=True)
            ]
        )
        metrics = backend.train(batch, advantages, unit_weights)
        (grad,) = seen
        return grad, metrics

    every, metrics = grads(None)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["tokens_trained"] == 4
    # Dropping the clipped tokens changes nothing; dropping an unclipped one does.
    unclipped_only, dropped_metrics = grads([[1, 1, 1, 0, 1], [1, 1, 0, 1]])
    assert dropped_metrics["clip_fraction"] == 0.0
    assert dropped_metrics["tokens_trained"] == 2
    # Equal up to float32 summation order (the clipped rows are absent from the matmuls).
    assert_params_close(every, unclipped_only, atol=1e-6, rtol=1e-5)
    without_unclipped, _ = grads([[1, 1, 1, 1, 0], [1, 1, 1, 1]])
    assert max((every[k] - without_unclipped[k]).abs().max().item() for k in every) > 1e-1


def test_clip_metrics_against_a_hand_computation() -> None:
    base = make_model(seed=5)
    samples, advantages = clip_case(base)
    metrics = TorchBackend(base, TorchBackendConfig(lr=0.0)).train(
        samples, advantages, unit_weights
    )
    e = torch.exp(torch.tensor(2.0)).item()
    ratios = [e, 1.0, 1 / e, e]
    # Token losses: max(-A r, -A clip(r)): -1.2, -1, 0.8 (clipped), e; summed (unit weights).
    assert metrics["loss"] == pytest.approx(-1.2 - 1.0 + 0.8 + e, abs=1e-4)
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / 4, abs=1e-4)
    assert metrics["logprob_mismatch"] == pytest.approx((2 + 0 + 2 + 2) / 4, abs=1e-5)
    # KL(behaviour || current) with r = p_current / p_behaviour: (r - 1) - log r.
    k3 = [r - 1 - math.log(r) for r in ratios]
    assert metrics["kl_behaviour"] == pytest.approx(sum(k3) / 4, abs=1e-4)
    assert 0 < metrics["entropy"] <= torch.log(torch.tensor(float(VOCAB_SIZE))).item()


# --- 4. it learns --------------------------------------------------------------------------


def test_bandit_raises_the_probability_of_the_rewarded_token() -> None:
    model = make_model(seed=7)
    prompt, good, bad = [1, 2, 3], 10, 11
    backend = TorchBackend(model, TorchBackendConfig(lr=1e-2, num_mini_batches=2))

    def margin() -> float:
        with torch.no_grad():
            lp = packed_logprobs(model, [linear(prompt, [good], "a"), linear(prompt, [bad], "b")])
        return (lp[0][-1] - lp[1][-1]).item()

    start = margin()
    for step in range(30):
        raw = [linear(prompt, [good if i % 2 == 0 else bad], f"s{step}-{i}") for i in range(8)]
        with torch.no_grad():
            current = packed_logprobs(model, raw)
        samples = [
            dataclasses.replace(s, logprobs=[0.0] * len(prompt) + [lp[-1].item()])
            for s, lp in zip(raw, current, strict=True)
        ]
        metrics = backend.train(
            samples, [1.0 if i % 2 == 0 else -1.0 for i in range(8)], token_mean
        )
        assert metrics["logprob_mismatch"] < 1e-5  # behaviour = the current policy
        assert metrics["mini_batches"] == 2
    assert margin() > start + 2.0
    assert not model.training  # the engine's eval mode is restored


# --- 5. nothing to train -----------------------------------------------------------------


def test_a_batch_without_action_tokens_leaves_the_weights_alone() -> None:
    model = make_model(seed=2)
    rng = random.Random(1)
    samples = [
        dataclasses.replace(s, action_mask=[0] * len(s.tokens))
        for s in random_batch(rng, rollouts=3)
    ]
    before = params_of(model)
    backend = TorchBackend(model, TorchBackendConfig(lr=1e-1, weight_decay=0.1))
    metrics = backend.train(samples, [1.0] * len(samples), unit_weights)
    assert metrics["tokens_trained"] == 0
    assert metrics["tokens_computed"] == 0
    assert_params_close(before, params_of(model), atol=0.0)


# --- 6. checkpoints ------------------------------------------------------------------------


def test_state_dict_round_trip_reproduces_the_next_step() -> None:
    rng = random.Random(3)
    config = TorchBackendConfig(lr=1e-2, weight_decay=0.01)
    model = make_model(seed=8)
    backend = TorchBackend(model, config)
    first = random_batch(rng, rollouts=3)
    second = with_behaviour(model, random_batch(rng, rollouts=3), noise=0.3, rng=rng)
    backend.train(first, [1.0] * len(first), token_mean)
    state = backend.state_dict()
    metrics = backend.train(second, [0.5] * len(second), token_mean)
    expected = params_of(model)

    # A fresh backend on differently initialized weights, restored from the snapshot: the
    # snapshot must not have followed the second step (it is a copy).
    other = TorchBackend(make_model(seed=9), config)
    other.load_state_dict(state)
    again = other.train(second, [0.5] * len(second), token_mean)
    assert_params_close(expected, params_of(other.model), atol=0.0)
    assert again["loss"] == metrics["loss"]


# --- 7. bad input --------------------------------------------------------------------------


def test_bad_inputs_raise_value_errors() -> None:
    backend = TorchBackend(make_model(seed=0), TorchBackendConfig())
    sample = linear([1, 2], [3, 4], "r")
    with pytest.raises(ValueError, match="at least one sample"):
        backend.train([], [], token_mean)
    with pytest.raises(ValueError, match="one advantage per sample"):
        backend.train([sample], [1.0, 2.0], token_mean)
    with pytest.raises(ValueError, match="advantages must be finite"):
        backend.train([sample], [float("nan")], token_mean)
    with pytest.raises(ValueError, match="3 sampling for 4 tokens"):
        backend.train([dataclasses.replace(sample, sampling=[Sampling()] * 3)], [1.0], token_mean)
    with pytest.raises(ValueError, match="token ids must be in"):
        backend.train([linear([1], [VOCAB_SIZE], "r")], [1.0], token_mean)
    with pytest.raises(ValueError, match="3 logprobs for 4 tokens"):
        backend.train([dataclasses.replace(sample, logprobs=[0.0, 0.0, -1.0])], [1.0], token_mean)
    with pytest.raises(ValueError, match="weights for sample 0"):
        backend.train([sample], [1.0], lambda ss: [[1.0] for _ in ss])


# --- the step's shape ----------------------------------------------------------------------


def test_loss_is_called_once_per_mini_batch_on_whole_rollouts() -> None:
    model = make_model(seed=6)
    samples = random_batch(random.Random(4), rollouts=5)
    calls: list[list[Sample]] = []

    def recording(batch: list[Sample]) -> list[list[float]]:
        calls.append(batch)
        return token_mean(batch)

    backend = TorchBackend(model, TorchBackendConfig(num_mini_batches=2))
    model.train()
    metrics = backend.train(samples, [1.0] * len(samples), recording)
    assert model.training  # the caller's mode is restored, whichever it was
    assert set(metrics) == METRICS
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["mini_batches"] == 2 and len(calls) == 2
    assert sorted(id(s) for batch in calls for s in batch) == sorted(id(s) for s in samples)
    rollouts = [{s.rollout_id for s in batch} for batch in calls]
    assert not rollouts[0] & rollouts[1]
    assert metrics["tokens_computed"] == sum(len(s) for s in samples)
    assert metrics["tokens_trained"] == sum(s.num_actions for s in samples)
    assert all(p.grad is None for p in model.parameters())  # freed for the engine


def test_a_bf16_model_trains() -> None:
    model = make_model(dtype=torch.bfloat16, seed=1)
    samples = random_batch(random.Random(5), rollouts=3)
    before = params_of(model)
    metrics = TorchBackend(model, TorchBackendConfig()).train(
        samples, [1.0] * len(samples), token_mean
    )
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert any(not torch.equal(before[k], p) for k, p in params_of(model).items())
