"""The study report's analysis (agl/study/report.py) on run folders written here, shaped
like the ones ``python -m agl.study`` leaves: endpoints fixed in the study's yaml, each
setting against the reference paired by seed, one Holm family over every tested
comparison, the detectable difference next to each verdict, by-construction rows shown
and not tested, bounded intervals clipped. Every figure is recomputed here with scipy
from the same synthetic series, and the committed studies' reports still build."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import yaml
from scipy import stats as scipy_stats

from agl.core.user_error import UserError
from agl.study import stats
from agl.study.__main__ import main
from agl.study.report import bounded_interval, comparisons, load_settings, summary
from agl.study.runner import DONE_FILE, run_folder
from agl.study.spec import load_study

ROOT = Path(__file__).resolve().parents[2]
SEEDS = [0, 1, 2, 3, 4]
# Each seed's warm-up: far apart, as the pinned ones are; pairing cancels them out.
SEED_SHIFT = [0.0, 0.1, -0.05, 0.2, 0.03]
NOISE = [0.004, -0.003, 0.001, -0.004, 0.002]  # per seed, small against the shifts
STEPS = range(1, 7)
VAL_STEPS = [0, 2, 4, 6]

STUDY: dict[str, Any] = {
    "seeds": SEEDS,
    "seeds_fixed_before_running": True,
    "preregistration": "Seeds 0-4 and the endpoints below fixed before the first run.",
    "reference": "ref",
    "settings": {"ref": [], "up": ["loss=token_mean"], "same": ["loss=seq_mean"], "tree": []},
    "endpoints": [
        {
            "name": "manipulation check",
            "metric": "train/net_push",
            "reduction": {"at_step": 1},
            "bounds": [-1, 1],
        },
        {"name": "entropy slope", "metric": "train/entropy", "reduction": "slope"},
        {"name": "reward AUC", "metric": "val/reward", "reduction": "auc", "bounds": [0, 1]},
        {"name": "final reward", "metric": "val/reward", "reduction": "last", "bounds": [0, 1]},
        {"name": "wall time", "metric": "time/wall_s", "test": False},
    ],
    "by_construction": {"tree": ["merge/samples_per_rollout"]},
}


def _net_push(setting: str, seed: int) -> float:
    """``up`` pushes 0.2 further toward negative than the reference, at every seed."""
    base = 0.1 + SEED_SHIFT[seed] / 10
    if setting == "up":
        return base - 0.2 + NOISE[seed]
    return base if setting == "ref" else base + 5 * NOISE[seed] * (-1) ** seed


def _entropy(setting: str, seed: int, step: int) -> float:
    # ``same`` and ``tree`` wobble around the reference's slope: a difference equal at
    # every seed would leave the paired test no spread (and go untested).
    wobble = NOISE[seed] / 100 if setting != "ref" else 0.0
    slope = 0.01 + (0.005 + NOISE[seed] / 10 if setting == "up" else wobble)
    return 0.5 + SEED_SHIFT[seed] + slope * step + (NOISE[seed] if setting == "same" else 0.0)


def _reward(setting: str, seed: int, step: int) -> float:
    wobble = 3 * NOISE[seed] * (-1) ** (seed + step) if setting != "ref" else 0.0
    return 0.3 + SEED_SHIFT[seed] + 0.05 * step + wobble


def _rows(setting: str, seed: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"step": 0, "val/reward": _reward(setting, seed, 0)}]
    for step in STEPS:
        row = {
            "step": step,
            "train/net_push": _net_push(setting, seed) if step == 1 else 0.0,
            "train/entropy": _entropy(setting, seed, step),
            "merge/samples_per_rollout": 1.0 if setting == "tree" else 2.5 + NOISE[seed],
            "time/step_s": 10.0 + seed + step,
        }
        if step in VAL_STEPS:
            row["val/reward"] = _reward(setting, seed, step)
        rows.append(row)
    return rows


def _write_study(tmp_path: Path, study: dict[str, Any], skip: set[tuple[str, int]]) -> Path:
    """The study's yaml and its finished run folders under ``tmp_path/out``."""
    out = tmp_path / "out"
    for setting in study["settings"]:
        for seed in study["seeds"]:
            if (setting, seed) in skip:
                continue
            folder = run_folder(out, setting, seed)
            folder.mkdir(parents=True)
            (folder / "config.yaml").write_text(yaml.safe_dump({"seed": seed}))
            rows = _rows(setting, seed)
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (folder / DONE_FILE).write_text(json.dumps({"setting": setting, "seed": seed}))
    path = tmp_path / "fig.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


