"""Samples packed into one row for a single forward pass: each sample attends to itself
only (causal, or its ancestors for a tree sample), positions restart per sample, and only
the logits rows that predict a wanted token are projected. Shared by the torch backend's
update and its logprob recomputation; exact (tests/backends/training/test_torch_backend.py: a packed
logprob equals the sample's alone).

Packing is exact only where every layer is full attention, which the block-diagonal mask
governs. A linear-attention or state-space layer (Qwen3-Next, Qwen3.5, Mamba hybrids)
carries its state from one sample into the next, and a sliding-window layer loses its
window to the explicit mask: for such a model (``packable`` is False) ``selected_logits``
runs each sample of the packed row as its own forward (still exact, one pass per sample),
and refuses tree samples, whose ancestor masks only attention layers can apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from agl.backends.sampling import logprobs_under
from agl.backends.training.tree import ancestor_mask
from agl.core.contracts.samples import NO_TRANSFORM, Sample, Sampling


def parents_of(sample: Sample) -> list[int]:
    """Each token's parent index: the tree's own, else the previous token (-1 = root)."""
    if sample.parents is not None:
        return list(sample.parents)
    return list(range(-1, len(sample.tokens) - 1))


def positions_of(sample: Sample) -> list[int]:
    if sample.position_ids is not None:
        return list(sample.position_ids)
    return list(range(len(sample.tokens)))


@dataclass(frozen=True)
class Packed:
    """One micro-batch as a single row, and which logits rows to read.

    ``rows[k]`` is the row (in the packed sequence) whose logits predict ``targets[k]``,
    the ``k``-th selected token; it is token ``token_index[k]`` of sample
    ``sample_index[k]`` (an index into the packed list).
    """

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    attention_mask: torch.Tensor  # [1, 1, T, T] additive: 0 allowed, finfo.min blocked
    rows: torch.Tensor  # [K] long
    targets: torch.Tensor  # [K] long
    sample_index: list[int]
    token_index: list[int]
    lengths: tuple[int, ...] = ()  # tokens per sample, in row order
    has_trees: bool = False  # some sample brings its own ancestor mask

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def block_mask(samples: Sequence[Sample], device: torch.device | str) -> torch.Tensor:
    """``[T, T]`` bool: causal within each sample (ancestors for a tree), nothing across."""
    lengths = torch.tensor([len(s.tokens) for s in samples], device=device)
    segment = torch.repeat_interleave(torch.arange(len(samples), device=device), lengths)
    allowed = (segment[:, None] == segment[None, :]).tril_()
    offset = 0
    for s in samples:
        n = len(s.tokens)
        if s.parents is not None:
            allowed[offset : offset + n, offset : offset + n] = ancestor_mask(s.parents).to(device)
        offset += n
    return allowed


def pack(
    samples: Sequence[Sample],
    selected: Sequence[Sequence[int]],
    device: torch.device | str,
    dtype: torch.dtype,
) -> Packed:
    """Concatenate ``samples`` into one row; ``selected[j]`` lists the token indices of
    sample ``j`` whose logprobs are wanted (each must have a parent)."""
    tokens: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    targets: list[int] = []
    sample_index: list[int] = []
    token_index: list[int] = []
    for j, (s, chosen) in enumerate(zip(samples, selected, strict=True)):
        offset = len(tokens)
        parents = parents_of(s)
        for i in chosen:
            if parents[i] < 0:
                raise ValueError(f"token {i} is a root: nothing predicts it")
            rows.append(offset + parents[i])
            targets.append(s.tokens[i])
            sample_index.append(j)
            token_index.append(i)
        tokens.extend(s.tokens)
        positions.extend(positions_of(s))
    allowed = block_mask(samples, device)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return Packed(
        input_ids=torch.tensor([tokens], device=device),
        position_ids=torch.tensor([positions], device=device),
        attention_mask=bias[None, None],
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        sample_index=sample_index,
        token_index=token_index,
        lengths=tuple(len(s.tokens) for s in samples),
        has_trees=any(s.parents is not None for s in samples),
    )


def packable(model: torch.nn.Module) -> bool:
    """Whether one packed row is exact for ``model``: every layer is full attention (HF's
    ``layer_types``; a config without them, e.g. Llama's, must have no sliding window)."""
    text = _text_config(model)
    types = getattr(text, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return getattr(text, "sliding_window", None) is None


def layer_kinds(model: torch.nn.Module) -> list[str]:
    """The distinct kinds of the model's layers (for messages)."""
    text = _text_config(model)
    types = getattr(text, "layer_types", None)
    if types is None:
        return ["sliding_attention" if getattr(text, "sliding_window", None) else "full_attention"]
    return sorted(set(types))


def _text_config(model: torch.nn.Module) -> Any:
    config: Any = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _unpacked_logits(model: transformers.PreTrainedModel, packed: Packed) -> torch.Tensor:
    """``selected_logits`` for a model that cannot pack: one forward per sample."""
    if packed.has_trees:
        raise ValueError(
            "tree samples need a model whose layers are all full attention, not "
            f"{', '.join(layer_kinds(model))}: use linear samples for this model"
        )
    parts = []
    offset = 0
    for n in packed.lengths:
        inside = (packed.rows >= offset) & (packed.rows < offset + n)
        if bool(inside.any()):
            out = model(
                input_ids=packed.input_ids[:, offset : offset + n],
                position_ids=packed.position_ids[:, offset : offset + n],
                use_cache=False,
                logits_to_keep=packed.rows[inside] - offset,
            )
            parts.append(out.logits[0])
        offset += n
    # pack() lists the rows sample by sample, so the parts concatenate in their order.
    return torch.cat(parts)


def selected_logits(model: transformers.PreTrainedModel, packed: Packed) -> torch.Tensor:
    """``[K, V]`` logits (float32 or wider) at ``packed.rows`` only (one forward per
    sample for a model that cannot pack, see the module doc).

    ``logits_to_keep`` given as an index tensor makes the HF causal-LM head (Qwen2, Llama,
    ...) project just those hidden states, and keeps any model-specific logit processing
    that calling ``lm_head`` by hand would skip.
    """
    if packable(model):
        logits = model(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
            use_cache=False,
            logits_to_keep=packed.rows,
        ).logits[0]
    else:
        logits = _unpacked_logits(model, packed)
    # log_softmax in fp32 at least, even for a bf16 model (fp64 stays fp64).
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def row_sampling(samples: Sequence[Sample], packed: Packed) -> list[Sampling] | None:
    """The sampling transform of each selected token (None: all untransformed)."""
    if all(s.sampling is None for s in samples):
        return None
    return [
        NO_TRANSFORM if samples[j].sampling is None else samples[j].sampling[i]  # type: ignore[index]
        for j, i in zip(packed.sample_index, packed.token_index, strict=True)
    ]


def model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    parameter = next(model.parameters())
    return parameter.device, parameter.dtype


def packed_logprobs(
    model: transformers.PreTrainedModel, samples: Sequence[Sample]
) -> list[torch.Tensor]:
    """Per sample, the logprob of every token from ONE packed forward (0 for roots).

    Runs under the caller's grad mode and the model's current train/eval mode; each
    token is scored under its ``Sample.sampling`` transform.
    """
    device, dtype = model_device_dtype(model)
    selected = [[i for i, p in enumerate(parents_of(s)) if p >= 0] for s in samples]
    packed = pack(samples, selected, device, dtype)
    if not packed.token_index:
        return [torch.zeros(len(s.tokens), device=device) for s in samples]
    logprobs = logprobs_under(selected_logits(model, packed), row_sampling(samples, packed))
    picked = logprobs.gather(-1, packed.targets[:, None]).squeeze(-1)
    # pack() lists the selected tokens sample by sample, so one split gives each its share.
    shares = picked.split([len(c) for c in selected])
    out = []
    for s, chosen, share in zip(samples, selected, shares, strict=True):
        index = torch.tensor(chosen, dtype=torch.long, device=device)
        out.append(
            torch.zeros(len(s.tokens), dtype=picked.dtype, device=device).index_put((index,), share)
        )
    return out
