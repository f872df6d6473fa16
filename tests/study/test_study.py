"""``python -m agl.study``, end to end: CI's miniature of the strategies study (two
settings, two seeds, two steps of the agentic game: conf/study/mini.yaml) runs through
real ``agl.train`` runs, writes its report with intervals, bands and statements computed
from the seeds, and a second start skips what is done. The study files parse, and bad
ones get a one-line error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agl.core.run_metrics import Run
from agl.core.user_error import UserError
from agl.study.report import (
    METRICS,
    Setting,
    StudyMetric,
    baseline_lines,
    chart,
    comparison_line,
    comparisons,
    coverage_line,
    learning_lines,
)
from agl.study.spec import STUDIES, Baseline, load_study, parse_study


def _study(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agl.study", *args],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "WANDB_MODE": "offline"},
    )


@pytest.fixture(scope="module")
def mini(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("study") / "mini"
    done = _study("mini", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_miniature_runs_every_setting_at_every_seed(mini: Path) -> None:
    for setting in ("rollout+rollout_mean", "sample+token_mean"):
        for seed in (0, 1):
            run = mini / setting / f"seed-{seed}"
            record = json.loads((run / "study-run.json").read_text())
            assert record["seed"] == seed and f"seed={seed}" in record["command"]
            config = yaml.safe_load((run / "config.yaml").read_text())
            assert config["seed"] == seed and config["logging"]["wandb_group"] == "mini"
            assert config["task"]["name"] == "agentic" and config["backend"]["kl_coef"] == 0.05
            steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()]
            assert steps[-1] == 2
    assert (
        yaml.safe_load((mini / "sample+token_mean" / "seed-0" / "config.yaml").read_text())[
            "advantage"
        ]["name"]
        == "sample"
    )


def test_the_report_has_intervals_bands_and_statements(mini: Path) -> None:
    summary = (mini / "report" / "summary.md").read_text()
    assert "## At the first step" in summary and "## At the last step" in summary
    assert "| rollout+rollout_mean | 2 |" in summary
    assert "[" in summary.split("## At the last step")[1]  # mean [low, high]
    assert "best feedback-blind player" in summary
    assert "paired p =" in summary and "Holm p =" in summary and "80%" in summary
    for png in ("val_reward.png", "merge_samples_per_rollout.png", "time_wall_s.png"):
        assert (mini / "report" / png).stat().st_size > 1000
    assert "val_reward.png" in (mini / "report" / "index.html").read_text()


@pytest.mark.slow
def test_a_second_start_skips_the_finished_runs(mini: Path) -> None:
    done = _study("mini", "--out", str(mini))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("skipped") == 4 and "done in" not in done.stderr


def test_a_start_with_some_seeds_still_reports_the_whole_study(mini: Path) -> None:
    report = mini / "report-seed-1"
    done = _study("mini", "--out", str(mini), "--seeds", "1", "--report", str(report))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("skipped") == 2  # seed 1 of each setting: done already
    summary = (report / "summary.md").read_text()
    assert "Every setting finished its 2 seeds." in summary
    assert "| rollout+rollout_mean | 2 |" in summary


def test_comparisons_are_paired_holm_adjusted_and_name_what_the_seeds_support(mini: Path) -> None:
    study = load_study("mini")
    from agl.study.report import load_settings

    found = comparisons(study, load_settings(study, mini))
    assert found and all(c.setting == "sample+token_mean" for c in found)
    assert all(c.seeds == [0, 1] for c in found)
    tested = [c for c in found if c.p is not None and c.adjusted_p is not None]
    assert tested and all(c.adjusted_p >= c.p for c in tested)


def _setting(name: str, values: list[float]) -> Setting:
    runs = [
        Run(Path(f"{name}{i}"), {}, [{"step": 1, "val/reward": v}]) for i, v in enumerate(values)
    ]
    return Setting(name, runs, list(range(len(values))))


def test_comparing_settings_without_noise() -> None:
    study = parse_study({"settings": {"a": [], "b": []}, "reference": "a"}, "s")
    found = comparisons(study, [_setting("a", [0.5, 0.5]), _setting("b", [0.625, 0.625])])
    (c,) = [c for c in found if c.endpoint.metric == "val/reward"]
    # Every seed 0.125 apart: no spread for a t-test to judge by (rewards on a grid of
    # 1/128 do this by chance), so it is said and not tested, rather than p = 0.
    assert c.difference.mean == pytest.approx(0.125) and c.kind == "no spread"
    assert c.p is None and not c.supported
    assert "not tested (every seed differs by the same amount" in comparison_line(c)


def test_a_figure_every_run_shares_is_not_tested() -> None:
    """Stitched calls 0 in every run of both settings: nothing to test, and left out of
    Holm's family, so that it does not tighten the level of the comparisons that vary."""
    study = parse_study({"settings": {"a": [], "b": []}, "reference": "a"}, "s")
    found = comparisons(study, [_setting("a", [0.0, 0.0]), _setting("b", [0.0, 0.0])])
    (c,) = [c for c in found if c.endpoint.metric == "val/reward"]
    assert c.kind == "no variation" and c.p is None and c.adjusted_p is None
    assert all(x.family == 0 for x in found)
    assert comparison_line(c).endswith("not tested (every run of both gave this same figure).")


