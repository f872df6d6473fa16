"""The engine on one accelerator: it runs where the model is at generation time (not
where it was when the engine was built), its KV cache stays within ``kv_cache_gib``
(requests beyond it wait, in order), and ``paused()`` frees the cache for the trainer,
generation afterwards unchanged. Every output is checked against a plain greedy loop."""

from __future__ import annotations

import asyncio
import copy
import random
from typing import Any

import pytest
import torch
from transformers.cache_utils import DynamicCache

from agl.backends.inference.engine import Engine, EngineError, SamplingParams
from agl.backends.inference.models import LoadedModel, load_model
from agl.backends.training.collocated import CollocatedPolicy
from agl.backends.training.torch import TorchBackend, TorchBackendConfig
from tests.helpers.torch_models import (
    make_model,
    one_thread,  # noqa: F401 - an autouse fixture
    random_batch,
    token_mean,
)

PROMPT_TOKENS = 12
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny", seed=0)


def greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """The greedy continuation, one full forward per token (no cache, no batch)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def prompts(count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(10, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def generate(engine: Engine, batch: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[Any]:
    """All prompts submitted at once (greedy, fixed length); their token ids."""

    async def run() -> list[Any]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        generations = [engine.submit(p, params) for p in batch]
        return [(await g.wait())[0].token_ids for g in generations]

    return asyncio.run(run())


def cell_bytes(model: torch.nn.Module) -> int:
    """KV bytes of one token of one row: keys and values of every layer, and a mask byte."""
    c: Any = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    size = next(model.parameters()).element_size()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * size + 1


def test_the_engine_runs_where_the_model_is_when_it_generates(tiny: LoadedModel) -> None:
    # As agl.train does: the engine is built first, the trainer moves the model later.
    # No second device here: the model starts on "meta" and is materialized on the CPU.
    reference = tiny.model
    model = copy.deepcopy(reference).to("meta")
    engine = Engine(model, tiny.tokenizer, max_batch_size=4, max_context=128, num_threads=1)
    try:
        model.to_empty(device="cpu")
        weights = dict(reference.named_parameters(remove_duplicate=False))
        weights |= dict(reference.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in [
                *model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False),
            ]:
                tensor.copy_(weights[name])
        batch = prompts(2, reference.config.vocab_size)
        assert generate(engine, batch) == [greedy(reference, p, MAX_TOKENS) for p in batch]
        assert engine.device == torch.device("cpu")
    finally:
        engine.close()


def test_the_kv_cache_stays_within_its_budget_and_requests_wait(tiny: LoadedModel) -> None:
    model = tiny.model
    longest = PROMPT_TOKENS + MAX_TOKENS
    # Room for exactly two rows at their longest (half the budget holds the running batch).
    budget = 2 * 2 * (longest + 1) * cell_bytes(model) + 100
    engine = Engine(
        model,
        tiny.tokenizer,
        max_batch_size=8,
        max_context=256,
        num_threads=1,
        kv_cache_gib=budget / 2**30,
    )
    held: list[int] = []

    def measure(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        # Every KV tensor alive at this forward: the slab, and a prefill's own cache.
        cache = kwargs.get("past_key_values")
        prefill = 0
        if isinstance(cache, DynamicCache) and cache is not engine._slab.cache:
            prefill = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        held.append(engine.kv_cache_allocated + prefill)

    hook = model.register_forward_hook(measure, with_kwargs=True)
    try:
        batch = prompts(5, model.config.vocab_size)
        expected = [greedy(model, p, MAX_TOKENS) for p in batch]
        assert generate(engine, batch) == expected
        assert engine.stats.max_running == 2  # the other three waited, none failed
        assert held and max(held) <= budget
        assert engine.kv_cache_allocated <= budget // 2

        with engine.paused():  # the trainer's step: the cache is the trainer's memory
            assert engine.kv_cache_allocated == 0
        assert generate(engine, batch[:2]) == expected[:2]  # a new cache, same tokens
        assert max(held) <= budget
    finally:
        hook.remove()
        engine.close()


def test_a_request_that_can_never_fit_fails_with_one_line(tiny: LoadedModel) -> None:
    budget = 2 * (PROMPT_TOKENS + MAX_TOKENS + 1) * cell_bytes(tiny.model)
    engine = Engine(
        tiny.model,
        tiny.tokenizer,
        max_batch_size=4,
        max_context=256,
        num_threads=1,
        kv_cache_gib=budget / 2**30,
    )
    try:
        batch = prompts(1, tiny.model.config.vocab_size)
        with pytest.raises(EngineError, match=r"needs .* GiB of KV cache.*kv_cache_gib is"):
            generate(engine, batch, max_tokens=MAX_TOKENS + 50)
        # One that fits still runs: the refusal left nothing behind.
        assert generate(engine, batch) == [greedy(tiny.model, batch[0], MAX_TOKENS)]
    finally:
        engine.close()


def test_a_budget_must_be_positive(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="kv_cache_gib must be positive"):
        Engine(tiny.model, tiny.tokenizer, kv_cache_gib=0)


def test_a_training_step_runs_without_the_cache_and_the_engine_serves_its_weights() -> None:
    # bf16, as on a GPU: the trainer steps fp32 masters and the engine serves them rounded.
    model = make_model(dtype=torch.bfloat16, seed=4)
    engine = Engine(
        model, None, max_batch_size=4, max_context=128, num_threads=1, kv_cache_gib=0.01
    )
    policy = CollocatedPolicy(TorchBackend(model, TorchBackendConfig(lr=1e-2)), engine.paused)
    during: list[int] = []
    try:
        batch = prompts(2, model.config.vocab_size)
        generate(engine, batch)
        assert engine.kv_cache_allocated > 0
        hook = model.register_forward_hook(lambda *_: during.append(engine.kv_cache_allocated))
        samples = random_batch(random.Random(1), rollouts=2)
        policy.train(samples, [1.0] * len(samples), token_mean)
        hook.remove()
        assert during and not any(during)  # every training forward ran with the cache freed
        assert generate(engine, batch) == [greedy(model, p, MAX_TOKENS) for p in batch]
    finally:
        engine.close()
