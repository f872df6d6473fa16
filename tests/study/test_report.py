"""``python -m agl.report``: plots, final figures and index.html for one run or a sweep,
from run folders shaped like the ones ``python -m agl.train`` writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from agl.report import CHOICES, METRICS, find_runs, image_name, label_runs, main
from agl.train import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _config(merge: str) -> dict[str, Any]:
    """The resolved config.yaml's shape (as agl.train writes it), the parts a report reads
    and a few around them."""
    return {
        "merge": {"name": merge},
        "advantage": {"name": "rollout", "estimator": "grpo", "scale": True},
        "loss": {"name": "rollout_mean"},
        "model": {"name": "tiny", "seed": 0, "max_context": 2048, "dtype": "float32"},
        "task": {"name": "guess", "harness": "experiments.guess.harness:run", "timeout_s": 60},
        "backend": {"name": "torch", "lr": 0.001, "betas": [0.9, 0.999], "device": "cpu"},
        "trainer": {"mode": "sync", "steps": 3, "groups_per_step": 4, "group_size": 8},
        "resume": False,
        "seed": 0,
    }


def _val_row(step: int, val: float) -> dict[str, Any]:
    return {"step": step, "val/reward": val, "val/failed": 0.0, "time/val_s": 0.67}


def _train_row(step: int, reward: float, samples_per_rollout: float, val: float) -> dict[str, Any]:
    """A training step's line, with the keys of a real ``agl.train`` run (trimmed values)."""
    return {
        "step": step,
        "rollouts/finished": 32.0,
        "rollouts/failed": 0.0,
        "reward/mean": reward,
        "calls/per_rollout": 2.59,
        "staleness/mean": 0.0,
        "staleness/dropped_calls": 0.0,
        "merge/samples_per_rollout": samples_per_rollout,
        "merge/single_sample_rollouts": 0.875,
        "merge/stitched_calls": 0.0,
        "merge/breaks/response_retokenized": 0.125,
        "train/loss": 0.048,
        "train/entropy": 0.82 + 0.1 * step,
        "train/clip_fraction": 0.091,
        "train/kl_behaviour": 0.063,
        "train/grad_norm": 0.99,
        "train/tokens_computed": 2304.0,
        "train/tokens_trained": 514.0,
        "policy_version": float(step),
        "time/train_s": 0.76,
        "time/sync_s": 0.005,
        "samples": 36.0,
        "groups": 4.0,
        "time/rollout_s": 1.66,
        "val/reward": val,
        "val/failed": 0.0,
        "time/val_s": 0.49,
        "time/step_s": 2.91,
        "inference/busy_s": 2.19,
        "throughput/generated_tokens_per_s": 347.6,
        "throughput/train_tokens_per_s": 3045.4,
    }


def _write_run(folder: Path, config: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "train.log").write_text("")
    return folder


def _rows(
    rewards: list[float], samples_per_rollout: float, vals: list[float]
) -> list[dict[str, Any]]:
    """Step 0 is validation only, as in a real run (val_every=1)."""
    return [_val_row(0, vals[0])] + [
        _train_row(step, reward, samples_per_rollout, val)
        for step, (reward, val) in enumerate(zip(rewards, vals[1:], strict=True), start=1)
    ]


def _assert_pngs(out: Path, keys: list[str]) -> None:
    for key in keys:
        (metric,) = [m for m in METRICS if m.key == key]
        data = (out / image_name(metric)).read_bytes()
        assert data[:8] == PNG_MAGIC
        assert len(data) > 5_000  # axes, a line and a legend, not an empty canvas


def test_a_single_run_is_labelled_by_all_its_choices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _write_run(
        tmp_path / "run",
        _config("prefix"),
        _rows([0.3125, 0.5, 0.40625], 1.125, [0.0, 0.25, 0.75, 0.5]),
    )
    assert main([str(run)]) == 0
    out = run / "report"
    assert capsys.readouterr().out == f"report: {out / 'index.html'}\n"
    _assert_pngs(out, [m.key for m in METRICS])
    page = (out / "index.html").read_text()
    for metric in METRICS:
        assert f'src="{image_name(metric)}"' in page
    assert "merge=prefix advantage=rollout loss=rollout_mean mode=sync" in page
    # Last and best train reward, last and best validation reward, samples per rollout.
    for figure in ("0.406", "0.500", "0.750", "1.12", "87.5%", "3045"):
        assert f"<td>{figure}</td>" in page
    assert "In no run" not in page


