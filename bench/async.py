"""Sync vs collocated async training, side by side in one run (``python -m bench.async``).

The guess task with long-tailed agent latency: before each model call the harness
"thinks" for a time drawn from a lognormal (median ``think_median_s``, shape
``think_sigma``), as real agents do while tools run. Both modes train the same number of
steps on the same batches; the figure is the wall-clock of the training loop (from the
first submitted rollout to the last update) and the accelerator-idle fraction, i.e. the
share of that time in which neither generation nor training ran.

sync waits for the slowest rollout of every batch; async trains as soon as enough groups
are complete and lets the rest carry on under the new weights (the paper reports ~2x).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from agl.train import CONF, train


def _overrides(args: argparse.Namespace, mode: str) -> list[str]:
    return [
        f"trainer.mode={mode}",
        f"trainer.steps={args.steps}",
        f"trainer.groups_per_step={args.groups}",
        f"trainer.group_size={args.group_size}",
        f"trainer.max_inflight_groups={args.groups * 2}",
        "trainer.max_staleness=2",
        "trainer.val_every=0",
        "trainer.checkpoint_every=0",
        "trainer.timeout_s=300",
        "task.timeout_s=300",
        "task.warmup_options.steps=60",
        f"+task.agent.think_median_s={args.think_median_s}",
        f"+task.agent.think_sigma={args.think_sigma}",
        "logging.wandb=false",
        "logging.progress=false",
        "controller.concurrency=512",
    ]


def _run(args: argparse.Namespace, mode: str, folder: Path) -> dict[str, float]:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=_overrides(args, mode))
    started = time.monotonic()
    history = train(cfg, folder / mode)
    total = time.monotonic() - started
    steps = [row for row in history if "time/step_s" in row]
    loop_s = sum(row["time/step_s"] for row in steps)
    train_s = sum(row.get("time/train_s", 0.0) for row in steps)
    busy_s = steps[-1]["inference/busy_s"]  # the engine starts with the loop (no validation)
    return {
        "loop_s": loop_s,
        "total_s": total,
        "s_per_step": loop_s / len(steps),
        "train_s": train_s,
        "idle": max(0.0, 1.0 - (busy_s + train_s) / loop_s),
        "reward": sum(row["reward/mean"] for row in steps) / len(steps),
        "staleness": sum(row.get("staleness/mean", 0.0) for row in steps) / len(steps),
        "dropped": sum(row.get("staleness/dropped_calls", 0.0) for row in steps) / len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--think-median-s", type=float, default=0.3)
    parser.add_argument("--think-sigma", type=float, default=1.2)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-bench-async-") as tmp:
        results = {mode: _run(args, mode, Path(tmp)) for mode in ("sync", "async")}
    sync, asyn = results["sync"], results["async"]
    lines = [
        f"guess task, {args.steps} steps x {args.groups} groups x {args.group_size} rollouts; "
        f"think time lognormal(median {args.think_median_s} s, sigma {args.think_sigma}) "
        "before each call",
        f"{'mode':8}{'loop s':>10}{'s/step':>10}{'idle':>8}{'train s':>10}"
        f"{'reward':>9}{'stale':>8}{'dropped':>9}",
    ]
    for mode, r in results.items():
        lines.append(
            f"{mode:8}{r['loop_s']:>10.1f}{r['s_per_step']:>10.2f}{r['idle']:>8.0%}"
            f"{r['train_s']:>10.1f}{r['reward']:>9.3f}{r['staleness']:>8.2f}{r['dropped']:>9.1%}"
        )
    speedup = sync["loop_s"] / asyn["loop_s"]
    lines.append(f"async speed-up (sync loop time / async loop time): {speedup:.2f}x")
    sys.stdout.write("\n".join(lines) + "\n")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": None}, **results}, indent=2))


if __name__ == "__main__":
    main()
