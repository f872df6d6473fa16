"""Part 2: the device order through ``agl.train``: a 2-step run of the default experiment
(tiny model, guess task, embedded engine, torch backend) with ``backend.device=cuda``.

The run is ``python -m agl.train`` in a process group of its own, under a timeout (SIGTERM
stops every part of a run cleanly; SIGKILL to the group if it does not). What it checks:
the run exits 0 and trained steps 1 and 2 (a device mismatch between the engine, built
before the backend moves the model, and the model fails the rollouts or the step). What it
reports: exit code, the last stderr line on failure, and each step's timings and counts.
The run folder is a temporary one (the gateway's store, checkpoints); its
``metrics.jsonl``, ``train.log``, ``config.yaml`` and stderr are copied to
``OUT/part2_run/``. The dry run is the same run on the CPU, smaller and without the
warm-up (every reward 0 then: the step runs, its gradient is 0).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.gpu.record import Context

ROOT = Path(__file__).resolve().parents[2]
STEP_KEYS = (
    "step",
    "reward/mean",
    "samples",
    "train/tokens_trained",
    "train/grad_norm",
    "train/logprob_mismatch",
    "time/rollout_s",
    "time/train_s",
    "time/step_s",
    "throughput/generated_tokens_per_s",
)


def overrides(device: str, dry_run: bool) -> list[str]:
    """The run's Hydra overrides: small, W&B off. The full run keeps the short warm-up of
    the tests' small runs (``tests/helpers/train_runs.py``), after which rewards differ and
    the gradient is not 0; the optimizer steps on the device either way."""
    small = [
        f"backend.device={device}",
        "trainer.steps=2",
        "trainer.groups_per_step=2" if dry_run else "trainer.groups_per_step=4",
        "trainer.group_size=2" if dry_run else "trainer.group_size=8",
        "trainer.val_every=0" if dry_run else "trainer.val_every=1",
        "trainer.val_size=4",
        "trainer.checkpoint_every=0" if dry_run else "trainer.checkpoint_every=1",
        "controller.concurrency=8",
        "logging.wandb=false",
        "logging.progress=false",
    ]
    if dry_run:
        return [*small, "task.warmup=null"]
    return [*small, "task.warmup_options.steps=30"]


def _run(args: list[str], run_dir: Path, log: Path, timeout_s: float) -> int | None:
    """Exit code (None: timed out) of ``python -m agl.train``; its stderr goes to ``log``."""
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "agl.train", *args, f"hydra.run.dir={run_dir}"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, "WANDB_MODE": "offline"},
            start_new_session=True,  # its gateway and agent workers die with it
        )
        try:
            code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return code


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: row.get(k) for k in STEP_KEYS} for row in rows if "reward/mean" in row]


def run(ctx: Context) -> None:
    args = overrides(ctx.device, ctx.dry_run)
    ctx.report.results["overrides"] = args
    ctx.report.save()
    # The run folder (gateway store, checkpoints) is a temporary one; its logs are kept.
    kept = ctx.out / "part2_run"
    kept.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agl-gpu-check-") as tmp:
        run_dir = Path(tmp) / "run"
        code = _run(args, run_dir, kept / "stderr.txt", timeout_s=max(ctx.budget.left() - 25, 10))
        steps = _steps(run_dir)
        for name in ("metrics.jsonl", "train.log", "config.yaml"):
            if (run_dir / name).exists():
                shutil.copy(run_dir / name, kept / name)
    lines = [line for line in (kept / "stderr.txt").read_text().splitlines() if line.strip()]
    trained = [s["step"] for s in steps] == [1, 2]
    ctx.report.results |= {
        "exit_code": code,
        "timed_out": code is None,
        "passed": code == 0 and trained,
        "last_stderr_line": lines[-1] if lines and code != 0 else None,
        "steps": steps,
        "logs": str(kept),
    }
    ctx.report.save()
    if not ctx.report.results["passed"]:
        why = "timed out" if code is None else f"exit {code}"
        raise RuntimeError(f"agl.train {why}: {lines[-1] if lines else 'no stderr'}")