def test_a_multirun_compares_runs_by_the_choices_that_differ(tmp_path: Path) -> None:
    sweep = tmp_path / "multirun"
    _write_run(
        sweep / "0-prefix-rollout-rollout_mean-sync",
        _config("prefix"),
        _rows([0.25, 0.5], 1.2, [0.0, 0.25, 0.375]),
    )
    _write_run(
        sweep / "1-tree-rollout-rollout_mean-sync",
        _config("tree"),
        _rows([0.125, 0.625], 1.0, [0.0, 0.5, 0.875]),
    )
    (sweep / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    (sweep / ".hydra").mkdir()  # not a run: holds no metrics.jsonl
    out = tmp_path / "elsewhere"
    assert main([str(sweep), "--out", str(out)]) == 0
    _assert_pngs(out, [m.key for m in METRICS])
    page = (out / "index.html").read_text()
    assert "<td>merge=prefix</td>" in page and "<td>merge=tree</td>" in page
    assert "advantage=" not in page and "mode=" not in page  # the same in both runs
    assert page.index("<td>merge=prefix</td>") < page.index("<td>merge=tree</td>")
    assert "<td>0.625</td>" in page and "<td>0.875</td>" in page
    assert "<td>1.20</td>" in page and "<td>1.00</td>" in page


def test_a_metric_no_run_has_is_not_plotted_and_the_page_says_so(tmp_path: Path) -> None:
    rows = _rows([0.5], 1.0, [0.0, 0.5])
    for row in rows:
        row.pop("throughput/train_tokens_per_s", None)
    run = _write_run(tmp_path / "run", _config("stitch"), rows)
    assert main([str(run)]) == 0
    (missing,) = [m for m in METRICS if m.key == "throughput/train_tokens_per_s"]
    assert not (run / "report" / image_name(missing)).exists()
    page = (run / "report" / "index.html").read_text()
    assert "In no run, so not plotted" in page and missing.key in page
    assert image_name(missing) not in page


def test_runs_in_job_order_and_only_folders_with_metrics(tmp_path: Path) -> None:
    for name in ("10-tree-rollout-rollout_mean-sync", "2-prefix-rollout-rollout_mean-sync"):
        _write_run(tmp_path / name, _config(name.split("-")[1]), [_val_row(0, 0.0)])
    (tmp_path / "report").mkdir()
    assert [p.name for p in find_runs(tmp_path)] == [
        "2-prefix-rollout-rollout_mean-sync",
        "10-tree-rollout-rollout_mean-sync",
    ]


def _report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agl.report", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (['{"step": 0, "val/reward": 0.0}', '{"step": 1, "reward/mean": 0.5'], ":2: malformed"),
        (['{"reward/mean": 0.5}'], ":1: malformed metrics line: no integer 'step'"),
        (['{"step": 1, "reward/mean": "high"}'], ":1: malformed metrics line: 'reward/mean'"),
    ],
)
def test_a_malformed_metrics_line_is_one_line_naming_file_and_line(
    tmp_path: Path, lines: list[str], expected: str
) -> None:
    run = _write_run(tmp_path / "run", _config("prefix"), [])
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    result = _report(str(run))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"agl.report: {run / 'metrics.jsonl'}{expected}")


@pytest.mark.parametrize("make", [False, True])
def test_no_run_is_one_line(tmp_path: Path, make: bool) -> None:
    folder = tmp_path / "nothing"
    if make:
        (folder / "empty-subfolder").mkdir(parents=True)
    result = _report(str(folder))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"agl.report: no run (metrics.jsonl) under {folder}")
    assert result.stdout == ""


_WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=8)
_CHOICE_NAMES = [name for name, _ in CHOICES]


@given(
    st.lists(
        st.tuples(_WORD, st.dictionaries(st.sampled_from(_CHOICE_NAMES), st.sampled_from("abc"))),
        min_size=1,
        max_size=6,
        unique_by=lambda run: run[0],
    )
)
def test_distinct_runs_get_distinct_labels_naming_the_choices_that_differ(
    runs: list[tuple[str, dict[str, str]]],
) -> None:
    names = [name for name, _ in runs]
    choices = [c for _, c in runs]
    labels = label_runs(choices, names)
    assert len(set(labels)) == len(labels)
    for name in _CHOICE_NAMES:
        values = {c.get(name) for c in choices}
        for c, label in zip(choices, labels, strict=True):
            if name in c and (len(runs) == 1 or len(values) > 1):
                assert f"{name}={c[name]}" in label
            elif len(runs) > 1 and len(values) == 1:
                assert f"{name}=" not in label


@pytest.mark.slow
def test_a_real_sweep(tmp_path: Path) -> None:
    """Two one-step runs of ``agl.train -m`` (about 20 s), then the report on their folder."""
    sweep = tmp_path / "sweep"
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "agl.train",
            "-m",
            "merge=prefix,tree",
            "trainer.steps=1",
            "trainer.groups_per_step=2",
            "trainer.group_size=4",
            "trainer.val_every=1",
            "trainer.val_size=2",
            "task.warmup_options.steps=30",
            "logging.wandb=false",
            "logging.progress=false",
            f"hydra.sweep.dir={sweep}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    result = _report(str(sweep))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"report: {sweep / 'report' / 'index.html'}\n"
    page = (sweep / "report" / "index.html").read_text()
    assert "<td>merge=prefix</td>" in page and "<td>merge=tree</td>" in page
    _assert_pngs(sweep / "report", ["reward/mean", "val/reward", "merge/samples_per_rollout"])
    for metric in METRICS:
        assert (f'src="{image_name(metric)}"' in page) == (
            sweep / "report" / image_name(metric)
        ).exists()
