"""Best-effort exact-prefix merge (the paper's choice): a call extends the current sample
only when its prompt starts with exactly the tokens so far (eq. 9); otherwise the sample
is closed and a new one begins. Every action keeps the prompt it was sampled under."""

from __future__ import annotations

from collections.abc import Sequence

from agl.core.contracts.samples import ModelCall, Sample
from agl.strategies.merging import LinearSample, start
from agl.strategies.registry import register


@register("merge", "prefix")
def prefix(calls: Sequence[ModelCall], rollout_id: str, group_id: str) -> list[Sample]:
    samples: list[Sample] = []
    current: LinearSample | None = None
    for i, call in enumerate(calls):
        if current is not None and current.continues(call.prompt_ids):
            current.append(call.prompt_ids[len(current.tokens) :], call, i)
            continue
        reason, at = current.why_not(call.prompt_ids) if current is not None else (None, None)
        if current is not None:
            samples.append(current.build(rollout_id, group_id))
        current = start(call, i, reason, at)
    if current is not None:
        samples.append(current.build(rollout_id, group_id))
    return samples
