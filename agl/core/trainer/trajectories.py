"""A step's rollouts as a small table for W&B: a seeded sample of them, each with its
input, reward, turns, tokens, the samples the run's merge makes of it and why they broke,
and the conversation as the model saw it (its samples' tokens, decoded). Pure: no
W&B, no HTTP.

Invariants:
- at most ``limit`` rows, the same rollouts for the same step and mode in every run;
- every text cell is at most ``text_chars`` long (its start and end kept), so a table's
  size is bounded whatever the agents wrote.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any

from agl.core.trainer.assemble import FinishedRollout, MergeStrategy
from agl.strategies.dedup import dedup

COLUMNS = [
    "rollout_id",
    "input",
    "reward",
    "outcome",
    "turns",
    "response_tokens",
    "samples",
    "sample_tokens",
    "breaks",
    "conversation",
]


def pick(rollouts: Sequence[FinishedRollout], limit: int, key: str) -> list[FinishedRollout]:
    """``limit`` of ``rollouts``, chosen by ``key`` (the step and mode), in id order."""
    ordered = sorted(rollouts, key=lambda r: r.rollout_id)
    if len(ordered) <= limit:
        return ordered
    chosen = random.Random(key).sample(range(len(ordered)), limit)
    return [ordered[i] for i in sorted(chosen)]


def cut(text: str, chars: int) -> str:
    """``text`` in at most ``chars`` characters: its start and end, the middle elided."""
    if len(text) <= chars:
        return text
    marker = f"\n… {len(text) - chars} characters …\n"
    keep = max(chars - len(marker), 0)
    head = keep // 2
    return (text[:head] + marker + text[len(text) - (keep - head) :])[:chars]


def trajectory_rows(
    rollouts: Sequence[FinishedRollout],
    merge: MergeStrategy,
    *,
    limit: int,
    key: str,
    text_chars: int = 4000,
    dedup_rule: str = "continued",
) -> list[list[Any]]:
    """One row per picked rollout, in ``COLUMNS`` order."""
    decode: Callable[[list[int]], str] = merge.decode or (lambda ids: " ".join(map(str, ids)))
    rows = []
    for r in pick(rollouts, limit, key):
        calls = dedup(r.calls, dedup_rule)
        samples = merge(calls, r.rollout_id, r.group_id) if calls else []
        breaks = [s.break_reason.value for s in samples if s.break_reason is not None]
        conversation = "\n".join(
            f"── sample {i + 1}"
            + ("" if s.break_reason is None else f" (after a break: {s.break_reason.value})")
            + f" ──\n{decode(s.tokens)}"
            for i, s in enumerate(samples)
        )
        outcome = r.status.value if r.error is None else f"{r.status.value}: {r.error}"
        rows.append(
            [
                r.rollout_id,
                cut(json.dumps(r.input, ensure_ascii=False, default=str), text_chars),
                r.reward,
                cut(outcome, text_chars),
                len(r.calls),
                sum(len(c.response_ids) for c in r.calls),
                len(samples),
                sum(len(s) for s in samples),
                ", ".join(breaks),
                cut(conversation, text_chars),
            ]
        )
    return rows
