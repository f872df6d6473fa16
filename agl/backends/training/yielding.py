"""A policy that trains inside its inference engine's ``training()`` window.

``inference.sleep_mode`` (vLLM on the GPUs training uses too, ``VllmServers.training``):
the replicas drain and sleep (weights offloaded to CPU memory, KV cache discarded) for
exactly the duration of ``train()``, so the update has the GPU memory they held; the
trainer's ``publish`` that follows wakes them around the weight update. An ordinary
pause (``paused()``: a publish with no training before it, a checkpoint load) never
sleeps.

Invariant: ``train`` returns or raises with the window closed; ``save``, ``load`` and
``close`` are the wrapped policy's own, outside the window.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from agl.core.contracts.samples import Sample
from agl.core.contracts.strategies import Loss
from agl.core.contracts.training import Policy


class YieldingPolicy:
    """``policy`` whose every ``train()`` runs inside ``window()``."""

    def __init__(self, policy: Policy, window: Callable[[], AbstractContextManager[None]]) -> None:
        self.policy = policy
        self.window = window

    def train(self, samples: list[Sample], advantages: list[float], loss: Loss) -> dict[str, float]:
        with self.window():
            return self.policy.train(samples, advantages, loss)

    def save(self, folder: Path) -> None:
        self.policy.save(folder)

    def load(self, folder: Path) -> None:
        self.policy.load(folder)

    def close(self) -> None:
        """The wrapped policy's ``close`` (verl's workers, a Ray it started), if any."""
        close: Callable[[], object] | None = getattr(self.policy, "close", None)
        if close is not None:
            close()
