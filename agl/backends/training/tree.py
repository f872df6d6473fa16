"""Branch-aware causal attention for packed prefix trees (merge strategy ``tree``).

A packed tree sample lists each token with its parent; a token may attend to itself and
its ancestors only, and its position id is its depth. With that mask, every token sees
exactly the context it would have in its own causal sequence, so per-token logprobs on
the packed tree equal those of running each call independently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """``[T, T]`` bool: row ``i`` may attend to column ``j`` iff ``j`` is ``i`` or its
    ancestor. Parents must precede their children (as the tree merge guarantees)."""
    size = len(parents)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= node:
            raise ValueError(f"token {node} has parent {parent}: parents must come first")
        if parent >= 0:
            mask[node] = mask[parent]
        mask[node, node] = True
    return mask


def additive_mask(parents: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ancestor mask as a ``[1, 1, T, T]`` additive bias (0 allowed, -inf blocked), the
    4D ``attention_mask`` shape that HF transformers' attention takes as given."""
    allowed = ancestor_mask(parents)
    bias = torch.zeros(allowed.shape, dtype=dtype)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias[None, None]


def linear_parents(length: int) -> list[int]:
    return list(range(-1, length - 1))


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, parents: Sequence[int]
) -> torch.Tensor:
    """Logprob of each token under the logits at its parent (0 for roots, which nothing
    predicts). ``logits``: ``[T, V]``; ``tokens``: ``[T]``."""
    parent = torch.tensor(parents, dtype=torch.long)
    has_parent = parent >= 0
    logprobs = torch.zeros(len(parents), dtype=logits.dtype)
    source = torch.log_softmax(logits[parent[has_parent]], dim=-1)
    logprobs[has_parent] = source.gather(-1, tokens[has_parent, None]).squeeze(-1)
    return logprobs
