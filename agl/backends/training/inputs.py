"""What every training backend's ``train()`` refuses before it computes anything: the
one input check ``backend=torch`` and ``backend=verl`` share."""

from __future__ import annotations

import math
from collections.abc import Sequence

from agl.core.contracts.samples import Sample


def check_train_inputs(samples: list[Sample], advantages: list[float], vocab: int) -> None:
    """What every training backend's ``train()`` refuses, with a ValueError saying why."""
    if not samples:
        raise ValueError("train() needs at least one sample, got an empty list")
    if len(advantages) != len(samples):
        raise ValueError(
            f"need one advantage per sample: {len(samples)} samples, {len(advantages)} advantages"
        )
    if not all(math.isfinite(a) for a in advantages):
        raise ValueError("advantages must be finite numbers")
    for i, s in enumerate(samples):
        _check_sample(i, s, vocab)


def _check_sample(index: int, sample: Sample, vocab: int) -> None:
    n = len(sample.tokens)
    aligned: dict[str, Sequence[object]] = {
        "action_mask": sample.action_mask,
        "logprobs": sample.logprobs,
    }
    if sample.sampling is not None:
        aligned["sampling"] = sample.sampling
    if sample.parents is not None or sample.position_ids is not None:
        if sample.parents is None or sample.position_ids is None:
            raise ValueError(f"sample {index}: a tree sample needs both parents and position_ids")
        aligned |= {"parents": sample.parents, "position_ids": sample.position_ids}
    for name, values in aligned.items():
        if len(values) != n:
            raise ValueError(f"sample {index}: {len(values)} {name} for {n} tokens")
    if n and not all(0 <= t < vocab for t in sample.tokens):
        raise ValueError(f"sample {index}: token ids must be in [0, {vocab})")
