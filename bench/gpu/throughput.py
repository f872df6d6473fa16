"""Part 4: the built-in engine's tokens per second and KV memory at a few batch sizes
(0.5B shape, bf16, random weights).

Per batch size: a fresh engine (``max_batch_size`` = the batch), one short warm-up
generation, then ``batch`` requests of the same prompt length submitted together, each
``new_tokens`` long (``ignore_eos``). Reported: generated tokens per second (wall time,
prefill included), decode steps, the most rows decoded together, the KV slab the engine
holds at the end (``kv_slab_gib``, ``Engine.kv_cache_allocated``), the KV bytes the
sequences need at full length (``kv_needed_gib``: layers x 2 x batch x kv heads x head
dim x tokens), and the peak memory over the weights (``torch.cuda.max_memory_allocated``
minus what the model alone holds: the slab, the prefill's cache, logits, activations).
The last run is the largest batch again under ``kv_cache_gib`` set to hold about half its
rows: ``max_running`` and the peak show the budget at work.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

import torch

from agl.backends.inference.engine import Engine, SamplingParams
from bench.gpu import shapes
from bench.gpu.adapters import make_engine
from bench.gpu.record import GIB, Context, allocated_gib, free_memory, peak_gib

SHAPE = "0.5b"
BATCHES = (1, 8, 32, 128)  # the dry run's too (tiny shape, short sequences)


async def _generate(engine: Engine, prompts: list[list[int]], new_tokens: int) -> int:
    params = SamplingParams(new_tokens, temperature=1.0, ignore_eos=True)
    generations = [engine.submit(p, params) for p in prompts]
    return sum([len((await g.wait())[0].token_ids) for g in generations])


def _kv_needed_gib(model: torch.nn.Module, batch: int, tokens: int) -> float:
    """KV bytes of ``batch`` sequences of ``tokens`` tokens, in GiB (the model's dtype)."""
    config: Any = model.config
    dtype = next(model.parameters()).dtype
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return per_token * batch * tokens * torch.finfo(dtype).bits / 8 / GIB


def _measure(
    ctx: Context,
    model: torch.nn.Module,
    tok: Any,
    batch: int,
    lengths: tuple[int, int],
    kv_cache_gib: float | None,
) -> dict[str, Any]:
    prompt_tokens, new_tokens = lengths
    prompts = shapes.prompts(tok, batch, (prompt_tokens, prompt_tokens), seed=batch)
    weights_gib = allocated_gib(ctx.device)
    engine = make_engine(model, tok, max_batch_size=batch, kv_cache_gib=kv_cache_gib)
    try:
        asyncio.run(_generate(engine, prompts[:1], 2))  # kernels, allocator: not timed
        steps_before = engine.stats.decode_steps
        start = time.perf_counter()
        generated = asyncio.run(_generate(engine, prompts, new_tokens))
        wall = time.perf_counter() - start
        slab = engine.kv_cache_allocated
    finally:
        engine.close()
    peak = peak_gib(ctx.device)
    return {
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "kv_cache_gib": kv_cache_gib,
        "generated": generated,
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "decode_steps": engine.stats.decode_steps - steps_before,
        "max_running": engine.stats.max_running,
        "kv_slab_gib": slab / GIB,
        "kv_needed_gib": _kv_needed_gib(model, batch, prompt_tokens + new_tokens),
        "peak_gib": peak,
        "over_weights_gib": None if peak is None else round(peak - (weights_gib or 0.0), 3),
    }


def run(ctx: Context) -> None:
    dry = ctx.dry_run
    dtype_name = "fp32" if dry else "bf16"  # bf16 matmuls on a CPU are only slow
    dtype = shapes.DTYPES[dtype_name]
    lengths = (16, 8) if dry else (512, 256)
    tok = shapes.tokenizer()
    shape = shapes.shape_for(SHAPE, dry)
    model = shapes.build_model(shape, tok, dtype, ctx.device)
    free_memory(ctx.device)
    ctx.report.results |= {
        "shape": shape,
        "dtype": dtype_name,
        "weights_gib": allocated_gib(ctx.device),
    }
    # The last one: the largest batch under a budget that holds about half its rows at once.
    half = _kv_needed_gib(model, BATCHES[-1] // 2, sum(lengths) + 1)
    runs: list[tuple[str, int, float | None]] = [(f"batch_{b}", b, None) for b in BATCHES]
    runs.append((f"batch_{BATCHES[-1]}_kv_budget", BATCHES[-1], round(2.1 * half, 6)))
    for key, batch, budget in runs:
        if not ctx.budget.allows(15):
            ctx.report.skip(key, "out of budget")
            continue
        ctx.report.measure(key, partial(_measure, ctx, model, tok, batch, lengths, budget))
        free_memory(ctx.device)
