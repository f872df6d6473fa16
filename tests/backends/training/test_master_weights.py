"""A bf16 model trains through fp32 master weights: at lr 1e-6 the optimizer's update
survives (as many weights move as in fp32, in the same directions), the model the engine
serves is the masters rounded to bf16 after every step, and checkpoints keep the masters."""

from __future__ import annotations

import random

import torch

from agl.backends.training.torch import TorchBackend, TorchBackendConfig
from tests.helpers.torch_models import (
    make_model,
    one_thread,  # noqa: F401 - an autouse fixture
    random_batch,
    token_mean,
)

LR = 1e-6


def changed(before: list[torch.Tensor], after: list[torch.Tensor]) -> torch.Tensor:
    """Per weight (flattened over all tensors): did it move."""
    return torch.cat(
        [(a.float() != b.float()).flatten() for b, a in zip(before, after, strict=True)]
    )


def step(dtype: torch.dtype, masters: bool = True) -> tuple[TorchBackend, list[torch.Tensor]]:
    """One step at LR on a fresh model; the backend and the weights it started from."""
    model = make_model(dtype=dtype, seed=1)
    before = [p.detach().float().clone() for p in model.parameters()]
    backend = TorchBackend(model, TorchBackendConfig(lr=LR, fp32_master_weights=masters))
    samples = random_batch(random.Random(5), rollouts=4)
    backend.train(samples, [1.0] * len(samples), token_mean)
    return backend, before


def test_a_bf16_step_at_a_small_lr_moves_the_masters_as_fp32_moves_its_weights() -> None:
    fp32, fp32_before = step(torch.float32)
    bf16, bf16_before = step(torch.bfloat16)
    assert fp32.master is None and bf16.master is not None
    moved_fp32 = changed(fp32_before, list(fp32.model.parameters()))
    moved_masters = changed(bf16_before, bf16.master.params)
    assert moved_fp32.float().mean() > 0.9
    assert moved_masters.float().mean() >= 0.97 * moved_fp32.float().mean()
    # The same update, to bf16's precision: AdamW's first step is ~lr·sign(gradient).
    delta_fp32 = torch.cat(
        [
            (a.float() - b).flatten()
            for b, a in zip(fp32_before, fp32.model.parameters(), strict=True)
        ]
    )
    delta_bf16 = torch.cat(
        [(a - b).flatten() for b, a in zip(bf16_before, bf16.master.params, strict=True)]
    )
    both = moved_fp32 & moved_masters
    agree = (delta_fp32[both].sign() == delta_bf16[both].sign()).float().mean()
    assert agree > 0.95
    size_fp32, size_bf16 = delta_fp32[both].abs().mean(), delta_bf16[both].abs().mean()
    torch.testing.assert_close(size_bf16, size_fp32, rtol=0.05, atol=0.0)
    # The engine serves the masters, rounded.
    for p, master in zip(bf16.model.parameters(), bf16.master.params, strict=True):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, master.to(torch.bfloat16))
        assert p.grad is None and master.grad is None  # freed for the engine


def test_without_masters_a_small_lr_update_mostly_rounds_away() -> None:
    # What the masters are for (the step above, stepping the bf16 weights themselves).
    backend, before = step(torch.bfloat16, masters=False)
    assert backend.master is None
    assert changed(before, list(backend.model.parameters())).float().mean() < 0.2


def test_the_bf16_loss_and_gradient_norm_match_fp32() -> None:
    samples = random_batch(random.Random(6), rollouts=3)
    metrics = {}
    for dtype in (torch.float32, torch.bfloat16):
        backend = TorchBackend(make_model(dtype=dtype, seed=2), TorchBackendConfig(lr=LR))
        metrics[dtype] = backend.train(samples, [1.0] * len(samples), token_mean)
    fp32, bf16 = metrics[torch.float32], metrics[torch.bfloat16]
    assert abs(bf16["loss"] - fp32["loss"]) <= 0.02 * abs(fp32["loss"])
    assert abs(bf16["grad_norm"] - fp32["grad_norm"]) <= 0.05 * fp32["grad_norm"]


def test_checkpoints_save_and_restore_the_masters() -> None:
    rng = random.Random(3)
    config = TorchBackendConfig(lr=1e-3, weight_decay=0.01)
    backend = TorchBackend(make_model(dtype=torch.bfloat16, seed=8), config)
    first, second = random_batch(rng, rollouts=3), random_batch(rng, rollouts=3)
    backend.train(first, [1.0] * len(first), token_mean)
    state = backend.state_dict()
    assert backend.master is not None
    assert all(t.dtype == torch.float32 for t in state["master"].values())
    backend.train(second, [0.5] * len(second), token_mean)

    # Restored into a differently initialized model, the next step is the same to the bit:
    # the masters carry what bf16 rounded off.
    other = TorchBackend(make_model(dtype=torch.bfloat16, seed=9), config)
    other.load_state_dict(state)
    other.train(second, [0.5] * len(second), token_mean)
    assert other.master is not None
    for a, b in zip(backend.master.params, other.master.params, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(backend.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)

    # A checkpoint without masters (saved with them off) starts them from its weights.
    del state["master"]
    other.load_state_dict(state)
    for p, master in zip(other.model.parameters(), other.master.params, strict=True):
        assert torch.equal(master, p.float())
