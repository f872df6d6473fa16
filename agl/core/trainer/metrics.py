"""What a merge made of a batch of rollouts, as flat training metrics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from agl.core.contracts.samples import BreakReason, Sample


def merge_metrics(rollouts: Sequence[Sequence[Sample]], calls: int) -> dict[str, float]:
    """``rollouts``: each rollout's samples; ``calls``: model calls they were made from.

    - ``merge/samples_per_rollout``, ``merge/single_sample_rollouts`` (a share);
    - ``merge/breaks/<reason>``: samples that started because of ``reason``, per rollout;
    - ``merge/stitched_calls``: share of calls trained under a prompt stitching changed;
    - ``merge/tokens_per_action``: computed tokens per trained token.
    """
    samples = [s for r in rollouts for s in r]
    n = max(len(rollouts), 1)
    reasons = Counter(s.break_reason for s in samples if s.break_reason is not None)
    actions = sum(s.num_actions for s in samples)
    metrics = {
        "merge/samples_per_rollout": len(samples) / n,
        "merge/single_sample_rollouts": sum(len(r) == 1 for r in rollouts) / n,
        "merge/stitched_calls": sum(s.stitched_calls for s in samples) / max(calls, 1),
        "merge/tokens_per_action": sum(len(s) for s in samples) / max(actions, 1),
    }
    for reason in BreakReason:
        metrics[f"merge/breaks/{reason.value}"] = reasons[reason] / n
    return metrics
