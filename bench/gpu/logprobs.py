"""Part 1: the built-in engine's logprobs against a teacher-forced forward, fp32 and bf16.

The engine samples a batch of prompts of different lengths (left padding, rows finishing
at different steps, half of them admitted while the others decode); then every sampled
sequence is scored again, teacher-forced, two ways: a plain forward of the sequence alone
(``forward``) and the trainer's packed forward over all of them in one row
(``packed``, ``agl.backends.training.packing.packed_logprobs``). At temperature 1 all three
are ``log_softmax(logits)`` of the same tokens, so their differences are numerics only:
kernels, batch shapes, and in bf16 the rounding. Reported per dtype: max and mean absolute
difference over every sampled token.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

import torch

from agl.backends.inference.engine import Choice, Engine, SamplingParams
from agl.backends.training.packing import packed_logprobs
from agl.core.contracts.samples import Sample
from bench.gpu import shapes
from bench.gpu.adapters import make_engine
from bench.gpu.record import Context, free_memory

SHAPE = "0.5b"


async def _generate(
    engine: Engine, prompts: list[list[int]], max_tokens: list[int]
) -> list[Choice]:
    """Half the prompts first, the rest once the first half decodes (continuous batching)."""
    half = len(prompts) // 2
    first = [
        engine.submit(p, SamplingParams(m, temperature=1.0, seed=i, ignore_eos=True))
        for i, (p, m) in enumerate(zip(prompts[:half], max_tokens[:half], strict=True))
    ]
    while engine.stats.decode_steps < 2 and not any(g.finished for g in first):
        await asyncio.sleep(0.001)
    second = [
        engine.submit(p, SamplingParams(m, temperature=1.0, seed=half + i, ignore_eos=True))
        for i, (p, m) in enumerate(zip(prompts[half:], max_tokens[half:], strict=True))
    ]
    return [(await g.wait())[0] for g in first + second]


@torch.no_grad()
def _forward_logprobs(
    model: torch.nn.Module, prompt: list[int], response: list[int]
) -> list[float]:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + response], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0].tolist()


@torch.no_grad()
def _packed_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], choices: list[Choice]
) -> list[list[float]]:
    samples = [
        Sample(p + c.token_ids, [0] * len(p) + [1] * len(c.token_ids), [], f"r{i}", "g")
        for i, (p, c) in enumerate(zip(prompts, choices, strict=True))
    ]
    scored = packed_logprobs(model, samples)  # type: ignore[arg-type]
    return [s[len(p) :].float().tolist() for s, p in zip(scored, prompts, strict=True)]


def _differences(engine: list[list[float]], other: list[list[float]]) -> tuple[float, float]:
    diffs = [
        abs(a - b)
        for xs, ys in zip(engine, other, strict=True)
        for a, b in zip(xs, ys, strict=True)
    ]
    return max(diffs), sum(diffs) / len(diffs)


def _compare(
    ctx: Context,
    shape: str,
    dtype: torch.dtype,
    prompts: list[list[int]],
    max_tokens: list[int],
) -> dict[str, Any]:
    tok = shapes.tokenizer()
    model = shapes.build_model(shape, tok, dtype, ctx.device)
    engine = make_engine(model, tok, max_batch_size=len(prompts))
    try:
        choices = asyncio.run(_generate(engine, prompts, max_tokens))
    finally:
        engine.close()
    sampled = [c.logprobs for c in choices]
    forward = [
        _forward_logprobs(model, p, c.token_ids) for p, c in zip(prompts, choices, strict=True)
    ]
    packed = _packed_logprobs(model, prompts, choices)
    max_fwd, mean_fwd = _differences(sampled, forward)
    max_packed, mean_packed = _differences(sampled, packed)
    return {
        "sequences": len(prompts),
        "tokens": sum(len(c.token_ids) for c in choices),
        "max_abs_diff_forward": max_fwd,
        "mean_abs_diff_forward": mean_fwd,
        "max_abs_diff_packed": max_packed,
        "mean_abs_diff_packed": mean_packed,
        "max_running": engine.stats.max_running,
    }


def run(ctx: Context) -> None:
    shape = shapes.shape_for(SHAPE, ctx.dry_run)
    count, new = (4, 6) if ctx.dry_run else (16, 64)
    prompts = shapes.prompts(shapes.tokenizer(), count, (8, 40) if ctx.dry_run else (32, 512))
    max_tokens = [new + 3 * i for i in range(count)]
    ctx.report.results["shape"] = shape
    for name, dtype in shapes.DTYPES.items():
        if not ctx.budget.allows(10):
            ctx.report.skip(name, "out of budget")
            continue
        ctx.report.measure(name, partial(_compare, ctx, shape, dtype, prompts, max_tokens))
        free_memory(ctx.device)
