"""Per-token loss weights, one place for every normalization (cf. verl's ``agg_loss``).

Weights are computed once for a whole optimizer mini-batch, so that
``loss = Σ weight · token_loss`` is the same however the mini-batch is later cut into
micro-batches or spread over ranks: each piece just sums its share. Non-action tokens
weigh 0; samples without action tokens do not count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agl.core.contracts.samples import Sample


def per_token(samples: Sequence[Sample], weight: Callable[[Sample], float]) -> list[list[float]]:
    """``weight(sample)`` on each action token of each sample, 0 elsewhere."""
    out = []
    for s in samples:
        w = weight(s) if s.num_actions else 0.0
        out.append([w if a else 0.0 for a in s.action_mask])
    return out


def push(weights: Sequence[Sequence[float]], advantages: Sequence[float]) -> dict[str, float]:
    """Which way a batch's loss pushes, from each token's weight ``w`` and its sample's
    advantage ``A`` (the Figure 9 mechanism: a normalisation that weighs long failing
    rollouts most pushes the sampled tokens down on the whole).

    - ``net_push`` = Σ w·A / Σ |w·A|, in [-1, 1]: -1 when only negative advantages carry
      weight, 0 when positive and negative pushes balance. It is 0 when nothing is pushed.
    - ``negative_weight`` = Σ w over the tokens of samples with A < 0, over Σ w: the share
      of the loss's weight pushed down. Tokens with A = 0 (a group with no signal) count
      in Σ w, so it is less than the weight on failed rollouts wherever a whole group
      failed. It is 0 when no token weighs anything.

    The weights are those of one normalisation over the whole batch (a backend that cuts a
    step into several optimizer mini-batches normalises each on its own)."""
    if len(weights) != len(advantages):
        raise ValueError(f"{len(weights)} weight rows for {len(advantages)} advantages")
    signed = magnitude = negative = total = 0.0
    for row, a in zip(weights, advantages, strict=True):
        w = sum(row)
        signed += w * a
        magnitude += abs(w * a)
        total += w
        negative += w if a < 0 else 0.0
    return {
        "net_push": signed / magnitude if magnitude else 0.0,
        "negative_weight": negative / total if total else 0.0,
    }
