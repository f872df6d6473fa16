"""Buffered stitching (AReaL / verl Uni-Agent style): when the next prompt's text lines up
with the sample so far but its tokens do not (the harness sent back a retokenized
response), replace the retokenized segment by the sampled tokens and extend.

This keeps rollouts in fewer samples, but it trains the next response under a prompt it
was not sampled under (eq. 13): each sample counts the calls whose prompt it changed.
Needs the tokenizer's ``decode`` (with special tokens kept) to compare texts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agl.core.contracts.samples import ModelCall, Sample
from agl.strategies.merging import LinearSample, common_prefix_len, start
from agl.strategies.registry import register

Decode = Callable[[list[int]], str]


@register("merge", "stitch")
def stitch(
    calls: Sequence[ModelCall], rollout_id: str, group_id: str, *, decode: Decode | None = None
) -> list[Sample]:
    if decode is None:
        raise ValueError("merge 'stitch' compares texts: pass decode=<tokenizer's decode>")
    samples: list[Sample] = []
    current: LinearSample | None = None
    for i, call in enumerate(calls):
        prompt = call.prompt_ids
        if current is not None and current.continues(prompt):
            current.append(prompt[len(current.tokens) :], call, i)
            continue
        if current is not None:
            end = _text_aligned_end(decode, current.tokens, prompt)
            if end is not None:
                current.append(prompt[end:], call, i)
                current.stitched_calls += 1
                continue
            reason, at = current.why_not(prompt)
            samples.append(current.build(rollout_id, group_id))
            current = start(call, i, reason, at)
        else:
            current = start(call, i, None, None)
    if current is not None:
        samples.append(current.build(rollout_id, group_id))
    return samples


def _text_aligned_end(decode: Decode, sample: list[int], prompt: list[int]) -> int | None:
    """The end ``m`` of the prompt segment whose text is the sample's text, if any.

    Past their common token prefix ``k``, ``decode(prompt[k:m]) == decode(sample[k:])``.
    The decoded length grows with ``m`` (up to a replacement character for a cut UTF-8
    sequence), so a binary search finds the candidate and a few neighbours settle it.
    """
    k = common_prefix_len(sample, prompt)
    target = decode(sample[k:])
    lo, hi = k, len(prompt)
    if len(decode(prompt[k:hi])) < len(target):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(prompt[k:mid])) < len(target):
            lo = mid + 1
        else:
            hi = mid
    for m in range(lo, min(lo + 4, len(prompt)) + 1):
        if decode(prompt[k:m]) == target:
            return m
    return None
