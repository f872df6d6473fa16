"""Where merged samples put things, position by position: each token's context and how
many sample positions hold each action of each call."""

from __future__ import annotations

from collections import Counter

from agl.core.contracts.samples import Sample


def contexts(sample: Sample) -> list[list[int]]:
    """Each token's context: its ancestors (tree) or everything before it (linear)."""
    if sample.parents is None:
        return [sample.tokens[:p] for p in range(len(sample.tokens))]
    out: list[list[int]] = []
    for p in range(len(sample.tokens)):
        parent = sample.parents[p]
        out.append([*out[parent], sample.tokens[parent]] if parent >= 0 else [])
    return out


def action_positions(samples: list[Sample]) -> Counter[tuple[int, int]]:
    """(call, index in its response) -> how many sample positions hold that action."""
    seen: Counter[tuple[int, int]] = Counter()
    for s in samples:
        progress: Counter[int] = Counter()
        order = range(len(s.tokens))
        for p in order:
            if s.action_mask[p]:
                c = s.call_index[p]
                seen[c, progress[c]] += 1
                progress[c] += 1
    return seen
