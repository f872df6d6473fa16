"""The one rule for what distribution a token was sampled from
(``agl.core.contracts.samples.Sampling``), in torch, shared by the embedded engine (which
samples and records under it) and the training backends (which score the same tokens under
it), so the two cannot drift.

``logits / temperature``, then the ``top_k`` largest logits (ties at the k-th kept), then
the smallest set of those whose renormalised mass reaches ``top_p`` (a token goes when the
tokens ranked above it already hold ``top_p``), renormalised: vLLM's sampler in the same
order, so its ``processed_logprobs`` are of the same distribution. Tokens outside the set
get ``-inf``. The set is chosen on detached values; the gradient flows through the
renormalisation over the kept logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agl.core.contracts.samples import NO_TRANSFORM, Sampling


def transformed_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """``[K, V]`` log-probabilities of each row's transformed distribution.

    ``temperature`` (> 0), ``top_k`` (0: off) and ``top_p`` (1: off) are ``[K]``, one per
    row. ``logits`` should be float32 or wider.
    """
    scaled = logits / temperature[:, None].to(logits.dtype)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        with torch.no_grad():
            removed = _removed(scaled.detach(), top_k, top_p)
        scaled = scaled.masked_fill(removed, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def _removed(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ordered, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = ordered.gather(1, (k - 1).long()[:, None])
    out_of_k = ordered < kth
    ordered = ordered.masked_fill(out_of_k, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    above = probs.cumsum(-1) - probs  # mass of the tokens ranked above
    out_of_p = (above >= top_p[:, None].to(probs.dtype)) & (top_p[:, None] < 1)
    removed_sorted = out_of_k | out_of_p
    return torch.zeros_like(removed_sorted).scatter_(1, order, removed_sorted)


def sampling_tensors(
    rows: Sequence[Sampling], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(temperature, top_k, top_p)`` of ``rows`` as scored (greedy: untransformed)."""
    scored = [s.scored for s in rows]
    return (
        torch.tensor([s.temperature for s in scored], dtype=torch.float32, device=device),
        torch.tensor([s.top_k for s in scored], dtype=torch.long, device=device),
        torch.tensor([s.top_p for s in scored], dtype=torch.float32, device=device),
    )


def logprobs_under(logits: torch.Tensor, rows: Sequence[Sampling] | None) -> torch.Tensor:
    """``transformed_logprobs`` with one ``Sampling`` per row (None: untransformed)."""
    if rows is None or all(s.scored == NO_TRANSFORM for s in rows):
        return torch.log_softmax(logits, dim=-1)
    return transformed_logprobs(logits, *sampling_tensors(rows, logits.device))
