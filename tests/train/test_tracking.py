"""metrics.jsonl: one line per step, also across a resume from an older checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from agl.core.run.tracking import Tracker


def test_a_resumed_run_redoes_the_steps_after_its_checkpoint(tmp_path: Path) -> None:
    first = Tracker(tmp_path, {})
    for step in range(5):
        first.log(step, {"reward": float(step)})
    first.close()
    resumed = Tracker(tmp_path, {}, resume=True)
    assert [row["step"] for row in resumed.history] == [0, 1, 2, 3, 4]
    resumed.log(3, {"reward": 30.0})  # the checkpoint was at step 2
    resumed.log(4, {"reward": 40.0})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward"]) for r in rows] == [(0, 0), (1, 1), (2, 2), (3, 30), (4, 40)]


def test_non_finite_values_are_written_as_null(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, {})
    tracker.log(1, {"loss": float("nan"), "reward": 0.5})
    tracker.close()
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row == {"step": 1, "loss": None, "reward": 0.5}
