"""What a researcher sees in the terminal: a progress bar per step and a one-screen
summary at the end."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

_SUMMARY = (
    ("reward/mean", "train reward", "{:.3f}"),
    ("val/reward", "val reward", "{:.3f}"),
    ("merge/samples_per_rollout", "samples / rollout", "{:.2f}"),
    ("merge/single_sample_rollouts", "single-sample rollouts", "{:.1%}"),
    ("merge/stitched_calls", "stitched calls", "{:.1%}"),
    ("merge/tokens_per_action", "tokens / action token", "{:.2f}"),
    ("train/entropy", "entropy", "{:.3f}"),
    ("train/clip_fraction", "clip fraction", "{:.3f}"),
    ("train/kl_behaviour", "KL to behaviour", "{:.4f}"),
    ("staleness/mean", "staleness (versions)", "{:.2f}"),
    ("staleness/dropped_calls", "stale calls dropped", "{:.1%}"),
    ("rollouts/failed", "failed rollouts / step", "{:.1f}"),
    ("time/step_s", "seconds / step", "{:.1f}"),
)


class Progress:
    def __init__(self, total: int, initial: int = 0, enabled: bool = True) -> None:
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc="train",
            unit="step",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self._val: float | None = None

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        if "val/reward" in metrics:
            self._val = metrics["val/reward"]
        postfix = {}
        if "reward/mean" in metrics:
            postfix["reward"] = f"{metrics['reward/mean']:.3f}"
        if self._val is not None:
            postfix["val"] = f"{self._val:.3f}"
        if "merge/samples_per_rollout" in metrics:
            postfix["samples/rollout"] = f"{metrics['merge/samples_per_rollout']:.2f}"
        if "time/step_s" in metrics:
            postfix["s/step"] = f"{metrics['time/step_s']:.1f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(max(0, step - self._bar.n))

    def close(self) -> None:
        self._bar.close()


def summary(history: Sequence[Mapping[str, Any]], run_dir: str, elapsed_s: float) -> str:
    """Start → end of the main metrics, as a small table."""
    lines = [f"run folder: {run_dir}  ({elapsed_s / 60:.1f} min)", ""]
    lines.append(f"{'':26}{'first':>10}{'last':>10}")
    for key, label, fmt in _SUMMARY:
        values = [row[key] for row in history if row.get(key) is not None]
        if not values:
            continue
        lines.append(f"{label:26}{fmt.format(values[0]):>10}{fmt.format(values[-1]):>10}")
    steps = [row["step"] for row in history if "reward/mean" in row]
    if steps:
        lines.append(f"{'steps':26}{'':>10}{steps[-1]:>10}")
    return "\n".join(lines)
