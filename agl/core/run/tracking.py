"""Where a run's metrics go: ``metrics.jsonl`` in the run folder (always) and W&B
(offline unless ``WANDB_MODE`` says otherwise), with the sweep as the W&B group and the
strategy choices as tags, so a dashboard compares a sweep's runs directly; and, in W&B
only, tables (a step's sampled trajectories, ``agl.core.trainer.trajectories``)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Tracker:
    def __init__(
        self,
        run_dir: Path,
        config: Mapping[str, Any],
        *,
        wandb: bool = False,
        project: str = "agl",
        group: str | None = None,
        name: str | None = None,
        tags: Sequence[str] = (),
        resume: bool = False,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []  # JSON rows: the step, then each metric
        # (None where it was not finite: JSON has no NaN)
        if resume and self.path.exists():
            self.history = [json.loads(line) for line in self.path.read_text().splitlines()]
        self._file = self.path.open("a")
        self._wandb = _start_wandb(run_dir, config, project, group, name, tags) if wandb else None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.history and self.history[-1]["step"] >= step:
            # Resumed from a checkpoint older than the last line: those steps are redone.
            self._rewrite([r for r in self.history if r["step"] < step])
        row = {"step": step, **{k: _finite(v) for k, v in metrics.items()}}
        self.history.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def log_table(
        self, step: int, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> None:
        """A table at ``step`` (W&B only: metrics.jsonl holds numbers)."""
        if self._wandb is not None and rows:
            import wandb

            table = wandb.Table(columns=list(columns), data=[list(r) for r in rows])
            self._wandb.log({key: table}, step=step)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        self._file.close()
        partial = self.path.with_suffix(".partial")
        partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
        partial.replace(self.path)
        self.history = rows
        self._file = self.path.open("a")

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _finite(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _start_wandb(
    run_dir: Path,
    config: Mapping[str, Any],
    project: str,
    group: str | None,
    name: str | None,
    tags: Sequence[str],
) -> Any:
    import wandb

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=project,
        group=group,
        name=name,
        tags=list(tags),
        config=dict(config),
        dir=str(run_dir),
        reinit="finish_previous",
    )
