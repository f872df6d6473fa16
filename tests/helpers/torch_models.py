"""A tiny random Qwen2 model and random linear samples for it, for tests of the torch
training backend; ``one_thread`` is an autouse module fixture (import it to use it)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from agl.core.contracts.samples import Sample
from agl.strategies.registry import get

VOCAB_SIZE = 64


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """These models are tiny: a second intra-op thread only adds spinning, and on a busy
    machine (other test processes) OpenMP spin-waits make the module ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(
    attn: str = "sdpa", dtype: torch.dtype = torch.float32, seed: int = 0
) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).eval()


def linear(
    prompt: list[int], response: list[int], rollout: str, logprobs: list[float] | None = None
) -> Sample:
    return Sample(
        tokens=prompt + response,
        action_mask=[0] * len(prompt) + [1] * len(response),
        logprobs=[0.0] * len(prompt) + (logprobs or [-1.0] * len(response)),
        rollout_id=rollout,
        group_id="g",
    )


def token_mean(samples: list[Sample]) -> list[list[float]]:
    return get("loss", "token_mean")(samples)


def random_batch(rng: random.Random, rollouts: int) -> list[Sample]:
    """Linear samples (a rollout may have several) with random tokens and lengths."""
    samples = []
    for r in range(rollouts):
        for _ in range(rng.randint(1, 2)):
            prompt = [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(1, 8))]
            response = [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(1, 8))]
            samples.append(linear(prompt, response, f"r{r}"))
    return samples
