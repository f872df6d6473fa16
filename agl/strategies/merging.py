"""What the linear merge strategies share: a sample under construction and the
classification of why a prompt could not continue it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from agl.core.contracts.samples import BreakReason, ModelCall, Sample


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class LinearSample:
    """A sample being built call by call: context tokens, then each call's response."""

    tokens: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    call_index: list[int] = field(default_factory=list)
    last_response_start: int = 0
    last_transformed: bool = False  # the last call's text left out part of its ids
    break_reason: BreakReason | None = None
    diverged_at: int | None = None
    stitched_calls: int = 0

    def append(self, context: list[int], call: ModelCall, index: int) -> None:
        """Append ``context`` (not trained on), then the call's sampled response."""
        self.tokens += context
        self.action_mask += [0] * len(context)
        self.logprobs += [0.0] * len(context)
        self.call_index += [-1] * len(context)
        self.last_response_start = len(self.tokens)
        self.last_transformed = call.output_transformed
        self.tokens += call.response_ids
        self.action_mask += [1] * len(call.response_ids)
        self.logprobs += call.logprobs
        self.call_index += [index] * len(call.response_ids)

    def continues(self, prompt: list[int]) -> bool:
        """Eq. 9: the prompt starts with every token of the sample so far."""
        n = len(self.tokens)
        return len(prompt) >= n and prompt[:n] == self.tokens

    def why_not(self, prompt: list[int]) -> tuple[BreakReason, int]:
        """Why ``prompt`` does not continue the sample, and where it left it."""
        k = common_prefix_len(self.tokens, prompt)
        if k >= self.last_response_start:
            if self.last_transformed:
                return BreakReason.OUTPUT_TRANSFORMED, k
            return BreakReason.RESPONSE_RETOKENIZED, k
        return BreakReason.HISTORY_REWRITTEN, k

    def build(self, rollout_id: str, group_id: str) -> Sample:
        return Sample(
            tokens=self.tokens,
            action_mask=self.action_mask,
            logprobs=self.logprobs,
            rollout_id=rollout_id,
            group_id=group_id,
            call_index=self.call_index,
            break_reason=self.break_reason,
            diverged_at=self.diverged_at,
            stitched_calls=self.stitched_calls,
        )


def start(call: ModelCall, index: int, reason: BreakReason | None, at: int | None) -> LinearSample:
    sample = LinearSample(break_reason=reason, diverged_at=at)
    sample.append(call.prompt_ids, call, index)
    return sample
