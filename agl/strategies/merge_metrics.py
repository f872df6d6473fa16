"""What a merge made of a batch of rollouts, as flat training metrics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from agl.core.contracts.samples import BreakReason, Sample


def unique_tokens(sequences: Sequence[Sequence[int]]) -> int:
    """The distinct prefixes of ``sequences`` (the nodes of their trie): the tokens a
    forward pass must compute at least once to score every one of them."""
    ordered = sorted({tuple(s) for s in sequences})
    total = 0
    previous: tuple[int, ...] = ()
    for sequence in ordered:
        shared = 0
        for a, b in zip(sequence, previous, strict=False):
            if a != b:
                break
            shared += 1
        total += len(sequence) - shared
        previous = sequence
    return total


def merge_metrics(
    rollouts: Sequence[Sequence[Sample]], calls: int, unique: int | None = None
) -> dict[str, float]:
    """``rollouts``: each rollout's samples; ``calls``: model calls they were made from;
    ``unique``: the distinct tokens of those calls (``unique_tokens`` of each rollout's
    prompt + response ids, summed over rollouts).

    - ``merge/samples_per_rollout``, ``merge/single_sample_rollouts`` (a share);
    - ``merge/breaks/<reason>``: samples that started because of ``reason``, per rollout;
    - ``merge/stitched_calls``: share of calls trained under a prompt stitching changed;
    - ``merge/tokens_per_action``: computed tokens per trained token;
    - ``merge/tokens_per_unique_token``: computed tokens per distinct token of the calls
      (1 when nothing is computed twice; the independent merge recomputes each prompt).
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
    if unique is not None:
        metrics["merge/tokens_per_unique_token"] = sum(len(s) for s in samples) / max(unique, 1)
    for reason in BreakReason:
        metrics[f"merge/breaks/{reason.value}"] = reasons[reason] / n
    return metrics
