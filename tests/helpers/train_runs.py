"""``python -m agl.train`` as a subprocess, for tests of whole runs: the small settings, and
what a finished run left in its folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from agl.core.contracts.records import MODEL_REQUEST
from tests.helpers.stored_events import stored_events

ROOT = Path(__file__).resolve().parents[2]

# A few small steps: enough to see every part work, not to learn.
SMALL = [
    "trainer.steps=2",
    "trainer.groups_per_step=4",
    "trainer.group_size=8",
    "trainer.val_every=1",
    "trainer.val_size=4",
    "trainer.checkpoint_every=1",
    "task.warmup_options.steps=30",
    "logging.wandb=false",
    "logging.progress=false",
    "controller.concurrency=32",
]


def run_train(
    run_dir: Path,
    *overrides: str,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``python -m agl.train`` with ``SMALL`` and ``overrides``, its run folder ``run_dir``."""
    return subprocess.run(
        [sys.executable, "-m", "agl.train", *SMALL, *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def one_line_error(run_dir: Path, *overrides: str) -> str:
    """The run's error, after checking it failed as a user error: exit 2, no traceback."""
    result = run_train(run_dir, *overrides, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stderr.strip().splitlines()[-1]


def recorded(run_dir: Path) -> list[dict[str, Any]]:
    """The ``model_request`` events the gateway stored (read after the run stopped it)."""
    return [e.data for e in stored_events(run_dir / "gateway" / "gateway.db", MODEL_REQUEST)]


def trained_two_steps(run_dir: Path) -> list[dict[str, Any]]:
    """Check a finished ``SMALL`` run trained steps 1 and 2 and served each new policy;
    answers the two steps' metrics."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [row for row in map(json.loads, lines) if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(row["train/tokens_trained"] > 0 for row in steps)
    # A step whose groups all have one reward has no gradient; twice in a row is rare.
    assert any(row["train/grad_norm"] > 0 for row in steps)
    assert {0, 1, 2} <= {c["policy_version"] for c in recorded(run_dir)}
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == "step-000002"
    return steps
