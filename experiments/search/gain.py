"""``python -m experiments.search.gain search|general``: what RL added in the search and
general studies, beyond the warm-up's skill and beyond the search (read) rate, from the
committed metrics alone.

Each run logs, at every validation, the reward and the share of rollouts that searched
(``val/searched``) or read the tables (``val/read_input``); it does not log the reward of
the rollouts that searched apart from those that did not. So the accuracy of the step-0
policy given that it searched, ``a``, is known only through

    reward_0 = rate_0 * a + (1 - rate_0) * n

where ``n`` is its accuracy when it does not search. ``n`` is bounded, not measured:
between 0 and the best policy that never searches (0.051 on the 256 validation
questions, ``experiments.search.baselines``), assuming a rollout that does not search
answers no better than that policy on the questions it skips. Every figure that needs
``n`` is given at both ends (``no_search_ends``).

- **RL's gain**: final reward minus step-0 reward, paired by seed.
- **The same-rate baseline**: the step-0 policy mixed at the final rate,
  ``a * rate_final + n * (1 - rate_final)``: what searching more, with no better use of
  each search, would score. RL's gain over it is what the policy learned beyond
  searching more. It assumes the questions the policy newly searches on are answered as
  well as those it searched on at step 0 (no selection). It falls as ``n`` rises, so the
  two ends bound it.
- **The rate's share**: (same-rate baseline - step-0 reward) / RL's gain.

Intervals: the mean over seeds with its 95% Student-t interval (``agl.study.stats``);
p-values: paired t-tests (``scipy.stats.ttest_rel``).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from scipy import stats as scipy_stats

from agl.study.stats import Interval, interval, one_sample
from experiments.search.baselines import no_search_baselines
from experiments.search.facts import val_inputs

ROOT = Path(__file__).resolve().parents[2]
VAL_SIZE = 256  # conf/search.yaml and conf/general.yaml: trainer.val_size


@dataclass(frozen=True)
class StudyRuns:
    """Where a study's runs are and what it fixed before running: the last step
    (``trainer.steps`` in the run's config as first committed) and the seeds of its
    config as first committed (``conf/study/NAME.yaml``)."""

    folder: Path
    rate: str  # the validation metric: share of rollouts that searched (read)
    step: int
    preregistered_seeds: tuple[int, ...]


STUDIES = {
    "search": StudyRuns(ROOT / "experiments/search/study/prefix", "val/searched", 40, (0, 1, 2)),
    "general": StudyRuns(
        ROOT / "experiments/general/study/prefix", "val/read_input", 30, (0, 1, 2)
    ),
}


@dataclass(frozen=True)
class Run:
    """One seed's validation at step 0 and at the study's last step."""

    seed: int
    reward_0: float
    rate_0: float
    reward: float
    rate: float

    @property
    def gain(self) -> float:
        return self.reward - self.reward_0

    def search_accuracy(self, no_search: float, final: bool = False) -> float:
        """The accuracy given a search (read) at step 0 (or the last step) when the
        accuracy without one is ``no_search``."""
        reward, rate = (self.reward, self.rate) if final else (self.reward_0, self.rate_0)
        return (reward - (1 - rate) * no_search) / rate

    def same_rate_baseline(self, no_search: float) -> float:
        """The step-0 policy's accuracies mixed at the last step's rate."""
        return self.search_accuracy(no_search) * self.rate + no_search * (1 - self.rate)

    def beyond_rate(self, no_search: float) -> float:
        """RL's gain over the same-rate baseline."""
        return self.reward - self.same_rate_baseline(no_search)

    def rate_share(self, no_search: float) -> float:
        """The share of RL's gain that the rate's change alone gives."""
        return (self.same_rate_baseline(no_search) - self.reward_0) / self.gain


def load_runs(study: StudyRuns) -> list[Run]:
    """Every committed seed's run, by seed; each must have validated at 0 and at
    ``study.step``."""
    runs = []
    for folder in sorted(study.folder.glob("seed-*")):
        rows = (json.loads(line) for line in (folder / "metrics.jsonl").open())
        val = {row["step"]: row for row in rows if "val/reward" in row}
        if 0 not in val or study.step not in val:
            raise ValueError(f"{folder}: no validation at step 0 and {study.step}")
        first, last = val[0], val[study.step]
        seed = int(folder.name.removeprefix("seed-"))
        runs.append(
            Run(seed, first["val/reward"], first[study.rate], last["val/reward"], last[study.rate])
        )
    if not runs:
        raise ValueError(f"{study.folder}: no runs")
    return sorted(runs, key=lambda r: r.seed)


def no_search_ends() -> tuple[float, float]:
    """The bounds of the accuracy without a search: 0 and the best no-search policy's
    on the validation questions."""
    return 0.0, no_search_baselines(val_inputs(VAL_SIZE))["best"]


@dataclass(frozen=True)
class Paired:
    """``after - before`` per seed: its mean and interval, and the paired t-test's p."""

    difference: Interval
    p: float

    def text(self) -> str:
        return f"{self.difference.text()} (paired t, p = {self.p:.2g})"


def paired(after: Sequence[float], before: Sequence[float]) -> Paired:
    differences = [a - b for a, b in zip(after, before, strict=True)]
    return Paired(interval(differences), float(scipy_stats.ttest_rel(after, before).pvalue))


def _spread(values: Sequence[float]) -> str:
    """The mean and the seeds' range: an accuracy is bounded, and a t-interval over a
    few seeds would leave [0, 1]."""
    return f"{sum(values) / len(values):.3f} (seeds {min(values):.3f}-{max(values):.3f})"


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def report(runs: Sequence[Run], no_search: tuple[float, float], step: int) -> str:
    """The per-seed table and the means, at both ends of ``no_search``."""
    low, high = no_search
    ends = f"n = {low:.3f} / {high:.3f}"
    lines = [
        _row(
            [
                "seed",
                "reward 0",
                "rate 0",
                f"reward {step}",
                f"rate {step}",
                "RL's gain",
                f"accuracy given search, 0 ({ends})",
                f"same, {step}",
                "same-rate baseline",
                "gain over it",
                "rate's share",
            ]
        ),
        _row(["---"] * 11),
    ]

    def both(f: Callable[[float], float], fmt: str = "{:.3f}") -> str:
        return f"{fmt.format(f(low))} / {fmt.format(f(high))}"

    for r in runs:
        lines.append(
            _row(
                [
                    r.seed,
                    f"{r.reward_0:.3f}",
                    f"{r.rate_0:.3f}",
                    f"{r.reward:.3f}",
                    f"{r.rate:.3f}",
                    f"{r.gain:+.3f}",
                    both(r.search_accuracy),
                    both(functools.partial(r.search_accuracy, final=True)),
                    both(r.same_rate_baseline),
                    both(r.beyond_rate),
                    both(r.rate_share, "{:.2f}"),
                ]
            )
        )
    finals = [r.reward for r in runs]
    lines += [
        "",
        f"{len(runs)} seeds ({', '.join(str(r.seed) for r in runs)}), step {step}:",
        f"- RL's gain over step 0: {paired(finals, [r.reward_0 for r in runs]).text()}",
    ]
    for n in no_search:
        baseline = [r.same_rate_baseline(n) for r in runs]
        accuracy_0 = _spread([r.search_accuracy(n) for r in runs])
        accuracy = _spread([r.search_accuracy(n, final=True) for r in runs])
        share = (sum(baseline) - sum(r.reward_0 for r in runs)) / sum(r.gain for r in runs)
        lines.append(
            f"- n = {n:.3f}: accuracy given search {accuracy_0} at step 0, {accuracy} at "
            f"step {step}; RL's gain over the same-rate baseline "
            f"{paired(finals, baseline).text()}; the rate's share of the mean gain {share:.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.search.gain")
    parser.add_argument("study", choices=sorted(STUDIES))
    args = parser.parse_args()
    study = STUDIES[args.study]
    runs = load_runs(study)
    ends = no_search_ends()
    groups = {"every seed": runs}
    chosen = [r for r in runs if r.seed in study.preregistered_seeds]
    if len(chosen) < len(runs):
        groups["the seeds fixed before running"] = chosen
    for label, group in groups.items():
        p = one_sample([r.reward for r in group], ends[1])
        print(f"## {label}\n\n{report(group, ends, study.step)}")
        print(f"- final reward against the best no-search policy ({ends[1]:.3f}): p = {p:.2g}\n")


if __name__ == "__main__":
    main()
