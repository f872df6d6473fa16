"""The three strategy contracts, declared once (the registry, the trainer, both training
backends and the viewer use these names).

- ``Merge``: a rollout's model calls, its id and its group's → its samples
  (``agl/strategies/merge/``; options such as ``decode`` come as keyword arguments, bound
  by ``agl.core.trainer.assemble.MergeStrategy``).
- ``Advantage``: a batch's samples and the reward of each rollout → one advantage per
  sample (``agl/strategies/advantage/``; options bound with ``functools.partial``).
- ``Loss``: a mini-batch's samples → each token's loss weight (``agl/strategies/loss/``).
- ``Decode``: token ids → text, as the merge strategies that compare texts read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agl.core.contracts.samples import ModelCall, Sample

Merge = Callable[[list[ModelCall], str, str], list[Sample]]
Advantage = Callable[[list[Sample], dict[str, float]], list[float]]
Loss = Callable[[list[Sample]], list[list[float]]]
Decode = Callable[[Sequence[int]], str]