def test_what_training_added_is_paired_by_seed() -> None:
    """The gain is each seed's last value minus its own first: seeds that start apart
    and each gain the same are a clear gain; a gain within the noise is no claim."""

    def runs(name: str, pairs: list[tuple[float, float]]) -> Setting:
        return Setting(
            name,
            [
                Run(
                    Path(f"{name}{i}"),
                    {},
                    [{"step": 0, "val/reward": a}, {"step": 5, "val/reward": b}],
                )
                for i, (a, b) in enumerate(pairs)
            ],
            list(range(len(pairs))),
        )

    clear, noise, lone, grid = learning_lines(
        [
            runs("clear", [(0.1, 0.3), (0.5, 0.7), (0.3, 0.51)]),
            runs("noise", [(0.5, 0.6), (0.5, 0.4), (0.5, 0.52)]),
            runs("lone", [(0.1, 0.9)]),
            # every seed gained 1/8 exactly: a point, not evidence (p would be 0)
            runs("grid", [(0.25, 0.375), (0.5, 0.625), (0.125, 0.25)]),
        ]
    )
    assert "**learned**" in clear and "at step 0" in clear and "at step 5" in clear
    assert "not supported" in noise
    assert "one seed" in lone
    assert "no claim" in grid and "same figure" in grid and "**learned**" not in grid


def test_a_baseline_beaten_by_the_same_figure_in_every_seed_is_not_claimed() -> None:
    rewards = [0.5, 0.5, 0.5]
    (line,) = baseline_lines(
        [_setting("a", rewards)], [Baseline(metric="val/reward", value=0.25, name="blind")]
    )
    assert "no claim" in line and "**beats it**" not in line
    (spread,) = baseline_lines(
        [_setting("a", [0.5, 0.52, 0.48])],
        [Baseline(metric="val/reward", value=0.25, name="blind")],
    )
    assert "**beats it**" in spread


def test_a_study_under_way_says_which_runs_it_lacks() -> None:
    study = parse_study({"seeds": [0, 1, 2], "settings": {"a": [], "b": [], "c": []}}, "s")
    line = coverage_line(study, [_setting("a", [0.5, 0.5, 0.5]), _setting("b", [0.5])])
    assert "Not finished" in line and "`b` 1/3" in line and "`c` 0/3" in line
    assert "`a`" not in line
    everything = [_setting(name, [0.5] * 3) for name in "abc"]
    assert coverage_line(study, everything) == "Every setting finished its 3 seeds."


def test_every_study_file_parses() -> None:
    for path in STUDIES.glob("*.yaml"):
        study = load_study(str(path))
        assert study.runs() and (study.reference is None or study.reference in study.settings)


_END = {"name": "final reward", "metric": "val/reward"}