@pytest.fixture
def built(tmp_path: Path) -> tuple[Path, str]:
    """The study with ``same`` missing its seed 4; its report, written by the command."""
    path = _write_study(tmp_path, STUDY, skip={("same", 4)})
    report = tmp_path / "report"
    args = [str(path), "--report-only", "--out", str(tmp_path / "out"), "--report", str(report)]
    assert main(args) == 0
    page = (report / "index.html").read_text()
    assert "paired p =" in page
    # An endpoint's metric that the default plots lack is plotted too.
    assert 'src="train_net_push.png"' in page and (report / "train_net_push.png").is_file()
    return path, (report / "summary.md").read_text()


def _expected(setting: str, endpoint: str, seeds: list[int]) -> tuple[list[float], list[float]]:
    """The endpoint's figure per seed, for ``setting`` and the reference, from the
    generators above with scipy (not through the report's reductions)."""

    def figure(s: str, seed: int) -> float:
        if endpoint == "manipulation check":
            return _net_push(s, seed)
        if endpoint == "entropy slope":
            return float(
                scipy_stats.linregress(list(STEPS), [_entropy(s, seed, k) for k in STEPS]).slope
            )
        rewards = [_reward(s, seed, k) for k in VAL_STEPS]
        return sum(rewards) / len(rewards) if endpoint == "reward AUC" else rewards[-1]

    return [figure(setting, k) for k in seeds], [figure("ref", k) for k in seeds]


def test_every_tested_comparison_is_paired_and_holm_adjusted_in_one_family(
    built: tuple[Path, str],
) -> None:
    path, _ = built
    study = load_study(str(path))
    found = comparisons(study, load_settings(study, path.parent / "out"))
    tested = [c for c in found if c.kind == "tested"]
    # 4 tested endpoints x 3 settings; wall time (test: false) and tree's samples per
    # rollout (by construction) are shown, outside the family.
    assert len(tested) == 12 and all(c.family == 12 for c in tested)
    assert [c.endpoint.name for c in tested][::3] == [
        "manipulation check",
        "entropy slope",
        "reward AUC",
        "final reward",
    ]
    for c in tested:
        assert c.seeds == (SEEDS[:4] if c.setting == "same" else SEEDS)
        ours, theirs = _expected(c.setting, c.endpoint.name, c.seeds)
        assert c.values == pytest.approx(ours, rel=1e-9, abs=1e-12)
        assert c.reference_values == pytest.approx(theirs, rel=1e-9, abs=1e-12)
        differences = [a - b for a, b in zip(ours, theirs, strict=True)]
        if statistics.stdev(differences) > 1e-12:
            p = float(scipy_stats.ttest_rel(ours, theirs).pvalue)
            assert c.p == pytest.approx(p, rel=1e-6)
        sd = statistics.stdev(c.differences)
        assert c.detectable == pytest.approx(stats.min_detectable(sd, len(c.seeds), 0.05 / 12))
    assert [c.adjusted_p for c in tested] == stats.holm([c.p for c in tested if c.p is not None])
    verdicts = {(c.setting, c.endpoint.name): c.supported for c in tested}
    assert verdicts["up", "manipulation check"] and verdicts["up", "entropy slope"]
    assert not any(supported for (s, _), supported in verdicts.items() if s == "same")
    (made,) = [c for c in found if c.kind == "by construction"]
    assert (made.setting, made.endpoint.metric, made.p) == (
        "tree",
        "merge/samples_per_rollout",
        None,
    )
    assert made.difference.mean == pytest.approx(-1.5, abs=0.01)
    shown = [c for c in found if c.endpoint.name == "wall time"]
    assert len(shown) == 3 and all(c.kind == "not tested" and c.p is None for c in shown)


