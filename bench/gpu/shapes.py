"""The models ``bench/gpu_check.py`` runs: Qwen2.5 shapes with random weights (configs
only, nothing downloaded), the repository's tiny byte-level tokenizer, and synthetic
prompts and training samples over it.

The 0.5B and 1.5B shapes are Qwen2.5-0.5B's and Qwen2.5-1.5B's ``config.json`` (GQA, tied
embeddings, full attention everywhere); their 151,936-token vocabulary is kept, so the
logits, the embedding and the weight sizes are the real ones, while every token id used
comes from the tiny tokenizer (1,536 ids, all valid rows of the bigger embedding).
``tiny`` is what the dry run builds in place of both.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

from agl.backends.inference.models import load_model
from agl.backends.training.packing import packed_logprobs
from agl.core.contracts.samples import Sample

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

_QWEN25 = {
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": _QWEN25
    | {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
    "1.5b": _QWEN25
    | {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
    # The dry run's stand-in for both: every code path, a few hundred thousand weights.
    "tiny": {
        "vocab_size": 1536,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}


def shape_for(name: str, dry_run: bool) -> str:
    """The shape a part builds for ``name``: itself, or ``tiny`` in the dry run."""
    return "tiny" if dry_run else name


def tokenizer() -> transformers.PreTrainedTokenizerBase:
    """The repository's tiny byte-level BPE (1,536 ids), with agl's eos and pad."""
    return load_model("tiny").tokenizer


def config(shape: str, tok: transformers.PreTrainedTokenizerBase) -> Qwen2Config:
    return Qwen2Config(
        **SHAPES[shape],
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def build_model(
    shape: str,
    tok: transformers.PreTrainedTokenizerBase,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A random-init model of ``shape``, initialized on ``device`` (a 1.5B init on the CPU
    takes longer than its whole measurement on the GPU), in eval mode."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config(shape, tok))
    # (transformers types PreTrainedModel.to through a decorator that loses its signature)
    return model.to(dtype).eval()  # type: ignore[arg-type]


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def plain_ids(tok: transformers.PreTrainedTokenizerBase) -> list[int]:
    """Token ids that are not special (no eos inside a synthetic sequence)."""
    specials = set(tok.all_special_ids)
    return [t for t in range(len(tok)) if t not in specials]


def prompts(
    tok: transformers.PreTrainedTokenizerBase, count: int, lengths: tuple[int, int], seed: int = 0
) -> list[list[int]]:
    """``count`` random prompts with lengths spread over ``lengths`` (inclusive)."""
    rng = random.Random(seed)
    vocab = plain_ids(tok)
    low, high = lengths
    return [rng.choices(vocab, k=rng.randint(low, high)) for _ in range(count)]


def synthetic_batch(
    model: torch.nn.Module,
    tok: transformers.PreTrainedTokenizerBase,
    samples: int,
    prompt_tokens: int,
    response_tokens: int,
    seed: int = 0,
) -> tuple[list[Sample], list[float]]:
    """``samples`` single-turn samples (a prompt, then an all-action response) whose
    recorded logprobs are the model's own (the trainer's packed forward, one sample at a
    time: all at once would hold every row's logits), so the PPO ratio starts at
    1 as on fresh rollouts; advantages alternate +1 / -1, so every token has a gradient."""
    rng = random.Random(seed)
    vocab = plain_ids(tok)
    batch: list[Sample] = []
    for i in range(samples):
        tokens = rng.choices(vocab, k=prompt_tokens + response_tokens)
        mask = [0] * prompt_tokens + [1] * response_tokens
        batch.append(Sample(tokens, mask, [0.0] * len(tokens), f"r{i}", f"g{i // 2}"))
    for sample in batch:
        with torch.no_grad():
            values = packed_logprobs(model, [sample])[0].float().tolist()  # type: ignore[arg-type]
        sample.logprobs = [v if a else 0.0 for v, a in zip(values, sample.action_mask, strict=True)]
    return batch, [1.0 if i % 2 == 0 else -1.0 for i in range(samples)]
