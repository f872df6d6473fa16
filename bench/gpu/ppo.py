"""Part 3: a PPO step of the torch backend (``TorchBackend.train``) on the 0.5B shape in
fp32 and bf16, and on the 1.5B shape in bf16 (random weights, synthetic samples).

Per case: the fraction of weights one step at lr 1e-6 changed (the ``changed_*`` keys;
bf16 weights without fp32 masters mostly cannot move by 1e-6: a bf16 ulp near 0.02 is
1.2e-4; ``0.5b-bf16-no-master`` shows it),
over the tensors the optimizer updates (``optimizer``: the masters once there are any) and
over the model's own parameters (``model``: what the engine serves); then the median of
the timed steps after that first one, their peak memory (``max_memory_allocated``, the
optimizer state included) and tokens per second.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any

import torch

from agl.backends.training.torch import TorchBackendConfig
from agl.strategies.loss.rollout_mean import rollout_mean
from bench.gpu import shapes
from bench.gpu.adapters import make_backend
from bench.gpu.record import Context, free_memory, peak_gib, synchronize

LR = 1e-6
# (case, shape, dtype, fp32 master weights): the keys stay these in the dry run, whose
# shape is tiny. bf16 without masters is the before, for comparison.
CASES = (
    ("0.5b-fp32", "0.5b", "fp32", True),
    ("0.5b-bf16", "0.5b", "bf16", True),
    ("0.5b-bf16-no-master", "0.5b", "bf16", False),
    ("1.5b-bf16", "1.5b", "bf16", True),
)


def _changed(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    moved = sum(int((a != b).sum()) for a, b in zip(before, after, strict=True))
    return moved / sum(t.numel() for t in before)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _case(ctx: Context, shape: str, dtype: torch.dtype, master: bool) -> dict[str, Any]:
    dry = ctx.dry_run
    tok = shapes.tokenizer()
    model = shapes.build_model(shape, tok, torch.float32, ctx.device)
    config = TorchBackendConfig(
        lr=LR,
        device=ctx.device,
        num_mini_batches=1,
        max_tokens_per_micro_batch=256 if dry else 4096,  # the backend default
    )
    backend = make_backend(model, dtype, config, fp32_master_weights=master)
    samples, advantages = shapes.synthetic_batch(
        backend.model,
        tok,
        samples=4 if dry else 16,
        prompt_tokens=32 if dry else 256,
        response_tokens=32 if dry else 768,
    )
    tokens = sum(len(s) for s in samples)
    masters = _optimizer_params(backend.optimizer)
    served = list(backend.model.parameters())
    before_masters = [p.detach().clone() for p in masters]
    before_served = [p.detach().clone() for p in served]
    first = backend.train(samples, advantages, rollout_mean)
    result: dict[str, Any] = {
        "shape": shape,
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in served),
        "optimizer_dtype": str(masters[0].dtype).removeprefix("torch."),
        "model_dtype": str(served[0].dtype).removeprefix("torch."),
        "samples": len(samples),
        "tokens": tokens,
        "changed_optimizer": _changed(before_masters, [p.detach() for p in masters]),
        "changed_model": _changed(before_served, [p.detach() for p in served]),
        "first_step_s": first["train_s"],
        "grad_norm": first["grad_norm"],
    }
    del before_masters, before_served
    free_memory(ctx.device)
    times = []
    for _ in range(1 if dry else 2):
        synchronize(ctx.device)
        start = time.perf_counter()
        backend.train(samples, advantages, rollout_mean)
        synchronize(ctx.device)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return result | {
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "peak_gib": peak_gib(ctx.device),
    }


def run(ctx: Context) -> None:
    """Each case in turn; one that fails (out of memory) says so and the next one runs."""
    for case, shape, dtype, master in CASES:
        if not ctx.budget.allows(20):
            ctx.report.skip(case, "out of budget")
            continue
        built = shapes.shape_for(shape, ctx.dry_run)
        ctx.report.measure(case, partial(_case, ctx, built, shapes.DTYPES[dtype], master))
        free_memory(ctx.device)
