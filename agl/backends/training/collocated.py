"""The torch backend collocated with the inference engine: the trainer's ``nn.Module`` is
the one the engine serves (embedded: the same object; vLLM: published to it after each
step), so an update is "pause the engine, step the optimizer in place, publish"."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from agl.backends.training.torch import TorchBackend
from agl.core.contracts.samples import Sample
from agl.core.contracts.strategies import Loss

CHECKPOINT = "policy.pt"


class CollocatedPolicy:
    def __init__(
        self, backend: TorchBackend, paused: Callable[[], AbstractContextManager[None]]
    ) -> None:
        self.backend = backend
        self.paused = paused

    def train(self, samples: list[Sample], advantages: list[float], loss: Loss) -> dict[str, float]:
        # The trainer runs this with no generation in flight; pausing the engine makes it
        # a guarantee (a stray request waits instead of reading half-updated weights).
        with self.paused():
            return self.backend.train(samples, advantages, loss)

    def save(self, folder: Path) -> None:
        torch.save(self.backend.state_dict(), folder / CHECKPOINT)

    def load(self, folder: Path) -> None:
        state = torch.load(folder / CHECKPOINT, map_location="cpu", weights_only=False)
        with self.paused():
            self.backend.load_state_dict(state)
