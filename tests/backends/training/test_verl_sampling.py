"""The verl backend trains exactly as ``TorchBackend`` under every sampling setting and
guard (issue 17): per-token sampling transforms, the entropy bonus, the KL to a frozen
reference, and the rollout correction (TIS, masked IS).

1. **Layout.** Per-token sampling and the step's targets (π_old, IS weights, reference
   logprobs) round-trip through verl rows and the ``DataProto`` (Hypothesis), and each
   column's transform lands on the packed row whose logits verl reads that column's
   logprob from.
2. **The transform in verl's engine.** :func:`score_rows` (what the engine applies where
   verl turns logits into logprobs) equals ``agl.backends.sampling.logprobs_under`` row
   by row, values and gradients; what cannot be exact is refused.
3. **Gradients equal.** ``VerlPolicy.train`` (verl's FSDP2 engine in-process) and
   ``TorchBackend.train`` on the same batch: the gradient each hands its optimizer, per
   mini-batch, equal to ~1e-6 of its scale, for temperature 0.7 mixed with 1.0 in one
   sample, top-p 0.9, top-k, entropy_coef > 0, kl_coef > 0 (k1, low_var_kl), rollout_is
   token and sequence, rollout_rs token_k1. ``lr = 0``, so every mini-batch is scored at
   the same weights and a difference cannot hide in AdamW's step.
4. The KL reference survives save/load.

Skipped where verl is not installed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("verl", reason="verl 0.9.1 is not installed: pip install --no-deps verl==0.9.1")
pytest.importorskip("peft", reason="verl's FSDP engine imports peft: pip install -e '.[verl]'")

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

import agl.strategies.loss  # noqa: F401  (registers the loss strategies)
from agl.backends.inference.models import load_model
from agl.backends.sampling import logprobs_under
from agl.backends.training.penalties import entropy_of
from agl.backends.training.torch import TorchBackend, TorchBackendConfig
from agl.backends.training.verl.config import VerlBackendConfig
from agl.backends.training.verl.dataproto import from_dataproto, mini_batch_rows, to_dataproto
from agl.backends.training.verl.layout import TokenTargets, join, split
from agl.backends.training.verl.policy import VerlPolicy
from agl.backends.training.verl.sampling import (
    SAMPLING_KEYS,
    _packed_sampling,
    sampled_model_outputs,
    score_rows,
)
from agl.core.contracts.samples import NO_TRANSFORM, Sample, Sampling
from agl.strategies.registry import get
from tests.helpers.verl_batches import (
    CLIP_HIGH,
    CLIP_LOW,
    HOT,
    NUCLEUS,
    PAD,
    SAMPLED,
    TOP_K,
    linear_samples,
    sampled_batch,
)

CHECKS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TRANSFORMS = [NO_TRANSFORM, HOT, NUCLEUS, TOP_K, Sampling(0.0), Sampling(1.3, 0.8, 7)]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- 1. layout


@st.composite
def sampled_samples(draw: st.DrawFn) -> Sample:
    s = draw(linear_samples())
    if draw(st.booleans()):
        return s
    per_token = draw(st.lists(st.sampled_from(TRANSFORMS), min_size=len(s), max_size=len(s)))
    return dataclasses.replace(s, sampling=per_token)


def _targets(data: st.DataObject, s: Sample) -> TokenTargets:
    def column() -> list[float]:
        return [data.draw(st.floats(-5, 0, width=32)) for _ in s.tokens]

    return TokenTargets(old_logprobs=column(), is_weights=column(), ref_logprobs=column())


@CHECKS
@given(st.lists(sampled_samples(), min_size=1, max_size=6), st.data())
def test_sampling_and_targets_round_trip_through_the_dataproto(
    samples: list[Sample], data: st.DataObject
) -> None:
    with_targets = data.draw(st.booleans())
    targets = [_targets(data, s) for s in samples] if with_targets else None
    weights = [[1.0 if a else 0.0 for a in s.action_mask] for s in samples]
    rows = mini_batch_rows(samples, [0.5] * len(samples), weights, targets)
    for s, row in zip(samples, rows, strict=True):
        p = len(row.prompt)
        scored = [NO_TRANSFORM] * len(s) if s.sampling is None else [t.scored for t in s.sampling]
        want = [
            t if a else NO_TRANSFORM for t, a in zip(scored[p:], s.action_mask[p:], strict=True)
        ]
        assert list(row.sampling or [NO_TRANSFORM] * len(row.response)) == want
        assert split(join(row), [0.0] * p + row.weights, row.advantage) == dataclasses.replace(
            row, old_logprobs=None, is_weights=None, ref_logprobs=None
        )
    # a batch whose π_old is its recorded logprobs comes back without π_old
    same = all(r.old_logprobs in (None, r.logprobs) for r in rows)
    want = [dataclasses.replace(r, old_logprobs=None) for r in rows] if same else rows
    assert from_dataproto(to_dataproto(rows, PAD)) == want


@CHECKS
@given(st.lists(sampled_samples(), min_size=1, max_size=5))
def test_each_columns_transform_sits_where_verl_reads_its_logprob(samples: list[Sample]) -> None:
    """Scatter each column's transform to the packed rows, then read the rows back with
    verl's own ``no_padding_2_padding``: every column gets its own transform back."""
    rows = mini_batch_rows(samples, [0.0] * len(samples), [[0.0] * len(s) for s in samples])
    rows = [dataclasses.replace(r, sampling=r.sampling or (HOT,) * len(r.response)) for r in rows]
    td = left_right_2_no_padding(to_dataproto(rows, PAD).to_tensordict())
    total = int(td["input_ids"].offsets()[-1])
    temperature, top_k, top_p = _packed_sampling(td, total)
    columns = torch.zeros_like(td["response_mask"], dtype=torch.bool)
    for i, row in enumerate(rows):
        columns[i, : len(row.response)] = True  # right padding reads nothing
    for packed, key in zip((temperature, top_k, top_p), SAMPLING_KEYS, strict=True):
        read = no_padding_2_padding(packed, td)
        # float64 columns come back rounded to float32, as the transform uses them
        assert torch.equal(read[columns], td[key][columns].to(read.dtype))