def test_a_study_with_its_analysis_parses() -> None:
    study = parse_study(
        {
            "settings": {"a": [], "b": []},
            "reference": "a",
            "seeds_fixed_before_running": True,
            "preregistration": "  fixed before the first run\n",
            "endpoints": [
                {"name": "check", "metric": "train/net_push", "reduction": {"at_step": 1}},
                {"name": "slope", "metric": "train/entropy", "reduction": "slope", "test": False},
                {"name": "auc", "metric": "val/reward", "reduction": "auc", "bounds": [0, 1]},
                _END | {"bounds": [0, None]},
            ],
            "by_construction": {"b": ["merge/samples_per_rollout"]},
        },
        "s",
    )
    assert [(e.reduction, e.step, e.bounds, e.test) for e in study.endpoints] == [
        ("at_step", 1, (None, None), True),
        ("slope", None, (None, None), False),
        ("auc", None, (0.0, 1.0), True),
        ("last", None, (0.0, None), True),
    ]
    assert study.by_construction == {"b": ["merge/samples_per_rollout"]}
    assert study.seeds_fixed_before_running is True
    assert study.preregistration == "fixed before the first run"
    plain = parse_study({"settings": {"a": []}}, "p")
    assert plain.endpoints == [] and plain.seeds_fixed_before_running is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "'settings' must map"),
        ({"settings": {"a b": []}}, "no folder name"),
        ({"settings": {"a": []}, "seeds": [1, 1]}, "distinct"),
        ({"settings": {"a": []}, "reference": "b"}, "reference 'b'"),
        ({"settings": {"a": "merge=tree"}}, "list of key=value"),
        ({"settings": {"a": []}, "bogus": 1}, "unknown keys"),
        ({"settings": {"a": []}, "baselines": [{"metric": "x"}]}, "needs metric, value and name"),
        ({"settings": {"a": []}, "endpoints": {"a": 1}}, "'endpoints' must be a list"),
        ({"settings": {"a": []}, "endpoints": [{"metric": "x"}]}, "needs a name and a metric"),
        ({"settings": {"a": []}, "endpoints": [_END | {"reduction": "max"}]}, "not one of"),
        ({"settings": {"a": []}, "endpoints": [_END | {"reduction": "at_step"}]}, "its step"),
        ({"settings": {"a": []}, "endpoints": [_END | {"reduction": {"at": 1}}]}, "{at_step: N}"),
        ({"settings": {"a": []}, "endpoints": [_END | {"reduction": {"at_step": -1}}]}, "before"),
        ({"settings": {"a": []}, "endpoints": [_END | {"bounds": [1, 0]}]}, "low < high"),
        ({"settings": {"a": []}, "endpoints": [_END | {"bounds": [0]}]}, "bounds are"),
        ({"settings": {"a": []}, "endpoints": [_END | {"bounds": ["a", 1]}]}, "a number or null"),
        ({"settings": {"a": []}, "endpoints": [_END | {"test": "yes"}]}, "true or false"),
        ({"settings": {"a": []}, "endpoints": [_END | {"when": 1}]}, "unknown keys"),
        ({"settings": {"a": []}, "endpoints": [_END, _END]}, "distinct"),
        ({"settings": {"a": [], "b": []}, "by_construction": {"c": ["x"]}}, "no setting"),
        (
            {"settings": {"a": [], "b": []}, "reference": "a", "by_construction": {"a": ["x"]}},
            "other than the reference",
        ),
        ({"settings": {"a": [], "b": []}, "by_construction": {"b": "x"}}, "lists of metric"),
        ({"settings": {"a": []}, "seeds_fixed_before_running": "yes"}, "true or false"),
        ({"settings": {"a": []}, "preregistration": ["x"]}, "a short note"),
    ],
)
def test_a_bad_study_gets_a_clear_error(data: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        parse_study(data, "bad")


def test_the_command_line_refuses_an_unknown_study_or_setting(tmp_path: Path) -> None:
    done = _study("nosuch", "--out", str(tmp_path))
    assert (
        done.returncode == 2
        and "no study 'nosuch'" in done.stderr
        and "Traceback" not in done.stderr
    )
    done = _study("mini", "--only", "nosuch", "--out", str(tmp_path))
    assert done.returncode == 2 and "no setting nosuch" in done.stderr
    # overrides after the options are overrides still, as before them
    done = _study("mini", "--out", str(tmp_path), "--only", "nosuch", "backend.lr=1e-5")
    assert done.returncode == 2 and "no setting nosuch" in done.stderr, done.stderr


def test_a_baseline_is_drawn_on_its_metric_only() -> None:
    """The figure a reader checks first carries the comparison: the study's baseline as a
    labelled line at its value on the metric it names, and on no other."""
    baseline = Baseline("val/reward", 0.051, "best blind policy")
    settings = [
        Setting(
            "a",
            [
                Run(
                    Path(f"a{i}"),
                    {},
                    [{"step": 0, "val/reward": v}, {"step": 5, "val/reward": 2 * v}],
                )
                for i, v in enumerate([0.2, 0.3])
            ],
            [0, 1],
        )
    ]
    (reward,) = [m for m in METRICS if m.key == "val/reward"]
    drawn = chart(reward, settings, [baseline, Baseline("val/other", 0.9, "elsewhere")])
    assert drawn is not None
    (axes,) = drawn.axes
    flat = [line for line in axes.get_lines() if len(set(line.get_ydata())) == 1]
    assert [(line.get_label(), line.get_ydata()[0]) for line in flat] == [
        ("best blind policy (0.051)", 0.051)
    ]
    entropy = StudyMetric("train/entropy", "entropy", "{:.3f}")
    assert chart(entropy, settings, [baseline]) is None  # no run logged it


def test_runs_go_seed_by_seed_with_the_reference_first() -> None:
    study = parse_study({"seeds": [3, 1], "settings": {"a": [], "ref": [], "b": []}}, "s")
    assert [s for s, _ in study.runs()] == ["a", "ref", "b"] * 2
    study = parse_study(
        {"seeds": [3, 1], "settings": {"a": [], "ref": [], "b": []}, "reference": "ref"}, "s"
    )
    assert study.runs() == [("ref", 3), ("a", 3), ("b", 3), ("ref", 1), ("a", 1), ("b", 1)]


def test_a_detectable_difference_past_the_figures_range_is_said_so() -> None:
    study = parse_study({"settings": {"a": [], "b": []}, "reference": "a"}, "s")
    found = comparisons(study, [_setting("a", [0.2, 0.9]), _setting("b", [0.3, 0.5])])
    (c,) = [c for c in found if c.endpoint.metric == "val/reward"]
    assert c.kind == "tested" and c.detectable is not None and c.detectable > 1
    assert "no difference within the figure's range [0, 1] would likely have shown" in (
        comparison_line(c)
    )