def test_each_comparison_is_one_sentence_with_its_verdict_and_detectable_difference(
    built: tuple[Path, str],
) -> None:
    _, text = built
    lines = {line for line in text.splitlines() if line.startswith("- `")}

    def line(start: str) -> str:
        (found,) = [x for x in lines if x.startswith(start)]
        return found

    slope = line("- `up` minus `ref`, entropy slope: +0.00")
    assert "/step [+0.00" in slope and "over 5 paired seeds, paired p = " in slope
    assert "Holm p = " in slope and ": **supported**. With 5 paired seeds a difference of " in slope
    assert slope.endswith("/step would be seen 80% of the time.")
    same = line("- `same` minus `ref`, final reward: ")
    assert (
        "over 4 paired seeds" in same and ": not supported; a true difference smaller than " in same
    )
    assert same.endswith(" would likely not have shown (80% power).")
    tree = line("- `tree` minus `ref`, samples per rollout, last step: -1.5")
    assert tree.endswith(": by construction (what `tree` is makes it so): not tested.")
    assert line("- `up` minus `ref`, wall time: ").endswith(
        ": not tested (the endpoint says test: false)."
    )
    assert "the family is all 12 tested (endpoint, setting) comparisons" in text
    assert "at level 0.05/12 (Holm's first step" in text
    assert "Welch" not in text


def test_the_summary_states_the_design_and_the_endpoints(built: tuple[Path, str]) -> None:
    _, text = built
    assert "- Seeds 0, 1, 2, 3, 4 (5 per setting): fixed before running" in text
    assert "`same` 4" in text and "`ref` 5" in text and "**Not finished**: `same` 4/5" in text
    assert f"- Preregistration: {STUDY['preregistration']}" in text
    endpoints = text.split("## Endpoints")[1].split("##")[0]
    assert (
        "- 1. **manipulation check**: `train/net_push` at step 1; within [-1.0, 1.0]" in endpoints
    )
    assert "- 2. **entropy slope**: `train/entropy` slope per step over its steps" in endpoints
    assert "- 5. **wall time**: `time/wall_s` at the last step; reported, not tested" in endpoints
    assert "| setting | seeds | manipulation check | entropy slope |" in endpoints
    assert "| same | 4 |" in endpoints


def test_intervals_of_bounded_figures_are_clipped_and_say_so(tmp_path: Path) -> None:
    """Rewards near 1 with a wide spread: the t-interval would pass 1, which no run can."""
    study = {**STUDY, "endpoints": STUDY["endpoints"][3:4], "settings": {"ref": []}}
    del study["by_construction"]
    path = _write_study(tmp_path, study, skip=set())
    for seed, reward in zip(SEEDS, [1.0, 0.7, 1.0, 0.99, 0.8], strict=True):
        metrics = run_folder(tmp_path / "out", "ref", seed) / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        rows[-1]["val/reward"] = reward
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_study(str(path))
    text = summary(loaded, load_settings(loaded, tmp_path / "out"))
    table = text.split("## At the last step")[1].split("##")[0]
    (last,) = [x for x in table.splitlines() if x.startswith("| ref")]
    # mean 0.898, sd 0.1397, t(0.975, 4) 2.7764: 0.898 -/+ 0.1735 = [0.725, 1.071] -> 1.
    assert "0.898 [0.725, 1.000] (clipped at 1) |" in last
    table = text.split("## Endpoints")[1].split("##")[0]
    (row,) = [x for x in table.splitlines() if x.startswith("| ref")]
    assert row.endswith("(clipped at 1) |")