# ----------------------------------------------------------------------------- 2. the transform


def test_score_rows_equals_the_one_rule_values_and_gradients() -> None:
    torch.manual_seed(0)
    rows = [NO_TRANSFORM, HOT, NUCLEUS, TOP_K, Sampling(1.3, 0.8, 7), NO_TRANSFORM]
    base = torch.randn(len(rows), 50, dtype=torch.float64) * 3
    # labels inside each truncated support, so every row has a finite logprob
    with torch.no_grad():
        support = logprobs_under(base, rows).isfinite()
    labels = torch.stack([row.nonzero()[i % int(row.sum())][0] for i, row in enumerate(support)])

    def both(fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        logits = base.clone().requires_grad_(True)
        picked, entropy = fn(logits)
        (picked.sum() + 0.3 * entropy.sum()).backward()
        return picked.detach(), entropy.detach(), logits.grad

    def ours(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor([r.temperature for r in rows], dtype=torch.float32)
        k = torch.tensor([r.top_k for r in rows])
        p = torch.tensor([r.top_p for r in rows], dtype=torch.float32)
        picked, entropy = score_rows(logits, labels, t, k, p, entropy=True)
        assert entropy is not None
        return picked, entropy

    def rule(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = logprobs_under(logits, rows)
        return logprobs.gather(-1, labels[:, None]).squeeze(-1), entropy_of(logprobs)

    for got, want in zip(both(ours), both(rule), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("flags", "engine", "message"),
    [
        ({"use_fused_kernels": True}, {}, "use_fused_kernels"),
        ({}, {"use_ulysses_sp": True}, "Ulysses"),
        ({"distillation_use_topk": True}, {}, "distillation"),
    ],
)
def test_what_cannot_be_exact_is_refused(
    flags: dict[str, bool], engine: dict[str, bool], message: str
) -> None:
    td = TensorDict({}, batch_size=[])
    tu.assign_non_tensor(td, **flags)
    with pytest.raises(ValueError, match=message):
        sampled_model_outputs(SimpleNamespace(**engine), None, {}, td)


# ----------------------------------------------------------------------------- 3. gradients


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return load_model("tiny").model.eval()


Grads = list[dict[str, torch.Tensor]]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def torch_step(
    samples: list[Sample], advantages: list[float], loss: str, state: dict | None, **options: Any
) -> tuple[Grads, dict[str, float]]:
    """``TorchBackend.train`` from tiny's weights (``state`` loaded after the backend, and
    so its KL reference, was made): the gradient of each mini-batch before its step."""
    backend = TorchBackend(load_model("tiny").model, TorchBackendConfig(**options))
    if state is not None:
        backend.model.load_state_dict(state)
    grads: Grads = []
    step = backend._clip_and_step

    def spy() -> float:
        grads.append({n: _full(p.grad) for n, p in backend.model.named_parameters()})
        return step()

    backend._clip_and_step = spy  # type: ignore[method-assign]
    metrics = backend.train(samples, advantages, get("loss", loss))
    return grads, metrics


def verl_step(
    samples: list[Sample],
    advantages: list[float],
    loss: str,
    checkpoint: Path | None,
    work_dir: Path,
    **options: Any,
) -> tuple[Grads, dict[str, float]]:
    """``VerlPolicy.train`` from tiny's weights (``checkpoint`` loaded after the policy
    was made): the gradient verl's engine hands its optimizer, per mini-batch."""
    loaded = load_model("tiny")
    policy = VerlPolicy(
        loaded.model, VerlBackendConfig(**options), tokenizer=loaded.tokenizer, work_dir=work_dir
    )
    try:
        if checkpoint is not None:
            policy.load(checkpoint)
        engine = policy.worker.engine
        grads: Grads = []
        step = engine.optimizer_step

        def spy() -> Any:
            grads.append(
                {
                    n: _full(p.grad)
                    for n, p in engine.module.named_parameters()
                    if p.grad is not None
                }
            )
            return step()

        engine.optimizer_step = spy
        metrics = policy.train(samples, advantages, get("loss", loss))
        return grads, metrics
    finally:
        policy.close()


@pytest.fixture(scope="module")
def shifted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """tiny's weights moved a little (a policy some steps away from its reference): as a
    state dict, and as a verl checkpoint without a reference (so loading it keeps the
    loading policy's own)."""
    model = load_model("tiny").model
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=generator))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    folder = tmp_path_factory.mktemp("shifted")
    # lr 0 as the tests': a load restores the checkpoint's lr schedule too
    config = VerlBackendConfig(lr=0.0)
    policy = VerlPolicy(model, config, tokenizer=_TOKENIZER, work_dir=folder / "work")
    policy.save(folder)
    policy.close()
    return state, folder


_TOKENIZER = load_model("tiny").tokenizer
CASES: dict[str, tuple[list[Sampling], str, dict[str, Any]]] = {
    "temperature 0.7 and 1.0": ([NO_TRANSFORM, HOT], "token_mean", {}),
    "top_p 0.9": ([NUCLEUS], "seq_mean", {}),
    "top_k 20": ([TOP_K, HOT], "rollout_mean", {}),
    "entropy_coef": (SAMPLED, "token_mean", {"entropy_coef": 0.05}),
    "kl k1": (SAMPLED, "seq_mean", {"kl_coef": 0.2, "kl_type": "k1"}),
    "kl low_var_kl": (SAMPLED, "token_mean", {"kl_coef": 0.2, "kl_type": "low_var_kl"}),
    "rollout_is token": (
        SAMPLED,
        "token_mean",
        {"rollout_is": "token", "rollout_is_threshold": 1.02},
    ),
    "rollout_is sequence": (SAMPLED, "rollout_mean", {"rollout_is": "sequence"}),
    "rollout_rs token_k1": (
        SAMPLED,
        "token_mean",
        {"rollout_rs": "token_k1", "rollout_rs_threshold": 1.03, "entropy_coef": 0.01},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_verl_gradient_equals_torch_backend_gradient(
    case: str, tiny: torch.nn.Module, shifted: tuple[dict, Path], tmp_path: Path
) -> None:
    transforms, loss, extra = CASES[case]
    samples, advantages = sampled_batch(tiny, seed=3, transforms=transforms)
    if case.startswith("temperature"):  # both temperatures inside one sample
        assert any({t.temperature for t in s.sampling or []} >= {0.7, 1.0} for s in samples)
    options = {
        "lr": 0.0,  # every mini-batch at the same weights: gradients comparable one by one
        "clip_low": CLIP_LOW,
        "clip_high": CLIP_HIGH,
        "num_mini_batches": 2,
        "max_tokens_per_micro_batch": 40,
        **extra,
    }
    state, checkpoint = shifted if "kl_coef" in extra else (None, None)
    ref, ref_metrics = torch_step(samples, advantages, loss, state, **options)
    got, metrics = verl_step(samples, advantages, loss, checkpoint, tmp_path, **options)
    assert len(got) == len(ref) == 2
    worst, scale = 0.0, 0.0
    for g, r in zip(got, ref, strict=True):
        assert set(g) == set(r)
        worst = max(worst, max((g[n] - r[n]).abs().max().item() for n in r))
        scale = max(scale, max(r[n].abs().max().item() for n in r))
    print(f"{case}: max |grad diff| {worst:.2e} at scale {scale:.2e}")
    assert scale > 1e-4  # a real gradient, not two zeros
    assert worst <= 1e-8 + 1e-6 * scale, (case, worst, scale)
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5, abs=1e-8)
    for name in ("entropy", "kl_reference"):
        if name in metrics:
            assert metrics[name] == pytest.approx(ref_metrics[name], rel=1e-5, abs=1e-8)
    for name, value in ref_metrics.items():
        if name.startswith("correction/"):
            assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-8), name
    if "rollout_rs" in extra:  # the rejection took tokens out, not all of them
        assert 0 < ref_metrics["correction/rs_masked_fraction"] < 1


# ----------------------------------------------------------------------------- 4. checkpoints


def test_the_kl_reference_survives_save_and_load(
    tiny: torch.nn.Module, shifted: tuple[dict, Path], tmp_path: Path
) -> None:
    """A policy built on other weights that loads a checkpoint trains against the saved
    reference, not against the weights it was built on."""
    samples, _ = sampled_batch(tiny, seed=4, transforms=SAMPLED)
    config = VerlBackendConfig(lr=0.0, kl_coef=0.5, kl_type="k1")
    loaded = load_model("tiny")
    first = VerlPolicy(loaded.model, config, tokenizer=loaded.tokenizer, work_dir=tmp_path / "a")
    first.load(shifted[1])  # current weights shifted, reference = tiny
    want = first._logprobs(samples, 1, reference=True)
    first.save(tmp_path / "saved")
    first.close()
    other = load_model("tiny").model
    other.load_state_dict(shifted[0])
    second = VerlPolicy(other, config, tokenizer=loaded.tokenizer, work_dir=tmp_path / "b")
    try:
        assert second._logprobs(samples, 1, reference=True) != want  # built on other weights
        second.load(tmp_path / "saved")
        assert second._logprobs(samples, 1, reference=True) == want
    finally:
        second.close()
