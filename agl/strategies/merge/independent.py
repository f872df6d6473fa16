"""Every call is its own sample: always exact, recomputes every shared prefix."""

from __future__ import annotations

from collections.abc import Sequence

from agl.core.contracts.samples import BreakReason, ModelCall, Sample
from agl.strategies.merging import start
from agl.strategies.registry import register


@register("merge", "independent")
def independent(calls: Sequence[ModelCall], rollout_id: str, group_id: str) -> list[Sample]:
    return [
        start(call, i, None if i == 0 else BreakReason.INDEPENDENT, None).build(
            rollout_id, group_id
        )
        for i, call in enumerate(calls)
    ]
