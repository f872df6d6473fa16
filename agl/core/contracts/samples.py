"""What the trainer works on: model calls as recorded, and the samples made from them.

``ModelCall`` and ``Sample`` are the stable names of docs/design.md's Python API; strategies
take and return lists of them, so the algorithms stay pure (no HTTP, no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True)
class Sampling:
    """The transform of the model's logits that a call's tokens were sampled from, and so
    the one the trainer scores them under (the one rule, ``agl.backends.sampling``):
    ``logits / temperature``, then the ``top_k`` most likely tokens (0: all), then the
    smallest set of those with mass >= ``top_p`` (vLLM's order), renormalised.

    Greedy decoding (temperature 0) is recorded and scored untransformed: its logprob is
    the model's own ``log_softmax(logits)``, which is what the engines record for it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, not {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), not {self.top_k!r}")

    @property
    def scored(self) -> Sampling:
        """The transform the tokens are scored under (greedy: none)."""
        return NO_TRANSFORM if self.temperature == 0 else self

    @property
    def truncates(self) -> bool:
        return self.top_p < 1 or self.top_k > 0


NO_TRANSFORM = Sampling()


@dataclass(frozen=True)
class ModelCall:
    """One recorded call: the exact prompt tokens, the sampled tokens and their logprobs,
    the sampling transform those logprobs are of, and which choice of its request it was
    (a request with ``n > 1`` is recorded as one call per choice). ``output_transformed``:
    the text the harness got leaves out part of what the ids say (a special token the
    engine skipped, a stop string it cut), so its next prompt cannot hold these ids."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    policy_version: int = 0
    sampling: Sampling = NO_TRANSFORM
    choice: int = 0
    output_transformed: bool = False

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"a call needs one logprob per response token: {len(self.response_ids)} "
                f"tokens, {len(self.logprobs)} logprobs"
            )


class BreakReason(StrEnum):
    """Why a sample did not continue the one before it in its rollout."""

    INDEPENDENT = "independent"  # the strategy never merges
    # The prompt left the sample inside the previous response: it came back retokenized,
    # or transformed (tool-call JSON reserialized, its <think> dropped by the template).
    RESPONSE_RETOKENIZED = "response_retokenized"
    # ... inside a response whose text the engine had already cut short of its ids: a
    # special token skipped, a stop string left out (agl.core.contracts.text_rule).
    OUTPUT_TRANSFORMED = "output_transformed"
    # ... or before it: earlier history changed (template, summary, a subagent's prompt).
    HISTORY_REWRITTEN = "history_rewritten"


@dataclass
class Sample:
    """One training sequence.

    ``action_mask`` is 1 where the model sampled the token; ``logprobs`` is aligned with
    ``tokens`` (0 where not an action). ``call_index`` names, per token, the call (its
    index in the deduplicated call list) whose response the token is, -1 for context.
    Tree samples add ``parents`` (index of each token's parent, -1 for a root) and
    ``position_ids`` (depth), which define the branch-aware causal mask. ``sampling``
    (aligned with ``tokens``; None: untransformed everywhere) is the transform each
    action token was sampled under, so the trainer scores it under the same one.
    """

    tokens: list[int]
    action_mask: list[int]
    logprobs: list[float]
    rollout_id: str
    group_id: str
    call_index: list[int] = field(default_factory=list)
    position_ids: list[int] | None = None
    parents: list[int] | None = None
    break_reason: BreakReason | None = None  # None for the first sample of a rollout
    diverged_at: int | None = None  # token index where the prompt left the sequence
    stitched_calls: int = 0  # stitch only: calls whose prompt stitching changed
    sampling: list[Sampling] | None = None

    @property
    def num_actions(self) -> int:
        return sum(self.action_mask)

    def __len__(self) -> int:
        return len(self.tokens)
