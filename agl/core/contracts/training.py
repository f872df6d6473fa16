"""What the trainer loop needs of the training side and of a task (``agl.core.trainer``
drives both; ``agl/backends/training`` and ``agl.core.run.tasks`` implement them)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from agl.core.contracts.samples import Sample
from agl.core.contracts.strategies import Loss


class Policy(Protocol):
    """The training side: one update from a batch, and checkpoints."""

    def train(
        self, samples: list[Sample], advantages: list[float], loss: Loss
    ) -> dict[str, float]: ...

    def save(self, folder: Path) -> None: ...

    def load(self, folder: Path) -> None: ...


class TaskInputs(Protocol):
    """Where a run's rollout inputs come from: what the trainer needs of a task
    (``agl.core.run.tasks.Task`` is the configured one)."""

    def train_inputs(self, batch: int, n: int) -> list[Any]: ...

    def val_inputs(self, n: int, val_set: str | None = None) -> list[Any]: ...

    @property
    def val_sets(self) -> Sequence[str]:
        """Names of the extra validation sets (other options, seeds, temperatures)."""
        ...
