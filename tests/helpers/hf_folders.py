"""Model folders no agl code names, written by the tests with ``save_pretrained``: a
Qwen3-family and a Llama-family architecture from configs, each with its own tokenizer
and chat template, loaded back by path (``model=hf model.path=<folder>``).

The tokenizers are word-level (a word, a digit or a punctuation run is a token): text
and ids round-trip exactly, so the only retokenization drift a run can show is the one
its chat template makes. The Qwen template is Qwen3's in its non-thinking mode: the
generation prompt opens an empty ``<think></think>`` block, and earlier assistant turns
are rendered without it, so every later call's prompt departs from what the model was
given before. The Llama template (Llama 3.1's, reduced) renders history exactly as it
was sampled.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# Few words, a third of them digits: a random model's reply holds a digit most times, so
# arithmetic questions get some right answers and the first steps have a gradient.
WORDS = [
    *"0123456789",
    *"+?.,:{}[]\"",
    "What", "is", "That", "not", "right", "Try", "again",
    "system", "user", "assistant", "ipython", "tool", "name", "arguments", "parameters",
]  # fmt: skip

QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "[UNK]",
]  # fmt: skip
LLAMA_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "[UNK]",
]  # fmt: skip


TEMPLATES = Path(__file__).parents[1] / "chat_templates"
# Qwen3's chat template, reduced to what a chat with tools uses, in non-thinking mode.
QWEN3_TEMPLATE = (TEMPLATES / "qwen3_nonthinking.jinja").read_text()
# Llama 3.1's JSON tool-calling template, reduced (no dates, no builtin tools).
LLAMA31_TEMPLATE = (TEMPLATES / "llama31_json.jinja").read_text()


# Both architectures at one small size (GQA; head_dim 32, which vLLM's CPU attention takes).
SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
}


def _tokenizer(specials: list[str], **tokens: str | None) -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate([*specials, *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        additional_special_tokens=[t for t in specials if t not in tokens.values()],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
        **{k: v for k, v in tokens.items() if v is not None},
    )
    return tokenizer


def write_qwen3(folder: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3 (tied embeddings, GQA) with Qwen3's non-thinking template."""
    tokenizer = _tokenizer(QWEN_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = QWEN3_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3Config(
        vocab_size=len(tokenizer),  # no spare rows a random model could sample
        **SHAPE,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    return _save(Qwen3ForCausalLM, config, tokenizer, folder, seed)


def write_llama(folder: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (untied embeddings, GQA, no pad token, two eos ids as Llama 3.1's
    generation config has) with Llama 3.1's JSON tool-calling template."""
    tokenizer = _tokenizer(LLAMA_SPECIALS, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tokenizer.chat_template = LLAMA31_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # no spare rows a random model could sample
        **SHAPE,
        tie_word_embeddings=False,
        bos_token_id=ids("<|begin_of_text|>"),
        eos_token_id=[ids("<|eot_id|>"), ids("<|eom_id|>")],
        pad_token_id=None,
    )
    return _save(LlamaForCausalLM, config, tokenizer, folder, seed)


def _save(
    cls: type, config: object, tokenizer: PreTrainedTokenizerFast, folder: Path, seed: int
) -> Path:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.generation_config.eos_token_id = config.eos_token_id  # type: ignore[attr-defined]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_questions(
    path: Path, count: int = 24, keys: tuple[str, str] = ("question", "solution")
) -> Path:
    """One-digit sums as dataset rows (``{"question": "What is 3 + 4 ?", "solution": 7}``):
    JSON lines, or parquet for a ``.parquet`` path."""
    rows = [
        {keys[0]: f"What is {a} + {b} ?", keys[1]: a + b}
        for a in range(1, 9)
        for b in range(1, 9)
        if a + b <= 9
    ][:count]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
