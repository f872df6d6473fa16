"""``python -m agl.train`` end to end on the tiny model: real gateway process, real agent
workers running the guess harness through the recording proxy, real updates."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from agl.core.run.build import backend_config
from agl.core.trainer.trajectories import COLUMNS
from agl.core.user_error import UserError
from agl.train import CONF, ROOT, check_choices, train
from tests.helpers.processes import alive, descendants
from tests.helpers.train_runs import SMALL, one_line_error, recorded, run_train, trained_two_steps
from tests.helpers.wandb_records import history, tables


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=SMALL + overrides)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_short_run_trains_and_serves_the_new_weights(tmp_path: Path, mode: str) -> None:
    schedule = ["backend.lr_scheduler_type=cosine", "backend.lr=1e-3"]
    cfg = _compose(
        [
            f"trainer.mode={mode}",
            "trainer.max_inflight_groups=6",
            "trainer.val_samples=2",
            *schedule,
        ]
    )
    history = train(cfg, tmp_path)
    steps = [row for row in history if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1, 2]
    # the cosine runs over trainer.steps (2): factor 1, then (1 + cos(π/2)) / 2
    assert [row["train/lr"] for row in steps] == pytest.approx([1e-3, 5e-4])
    for row in steps:
        assert row["samples"] > 0
        assert row["train/tokens_trained"] > 0
        assert 0 <= row["reward/mean"] <= 1
    # An optimizer step changed the weights (a step whose groups all have one reward has
    # no gradient; with 4 groups of 8 that is vanishingly rare twice in a row).
    assert any(row["train/grad_norm"] > 0 for row in steps)
    validations = [row for row in history if "val/reward" in row]
    assert validations and all(row["val/rollouts"] == 8 for row in validations)  # 4 x 2
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(history)
    assert (tmp_path / "config.yaml").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == "step-000002"
    calls = recorded(tmp_path)
    versions = {c["policy_version"] for c in calls}
    assert {0, 1, 2} <= versions  # the proxy served each new version after its update
    for call in calls:
        assert len(call["logprobs"]) == len(call["response_ids"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [
        ["task.sampling.temperature=0.7"],
        ["task.sampling.temperature=0.7", "+task.sampling.top_p=0.9"],
    ],
    ids=["T=0.7", "T=0.7 top_p=0.9"],
)
def test_the_first_step_scores_what_was_sampled(tmp_path: Path, sampling: list[str]) -> None:
    """Every ratio is 1 where the policy has not moved: the trainer scores each token under
    the temperature and top-p it was sampled under. Before, at T = 0.7 the first step's
    mismatch was 0.025 and 4.6% of tokens were clipped."""
    history = train(_compose(sampling), tmp_path)
    first = next(row for row in history if "train/logprob_mismatch" in row)
    assert first["train/logprob_mismatch"] < 1e-4
    assert first["train/tokens_trained"] > 0
    calls = recorded(tmp_path)
    assert {c["sampling"]["temperature"] for c in calls} == {0.7}
    assert {c["sampling"]["top_p"] for c in calls} == {0.9 if len(sampling) > 1 else 1.0}


@pytest.mark.slow
def test_backend_verl_trains_through_verls_actor(tmp_path: Path) -> None:
    """``backend=verl``: verl's own actor update (its FSDP2 engine, in-process on CPU)
    trains the module the embedded server serves. A subprocess: verl starts a process
    group, which must not outlive the test."""
    pytest.importorskip(
        "verl", reason="backend=verl needs verl 0.9.1: pip install --no-deps verl==0.9.1"
    )
    result = run_train(tmp_path, "backend=verl")
    assert result.returncode == 0, result.stderr[-3000:]
    trained_two_steps(tmp_path)


def test_backend_verl_without_verl_is_a_one_line_error_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "verl" else real(name, *a)
    )
    with pytest.raises(UserError, match=r"backend=verl needs verl 0\.9\.1, which is not installed"):
        backend_config({"name": "verl", "lr": 1e-3}, steps=2)


@pytest.mark.slow
def test_resume_continues_without_recounting(tmp_path: Path) -> None:
    train(_compose([]), tmp_path)
    history = train(_compose(["trainer.steps=3", "resume=true"]), tmp_path)
    steps = [row["step"] for row in history if "reward/mean" in row]
    assert steps == [1, 2, 3]


def test_bad_choices_are_one_line_errors() -> None:
    assert check_choices(["merge=prefix", "advantage=rollout"]) is None
    message = check_choices(["merge=prefx"])
    assert message is not None and "unknown merge 'prefx'" in message and "prefix" in message
    result = subprocess.run(
        [sys.executable, "-m", "agl.train", "loss=nope"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "unknown loss 'nope'" in result.stderr


@pytest.mark.slow
def test_multirun_sweeps_two_strategies(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "agl.train",
            "-m",
            "merge=prefix,tree",
            *[o for o in SMALL if not o.startswith(("trainer.steps", "logging.wandb"))],
            "trainer.steps=1",
            "logging.wandb=true",  # offline: WANDB_MODE below
            f"hydra.sweep.dir={sweep}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "WANDB_MODE": "offline"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists())
    assert [p.name for p in runs] == [
        "0-prefix-rollout-rollout_mean-sync",
        "1-tree-rollout-rollout_mean-sync",
    ]
    for run in runs:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert any(row.get("samples", 0) > 0 for row in rows)
        (wandb_run,) = (run / "wandb").glob("offline-run-*")  # one W&B run per sweep run
        # Read back from W&B's own log: each step's trajectories, train and validation.
        logged = history(wandb_run)
        val = [r for r in logged if "val/reward" in r]
        assert val and all(
            r["val/reward_ci95_low"] <= r["val/reward"] <= r["val/reward_ci95_high"] for r in val
        )
        train_tables, val_tables = (
            tables(wandb_run, f"{mode}/trajectories") for mode in ("train", "val")
        )
        assert sorted(train_tables) == [1] and sorted(val_tables) == [0, 1]
        (train_table,) = train_tables.values()
        assert train_table["columns"] == COLUMNS
        assert len(train_table["data"]) == 8  # of the step's 4 x 8 rollouts
        # 8 of the 4 + 4 (the task's set and its uniform one): all of them.
        assert all(len(t["data"]) == 8 for t in val_tables.values())
        for row in train_table["data"]:
            cell = dict(zip(COLUMNS, row, strict=True))
            assert 0 <= cell["reward"] <= 1 and cell["turns"] >= 1
            assert cell["samples"] >= 1 and "── sample 1 ──" in cell["conversation"]
            assert len(cell["conversation"]) <= 4000
            if run.name.startswith("1-tree"):
                assert cell["samples"] == 1 and cell["breaks"] == ""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_nothing_outlives_a_stopped_run(tmp_path: Path, how: signal.Signals) -> None:
    overrides = [o for o in SMALL if not o.startswith("trainer.steps")]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agl.train",
            *overrides,
            "trainer.steps=1000",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, "the run made no step"
        time.sleep(0.2)
    children = descendants(process.pid)
    assert len(children) >= 2  # the gateway and at least one agent worker
    process.send_signal(how)
    process.wait(timeout=60)
    if how is signal.SIGINT:
        assert process.returncode == 130
        assert "interrupted" in (process.stderr.read() if process.stderr else "")
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in children):
        assert time.monotonic() < deadline, [p for p in children if alive(p)]
        time.sleep(0.1)


def _taken_port() -> socket.socket:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


@pytest.mark.slow
def test_a_port_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    with _taken_port() as taken:
        port = taken.getsockname()[1]
        error = one_line_error(tmp_path, f"gateway.port={port}")
    assert error == f"agl.train: gateway port {port} on 127.0.0.1 is in use"


@pytest.mark.slow
def test_an_inference_port_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    with _taken_port() as taken:
        port = taken.getsockname()[1]
        error = one_line_error(tmp_path, f"inference.port={port}")
    expected = f"agl.train: inference=embedded: cannot serve the model on 127.0.0.1:{port}"
    assert error.startswith(expected)


@pytest.mark.slow
def test_a_missing_vllm_is_a_one_line_error(tmp_path: Path) -> None:
    error = one_line_error(
        tmp_path / "run", "inference=vllm", f"inference.python={tmp_path / 'no-vllm' / 'python'}"
    )
    assert error.startswith("agl.train: inference=vllm: vLLM's python is not found; install")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_run_carries_on_when_its_gateway_is_killed(tmp_path: Path) -> None:
    """kill -9 of the gateway while agents call through it: the run restarts it on its
    store, agents and trainer ride out the gap, and every step is trained."""
    overrides = [o for o in SMALL if not o.startswith("trainer.steps")]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agl.train",
            *overrides,
            "trainer.steps=3",
            "trainer.mode=async",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, "the run made no step"
        time.sleep(0.2)
    (gateway,) = [pid for pid in descendants(process.pid) if "agl.gateway" in _cmdline(pid)]
    os.kill(gateway, signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert "restarting it on its store" in stderr
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in steps if "reward/mean" in row] == [1, 2, 3]
    assert all(row["samples"] > 0 for row in steps if "reward/mean" in row)
    assert {c["policy_version"] for c in recorded(tmp_path)} >= {0, 1, 2}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
