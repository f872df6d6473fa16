"""``bench/gpu_check.py`` in its CPU dry run: every part runs tiny and writes its JSON with
the keys the GPU run writes; and its runner keeps what a part saved when the part runs
over its budget or dies. It checks outcomes (exactness where the CPU gives it, the budget
bounding the engine, the weight-sync bytes arriving intact), never how fast anything is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpu_check
from bench.gpu.record import Context, Report
from bench.gpu_check import PARTS, Part

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=280,
    )
    return done, out


def _part(out: Path, number: int) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(
        (out / f"part{number}_{PARTS[number].name}.json").read_text()
    )
    assert result["status"] == "ok", result
    assert result["dry_run"] is True and result["device"] == "cpu"
    return result["results"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_dry_run_runs_every_part_and_says_so(dry_run: tuple[Any, Path]) -> None:
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    for number, part in PARTS.items():
        assert f"part {number} {part.name}: ok" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert {p["status"] for p in summary["parts"].values()} == {"ok"}
    assert summary["environment"]["dry_run"] is True


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_dry_run_measures_what_the_gpu_run_measures(dry_run: tuple[Any, Path]) -> None:
    _, out = dry_run
    logprobs = _part(out, 1)
    assert logprobs["fp32"]["max_abs_diff_forward"] < 1e-4  # fp32 on a CPU: exact to rounding
    assert logprobs["fp32"]["max_abs_diff_packed"] < 1e-4
    assert logprobs["bf16"]["tokens"] == logprobs["fp32"]["tokens"] > 0

    train = _part(out, 2)
    assert train["passed"] and [s["step"] for s in train["steps"]] == [1, 2]
    assert "backend.device=cpu" in train["overrides"]

    ppo = _part(out, 3)
    assert set(ppo) == {"0.5b-fp32", "0.5b-bf16", "0.5b-bf16-no-master", "1.5b-bf16"}
    for case in ("0.5b-fp32", "0.5b-bf16", "1.5b-bf16"):  # fp32 weights move at lr 1e-6
        assert ppo[case]["optimizer_dtype"] == "float32"
        assert ppo[case]["changed_optimizer"] > 0.9, ppo[case]
    bare = ppo["0.5b-bf16-no-master"]  # bf16 weights mostly round the update away
    assert bare["optimizer_dtype"] == "bfloat16" and bare["changed_optimizer"] < 0.5
    assert all(c["step_s"] > 0 and c["peak_gib"] is None for c in ppo.values())

    throughput = _part(out, 4)
    for batch in (1, 8, 32, 128):
        run = throughput[f"batch_{batch}"]
        assert run["generated"] == batch * run["new_tokens"] and run["max_running"] == batch
    budgeted = throughput["batch_128_kv_budget"]
    assert budgeted["generated"] == 128 * budgeted["new_tokens"]
    assert 0 < budgeted["max_running"] < 128  # the budget held rows back
    assert budgeted["kv_slab_gib"] <= budgeted["kv_cache_gib"]

    sync = _part(out, 5)
    assert sync["gloo_broadcast"]["verified"] is True
    assert sync["buckets"] > 1 and sync["gb"] > 0
    assert set(sync["bucket"]) == {"pack", "to_cpu"}
    assert sync["safetensors"]["read"]["s"] > 0 and "skipped" in sync["nccl_broadcast"]


def _sleeps(ctx: Context) -> None:
    ctx.report.results["measured"] = 1
    ctx.report.save()
    time.sleep(60)


def _dies(ctx: Context) -> None:
    ctx.report.results["measured"] = 1
    ctx.report.save()
    os._exit(3)  # as a segfault would: nothing saved after this


@pytest.mark.parametrize(
    ("run", "status", "error"),
    [(_sleeps, "timeout", "ran past its 1 s budget"), (_dies, "error", "exit code 3")],
    ids=["over budget", "dies"],
)
def test_a_part_that_overruns_or_dies_keeps_what_it_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: Any, status: str, error: str
) -> None:
    monkeypatch.setitem(PARTS, 9, Part("probe", run, 1, 1))
    monkeypatch.setattr(gpu_check, "GRACE_S", 0.5)
    result = gpu_check.run_isolated(9, tmp_path, dry_run=True)
    saved = json.loads((tmp_path / "part9_probe.json").read_text())
    assert saved == result
    assert (saved["status"], saved["error"]) == (status, error)
    assert saved["results"] == {"measured": 1}


def test_a_failed_measurement_is_kept_and_the_next_one_runs(tmp_path: Path) -> None:
    report = Report(tmp_path / "part.json", 1, "probe", True, "cpu", 10)

    def fails() -> dict[str, Any]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    report.measure("big", fails)
    report.measure("small", lambda: {"s": 1.0})
    saved = json.loads((tmp_path / "part.json").read_text())
    assert saved["results"]["big"]["error"] == (
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    assert "Traceback" in saved["results"]["big"]["traceback"]
    assert saved["results"]["small"] == {"s": 1.0}
    assert report.errors == [
        "big: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    ]


def test_unknown_parts_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--parts", "1,7", "--out", str(tmp_path)])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert "parts are numbers among [1, 2, 3, 4, 5]" in error.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())  # refused before anything ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_full_check_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--out", str(tmp_path)])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "python -m bench.gpu_check: no CUDA device here; --dry-run runs every part on the CPU\n"
    )
