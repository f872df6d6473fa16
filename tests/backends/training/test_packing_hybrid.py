"""Packing on models whose layers are not all full attention. A linear-attention layer
(Qwen3-Next's gated delta net) carries its state from one sample into the next through a
packed row, which the block-diagonal mask cannot stop; a sliding window is lost to the
explicit mask. For those the packed micro-batch runs one forward per sample: the logprobs
equal each sample alone, and tree samples (whose mask only attention applies) are refused."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from agl.backends.training.packing import pack, packable, packed_logprobs, selected_logits
from agl.backends.training.torch import TorchBackend, TorchBackendConfig
from agl.backends.training.tree import linear_parents, token_logprobs
from agl.core.contracts.samples import ModelCall
from agl.strategies.registry import get
from tests.helpers.torch_models import (
    VOCAB_SIZE,
    linear,
    make_model,
    one_thread,  # noqa: F401 - an autouse fixture
    random_batch,
    token_mean,
)

SMALL = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def hybrid(seed: int = 0) -> Qwen3NextForCausalLM:
    """A 2-layer Qwen3-Next: one gated-delta-net (linear attention) layer, one full."""
    config = Qwen3NextConfig(
        **SMALL,
        head_dim=8,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3NextForCausalLM(config).eval()


def alone(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(tokens)
    with torch.no_grad():
        return token_logprobs(model(input_ids=ids[None]).logits[0], ids, linear_parents(len(ids)))


def test_only_all_full_attention_models_pack() -> None:
    assert packable(make_model())  # Qwen2: layer_types, all full
    assert packable(LlamaForCausalLM(LlamaConfig(**SMALL)))  # no layer_types, no window
    assert not packable(hybrid())
    assert not packable(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=4)))


def test_a_hybrid_model_scores_a_packed_row_as_each_sample_alone() -> None:
    model = hybrid()
    samples = random_batch(random.Random(2), rollouts=4)
    with torch.no_grad():
        packed = packed_logprobs(model, samples)
        # What packing into one row would give: the samples after the first drift.
        selected = [list(range(1, len(s.tokens))) for s in samples]
        rows = pack(samples, selected, "cpu", torch.float32)
        one_row = model(
            input_ids=rows.input_ids,
            attention_mask=rows.attention_mask,
            position_ids=rows.position_ids,
            logits_to_keep=rows.rows,
        ).logits[0]
    exact = selected_logits(model, rows)
    assert (one_row - exact).abs().max() > 1e-4  # the leak this guards against
    for s, lp in zip(samples, packed, strict=True):
        torch.testing.assert_close(lp, alone(model, s.tokens), atol=1e-5, rtol=0)


def test_a_hybrid_model_refuses_tree_samples_in_one_line() -> None:
    calls = [ModelCall([9, 1, 2], [3, 4], [-1.0, -1.0]), ModelCall([9, 1, 6], [10], [-1.0])]
    (tree,) = get("merge", "tree")(calls, "t", "g")
    with pytest.raises(ValueError, match=r"tree samples need .* full attention, not") as error:
        packed_logprobs(hybrid(), [linear([1, 2], [3], "a"), tree])
    assert "\n" not in str(error.value)


def test_a_hybrid_model_trains_the_same_however_it_is_packed() -> None:
    samples = random_batch(random.Random(4), rollouts=3)
    after = []
    for cap in (4096, 1):  # all samples in one micro-batch, or one sample in each
        model = hybrid(seed=3)
        config = TorchBackendConfig(lr=1e-3, max_tokens_per_micro_batch=cap)
        TorchBackend(model, config).train(samples, [1.0] * len(samples), token_mean)
        after.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*after, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
