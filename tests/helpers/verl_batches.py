"""Batches for the verl backend's tests: random linear samples with multi-turn masks and
their advantages, the same with tokens sampled from a model under per-token sampling
transforms, and the clip range those tests train with."""

from __future__ import annotations

import dataclasses
import random

import torch
from hypothesis import strategies as st

from agl.backends.sampling import logprobs_under
from agl.backends.training.packing import packed_logprobs
from agl.core.contracts.samples import NO_TRANSFORM, Sample, Sampling

CLIP_LOW, CLIP_HIGH = 0.2, 0.28
PAD = 0

HOT = Sampling(temperature=0.7)
NUCLEUS = Sampling(top_p=0.9)
TOP_K = Sampling(top_k=20)
SAMPLED = [NO_TRANSFORM, HOT, NUCLEUS, TOP_K]


@st.composite
def linear_samples(draw: st.DrawFn, vocab: int = 1000) -> Sample:
    n = draw(st.integers(2, 14))
    mask = draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n))
    tokens = draw(st.lists(st.integers(1, vocab - 1), min_size=n, max_size=n))
    logprobs = [-draw(st.floats(0.0, 5.0, allow_nan=False, width=32)) if a else 0.0 for a in mask]
    rollout = draw(st.sampled_from(["r0", "r1", "r2", "r3"]))
    return Sample(tokens, mask, logprobs, rollout_id=rollout, group_id="g" + rollout[-1])


def make_batch(seed: int, rollouts: int, max_samples: int = 3, vocab: int = 1000) -> tuple:
    """Samples of ``rollouts`` rollouts (1..max_samples each, multi-turn masks) and
    advantages (one per rollout, broadcast to its samples, as the rollout strategy does)."""
    rng = random.Random(seed)
    samples, advantages = [], []
    for r in range(rollouts):
        advantage = rng.uniform(-1.5, 1.5)
        for _ in range(rng.randint(1, max_samples)):
            n = rng.randint(5, 16)
            prompt = rng.randint(1, 4)
            # a multi-turn response: model tokens with a tool/user stretch (mask 0) inside
            mask = [0] * prompt + [1 if rng.random() < 0.7 else 0 for _ in range(n - prompt)]
            mask[-1] = 1
            tokens = [rng.randrange(3, vocab) for _ in range(n)]
            logprobs = [-rng.uniform(0.5, 4.0) if a else 0.0 for a in mask]
            samples.append(Sample(tokens, mask, logprobs, rollout_id=f"r{r}", group_id="g"))
            advantages.append(advantage)
    return samples, advantages


def sampled_batch(
    model: torch.nn.Module, seed: int, transforms: list[Sampling], noise: float = 0.05
) -> tuple[list[Sample], list[float]]:
    """``make_batch``'s layout with every action token drawn from the model under a
    transform picked per token from ``transforms`` (so it is in a truncation's support),
    recorded with the model's own logprob under it plus noise (a mismatched engine)."""
    samples, advantages = make_batch(seed, rollouts=4, max_samples=2)
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        tokens = list(s.tokens)
        per_token = [rng.choice(transforms) if a else NO_TRANSFORM for a in s.action_mask]
        for i in range(1, len(tokens)):
            if s.action_mask[i]:
                with torch.no_grad():
                    logits = model(torch.tensor([tokens[:i]])).logits[0, -1:].float()
                probs = logprobs_under(logits, [per_token[i]])[0].exp()
                tokens[i] = int(torch.multinomial(probs, 1, generator=generator))
        out.append(dataclasses.replace(s, tokens=tokens, sampling=per_token))
    with torch.no_grad():
        own = packed_logprobs(model, out)
    recorded = [
        dataclasses.replace(
            s,
            logprobs=[
                float(x) + rng.uniform(-noise, noise) if a else 0.0
                for x, a in zip(lp.tolist(), s.action_mask, strict=True)
            ],
        )
        for s, lp in zip(out, own, strict=True)
    ]
    return recorded, advantages
