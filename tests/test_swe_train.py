"""``python -m agl.train --config-name swe`` end to end on tasks the pipeline made: the
policy drives mini-swe-agent through the proxy, its commands run in the sandbox, the
grader runs the task's tests, and the trainer steps on the rewards it posted. The tiny
model (random weights, fast) stands in for SmolLM2 here: this checks the wiring, not
learning."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from agl.backends.execution.confine import unavailable
from agl.grading import GRADE_EVENT
from agl.train import CONF, train
from experiments.swe import pipeline

needs_namespaces = pytest.mark.skipif(
    unavailable() is not None, reason=f"no namespaces here: {unavailable()}"
)


@needs_namespaces
def test_a_short_run_trains_on_the_graders_rewards(tmp_path: Path) -> None:
    data = tmp_path / "swe"
    for argv in (
        ["make", "--projects", "schema", "--per-project", "6", "--out", str(data)],
        ["filter", "--out", str(data)],
        ["split", "--test", "1", "--out", str(data)],
    ):
        assert pipeline.main(argv) == 0, argv
    split = data / pipeline.SPLIT
    overrides = [
        "model=tiny",
        f"task.train_files={split / 'train.jsonl'}",
        f"task.val_files={split / 'test.jsonl'}",
        f"task.options.mirror={data / pipeline.MIRROR}",
        "task.options.step_limit=2",
        "task.sampling.max_tokens=48",
        "trainer.steps=2",
        "trainer.groups_per_step=2",
        "trainer.group_size=2",
        "trainer.val_every=2",
        "trainer.val_size=1",
        "logging.wandb=false",
        "logging.progress=false",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="swe", overrides=overrides)
    run = tmp_path / "run"
    history = train(cfg, run)
    steps = [row for row in history if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["rollouts/finished"] == 4 and row["rollouts/failed"] == 0
    assert any("val/reward" in row for row in history)
    with sqlite3.connect(run / "gateway" / "gateway.db") as db:
        grades = [
            json.loads(d)
            for (d,) in db.execute("SELECT data FROM events WHERE type = ?", (GRADE_EVENT,))
        ]
        calls = db.execute("SELECT count(*) FROM events WHERE type = 'model_request'").fetchone()
    assert len(grades) >= 8  # every rollout trained on was graded
    for grade in grades:  # the real tests ran: a random policy fixes nothing
        assert grade["resolved"] is False and grade["fail_to_pass"][1] > 0
        assert grade["pass_to_pass"][1] > 0
    assert calls[0] >= 9  # mini-swe-agent asked the policy through the proxy