def test_a_figure_past_its_bounds_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    study = {**STUDY, "settings": {"ref": [], "up": []}}
    del study["by_construction"]
    study["endpoints"] = [{**STUDY["endpoints"][0], "bounds": [0, 1]}]  # net push can be < 0
    path = _write_study(tmp_path, study, skip=set())
    args = [str(path), "--report-only", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert error.startswith("agl.study: endpoint 'manipulation check': value -0.096 lies")
    assert "outside its bounds [0.0, 1.0]" in error


@pytest.mark.parametrize(
    ("name", "folder", "settings"),
    [
        ("strategies", "experiments/agentic/study", 7),
        ("search", "experiments/search/study", 1),
        ("general", "experiments/general/study", 1),
    ],
)
def test_the_committed_studies_without_endpoints_still_report(
    name: str, folder: str, settings: int
) -> None:
    """Their default: each plotted metric's last value, paired by seed."""
    study = load_study(name)
    loaded = load_settings(study, ROOT / folder)
    assert len(loaded) == settings
    text = summary(study, loaded)
    assert "The study names no endpoints" in text and "**learned**" in text
    if settings > 1:
        found = comparisons(study, loaded)
        family = sum(c.kind == "tested" for c in found)
        # 6 settings x 8 metrics, less tree's 3 by construction and the 6 stitched-call
        # figures that are 0 in every run (no merge there stitched).
        assert family == 6 * 8 - 3 - 6 and all(c.seeds == [0, 1, 2] for c in found)
        assert f"at level 0.05/{family}" in text and "paired p = " in text
        assert not math.isnan(sum(c.detectable or 0.0 for c in found))


def test_tree_s_structural_differences_are_labelled_by_construction() -> None:
    """The committed strategies study declares tree's merge figures by construction: they
    leave Holm's family and are said so, instead of "supported"."""
    declared = load_study("strategies")
    keys = ["merge/samples_per_rollout", "merge/single_sample_rollouts"]
    keys.append("merge/tokens_per_unique_token")
    assert declared.by_construction == {"tree": keys}
    study = dataclasses.replace(declared, by_construction={})
    loaded = load_settings(declared, ROOT / "experiments/agentic/study")
    before = [c for c in comparisons(study, loaded) if c.kind == "tested"]
    found = comparisons(declared, loaded)
    made = [c for c in found if c.kind == "by construction"]
    assert sorted(c.endpoint.metric for c in made) == sorted(keys)
    assert all(c.setting == "tree" and c.p is None for c in made)
    assert sum(c.kind == "tested" for c in found) == len(before) - 3
    text = summary(declared, loaded)
    (line,) = [
        x
        for x in text.splitlines()
        if x.startswith("- `tree` minus `rollout+rollout_mean`, samples per rollout")
    ]
    assert line.endswith("by construction (what `tree` is makes it so): not tested.")


def test_a_default_bound_a_users_figures_break_is_not_applied() -> None:
    """The default metrics' bounds are what agl's own tasks give (a reward in [0, 1]); a
    user's task that rewards -1 gets its interval unclipped, not an error. Bounds a study
    declares for its endpoints stay strict."""
    values = [-1.0, 0.5, 1.0]
    shown = bounded_interval(values, (0.0, 1.0), "val/reward")
    assert (shown.low, shown.high, shown.clipped) == (
        stats.interval(values).low,
        stats.interval(values).high,
        (),
    )
    assert bounded_interval([0.9, 1.0, 0.95], (0.0, 1.0), "val/reward").clipped == (1.0,)
    with pytest.raises(UserError, match=r"value -1\.0 lies outside its bounds"):
        bounded_interval(values, (0.0, 1.0), "endpoint 'x'", strict=True)
