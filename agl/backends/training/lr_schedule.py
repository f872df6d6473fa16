"""The learning-rate schedule both training backends share, with verl's names and verl's
formulas (``verl.utils.torch_functional.get_{constant,cosine,wsd}_schedule_with_warmup``;
verl's FSDP engine builds the first two from its ``optim`` config).

The schedule advances once per training step (one ``train()`` call, whatever its number
of mini-batches), as verl's ``TrainingWorker.train_batch`` does. With ``W`` warm-up steps
(``int(lr_warmup_steps_ratio · total_training_steps)``) and ``N`` the total, the factor
on ``lr`` at step ``s`` (0-indexed) is:

- ``constant``: ``s / W`` while ``s < W``, then 1;
- ``cosine``: ``s / W`` while ``s < W``, then
  ``max(m, m + (1 - m) · (1 + cos(π · (s - W) / (N - W))) / 2)``, ``m = min_lr_ratio``;
- ``wsd`` (warmup-stable-decay): ``s / W`` while ``s < W``, 1 for the next
  ``S = int((N - W) · lr_stable_ratio)`` steps, then the cosine from 1 to ``m`` over the
  ``D = N - W - S`` steps left: ``m + (1 - m) · (1 + cos(π · (s - W - S) / D)) / 2``.
  It learns at the full rate as long as ``constant`` and still ends at ``m``.

Invariants (``tests/backends/training/test_lr_schedule.py`` checks each against verl's own
functions):
the factor is in ``[0, 1]``; it is 1 from the end of the warm-up on under ``constant``,
and through the stable phase under ``wsd``; under ``cosine`` and ``wsd`` it never rises
after the warm-up and reaches ``min_lr_ratio`` at step ``N`` (one past the run's last
step, as in verl) unless the warm-up takes the whole run.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LR_SCHEDULERS = ("constant", "cosine", "wsd")


@dataclass
class LrSchedule:
    """``lr_scheduler_type``, ``lr_warmup_steps_ratio``, ``min_lr_ratio`` as in verl's
    optimizer config, ``lr_stable_ratio`` as verl's WSD schedule's ``stable_ratio``;
    ``total_training_steps`` is the run's ``trainer.steps`` (``agl.train``
    fills it in, as verl's trainer does). A backend config extends this."""

    lr_scheduler_type: str = "constant"
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    lr_stable_ratio: float = 0.9
    total_training_steps: int = 0

    def __post_init__(self) -> None:
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            raise ValueError(
                f"lr_scheduler_type must be one of {', '.join(LR_SCHEDULERS)}, "
                f"not {self.lr_scheduler_type!r}"
            )
        if not 0.0 <= self.lr_warmup_steps_ratio <= 1.0:
            raise ValueError(
                f"lr_warmup_steps_ratio must be in [0, 1], not {self.lr_warmup_steps_ratio}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], not {self.min_lr_ratio}")
        if not 0.0 <= self.lr_stable_ratio <= 1.0:
            raise ValueError(f"lr_stable_ratio must be in [0, 1], not {self.lr_stable_ratio}")
        if self.decays and self.total_training_steps < 1:
            raise ValueError(
                f"lr_scheduler_type={self.lr_scheduler_type} with warm-up or decay needs "
                f"total_training_steps >= 1, not {self.total_training_steps}"
            )
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:  # the config's other bases (the guards) check theirs
            parent()

    @property
    def decays(self) -> bool:
        """Whether the factor ever differs from 1 (else the step count does not matter)."""
        return self.lr_scheduler_type != "constant" or self.lr_warmup_steps_ratio > 0.0

    @property
    def warmup_steps(self) -> int:
        return int(self.lr_warmup_steps_ratio * self.total_training_steps)

    def lr_factor(self, step: int) -> float:
        """The factor on ``lr`` at training step ``step`` (0-indexed)."""
        warmup = self.warmup_steps
        if step < warmup:
            return step / max(1, warmup)
        if self.lr_scheduler_type == "constant":
            return 1.0
        m = self.min_lr_ratio
        if self.lr_scheduler_type == "wsd":
            remaining = max(0, self.total_training_steps - warmup)
            stable = int(remaining * self.lr_stable_ratio)
            if step < warmup + stable:
                return 1.0
            if step >= self.total_training_steps:
                return m
            progress = (step - warmup - stable) / max(1, remaining - stable)
            return (1.0 - m) * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress))) + m
        progress = (step - warmup) / max(1, self.total_training_steps - warmup)
        return max(m, m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def step_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance ``scheduler`` one training step, whether or not the step updated anything
    (a batch with nothing to learn takes no optimizer step; its lr is still spent), so
    torch's warning about a scheduler step before any optimizer step does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        scheduler.step()
