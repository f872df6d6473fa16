"""A study's report: each setting's mean over its seeds with a 95% band, a table of
figures at the first and the last step, and what the seeds support.

Written to ``FOLDER``: one PNG per metric (mean line and t-interval band per setting),
``summary.md`` (the tables and the statements, for a README or a commit) and
``index.html`` (the same with the plots). Every statement is computed here from the
runs' ``metrics.jsonl``:

- each endpoint of the study (``spec.Endpoint``; by default the last value of each metric
  below) is compared between each setting and the reference **paired by seed** (a seed's
  runs start from the same warm-up, so its spread cancels): the mean difference with its
  95% interval, the paired t-test, Holm-adjusted over every tested (endpoint, setting)
  comparison of the study at once; supported when the adjusted p <= 0.05;
- next to each verdict, the minimum detectable difference: the smallest true difference
  the paired test finds 80% of the time, at level 0.05 / m (Holm's first step over the m
  comparisons: conservative), from the pairs' spread;
- differences a setting makes by construction (the study's ``by_construction``) are
  shown labelled so, and neither tested nor counted in Holm's family;
- a baseline is called beaten when the whole 95% interval lies above it;
- intervals of bounded figures (a reward in [0, 1], an entropy >= 0) are clipped to
  their bounds, and say so.
"""

from __future__ import annotations

import dataclasses
import html
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agl.core.run_metrics import Run, load_run
from agl.core.user_error import UserError
from agl.study import stats
from agl.study.runner import is_done, run_folder
from agl.study.spec import Baseline, Endpoint, Study

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WALL = "time/wall_s"  # derived: the sum of time/step_s so far (training and validation)


Bounds = tuple[float | None, float | None]
UNBOUNDED: Bounds = (None, None)
SHARE: Bounds = (0.0, 1.0)


@dataclass(frozen=True)
class StudyMetric:
    key: str
    title: str
    fmt: str
    at_first_step: bool = False  # also reported at step 1 (what the merge made at once)
    bounds: Bounds = UNBOUNDED  # what a value can be: intervals are clipped to it


# agl's own tasks reward in [0, 1] (a share of the games, questions or tests won).
METRICS: tuple[StudyMetric, ...] = (
    StudyMetric("val/reward", "validation reward", "{:.3f}", bounds=SHARE),
    StudyMetric("val/uniform/reward", "validation reward, uniform targets", "{:.3f}", bounds=SHARE),
    StudyMetric("train/entropy", "entropy", "{:.3f}", bounds=(0.0, None)),
    StudyMetric("merge/samples_per_rollout", "samples per rollout", "{:.2f}", True, (1.0, None)),
    StudyMetric("merge/single_sample_rollouts", "single-sample rollouts", "{:.2f}", True, SHARE),
    StudyMetric("merge/stitched_calls", "stitched calls (share)", "{:.3f}", True, SHARE),
    StudyMetric(
        "merge/tokens_per_unique_token",
        "tokens computed per unique token",
        "{:.2f}",
        True,
        # Stitch trains a reply once and not its retokenised copy: below 1 where it stitches.
        (0.0, None),
    ),
    StudyMetric(WALL, "wall time (s, training and validation)", "{:.0f}", bounds=(0.0, None)),
)
_TITLES = {m.key: m.title for m in METRICS}


def default_endpoints() -> list[Endpoint]:
    """A study that names no endpoints: the last value of each metric above."""
    return [Endpoint(f"{m.title}, last step", m.key, "last", bounds=m.bounds) for m in METRICS]


def endpoint_metrics(study: Study) -> list[StudyMetric]:
    """The metrics the study's endpoints reduce that the list above lacks (a manipulation
    check's ``train/net_push``), to be plotted too; bounded as the endpoint says where the
    endpoint's figure is one of the metric's values (not a slope)."""
    known = {m.key for m in METRICS}
    found: dict[str, StudyMetric] = {}
    for e in study.endpoints:
        if e.metric not in known and e.metric not in found:
            bounds = UNBOUNDED if e.reduction == "slope" else e.bounds
            found[e.metric] = StudyMetric(e.metric, e.metric, "{:.3g}", bounds=bounds)
    return list(found.values())


def bounded_interval(
    values: Sequence[float], bounds: Bounds, what: str, strict: bool = False
) -> stats.Interval:
    """The t-interval of ``values`` clipped to ``bounds``. A value outside them shows the
    bounds do not hold for this study: an error in one line where the study declared them
    (``strict``), else the interval unclipped (the defaults above are what agl's own
    tasks and merges give; a user's reward may lie outside [0, 1])."""
    low, high = bounds
    for v in values:
        if (low is not None and v < low) or (high is not None and v > high):
            if strict:
                raise UserError(f"{what}: value {v} lies outside its bounds [{low}, {high}]")
            return stats.interval(values)
    return stats.bounded(stats.interval(values), low, high)


def _metric_bounds(key: str) -> Bounds:
    return next((m.bounds for m in METRICS if m.key == key), UNBOUNDED)


@dataclass(frozen=True)
class Setting:
    """A setting's finished runs, ``runs[i]`` at seed ``seeds[i]``."""

    name: str
    runs: list[Run]
    seeds: list[int]

    def __post_init__(self) -> None:
        if len(self.runs) != len(self.seeds):
            raise ValueError(f"{self.name}: {len(self.runs)} runs for {len(self.seeds)} seeds")

    def series(self, key: str) -> dict[int, list[float]]:
        """Step -> the runs' values there, at the steps every run has ``key``."""
        per_run = [dict(zip(*_series(run, key), strict=True)) for run in self.runs]
        if not per_run:
            return {}
        steps = set.intersection(*(set(points) for points in per_run))
        return {s: [points[s] for points in per_run] for s in sorted(steps)}

    def first(self, key: str) -> list[float] | None:
        series = self.series(key)
        return series[min(series)] if series else None

    def last(self, key: str) -> list[float] | None:
        series = self.series(key)
        return series[max(series)] if series else None

    def endpoint(self, endpoint: Endpoint) -> dict[int, float]:
        """Seed -> the endpoint's figure of that seed's run (runs without it left out)."""
        found = {}
        for seed, run in zip(self.seeds, self.runs, strict=True):
            value = endpoint_value(run, endpoint)
            if value is not None:
                found[seed] = value
        return found


def _series(run: Run, key: str) -> tuple[list[int], list[float]]:
    if key != WALL:
        return run.series(key)
    steps, values = run.series("time/step_s")
    return steps, [sum(values[: i + 1]) for i in range(len(values))]


def endpoint_value(run: Run, endpoint: Endpoint) -> float | None:
    """One run's figure for ``endpoint``; None when the run has too little of its metric
    (no value at all; not the step asked; fewer than 2 steps for a slope)."""
    # A step logged twice (a resumed run) counts once, with its later value.
    points = dict(zip(*_series(run, endpoint.metric), strict=True))
    steps = sorted(points)
    values = [points[s] for s in steps]
    if endpoint.reduction == "at_step":
        return points.get(endpoint.step) if endpoint.step is not None else None
    if not values:
        return None
    if endpoint.reduction == "last":
        return values[-1]
    if endpoint.reduction == "auc":
        return stats.auc(steps, values)
    return stats.slope(steps, values) if len(values) >= 2 else None


def load_settings(study: Study, out: Path) -> list[Setting]:
    """The finished runs of each setting (settings without any are left out)."""
    settings = []
    for name in study.settings:
        seeds = [seed for seed in study.seeds if is_done(run_folder(out, name, seed))]
        if seeds:
            settings.append(
                Setting(name, [load_run(run_folder(out, name, seed)) for seed in seeds], seeds)
            )
    return settings


# ----------------------------------------------------------------------- statements


@dataclass(frozen=True)
class Comparison:
    """``setting`` minus ``reference`` on ``endpoint``, seed by seed over the seeds both
    finished (``values[i]`` and ``reference_values[i]`` at ``seeds[i]``). ``kind``:
    ``tested`` (one of the ``family`` comparisons Holm adjusts together), ``by
    construction``, ``no variation`` (every run of both gave the same figure), ``no
    spread`` (every seed differs by the same amount), or ``not tested`` (the endpoint
    says ``test: false``, or fewer than 2 pairs)."""

    endpoint: Endpoint
    setting: str
    reference: str
    seeds: list[int]
    values: list[float]
    reference_values: list[float]
    kind: str
    p: float | None = None
    adjusted_p: float | None = None
    detectable: float | None = None  # at 80% power, level ALPHA / family
    family: int = 0

    @property
    def differences(self) -> list[float]:
        return [a - b for a, b in zip(self.values, self.reference_values, strict=True)]

    @property
    def difference(self) -> stats.Interval:
        return stats.interval(self.differences)

    @property
    def supported(self) -> bool:
        return self.adjusted_p is not None and self.adjusted_p <= stats.ALPHA


def _construction_endpoints(study: Study, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    """The by-construction metrics that no endpoint reduces: shown at their last value,
    for the settings that make them only."""
    covered = {e.metric for e in endpoints}
    keys = [k for keys in study.by_construction.values() for k in keys if k not in covered]
    return [
        Endpoint(f"{_TITLES.get(k, k)}, last step", k, "last", bounds=_metric_bounds(k))
        for k in dict.fromkeys(keys)
    ]


def comparisons(study: Study, settings: Sequence[Setting]) -> list[Comparison]:
    """Every setting against the reference on every endpoint, paired by seed, in the
    endpoints' order; one Holm family over all the tested ones."""
    by_name = {s.name: s for s in settings}
    reference = study.reference or settings[0].name
    if reference not in by_name:
        return []
    endpoints = study.endpoints or default_endpoints()
    shown_only = _construction_endpoints(study, endpoints)
    drafts = []
    for endpoint in [*endpoints, *shown_only]:
        base = by_name[reference].endpoint(endpoint)
        for s in settings:
            made = endpoint.metric in study.by_construction.get(s.name, ())
            if s.name == reference or (endpoint in shown_only and not made):
                continue
            values = s.endpoint(endpoint)
            seeds = [seed for seed in s.seeds if seed in values and seed in base]
            if not seeds:
                continue
            pairs = [values[seed] for seed in seeds], [base[seed] for seed in seeds]
            if made:
                kind = "by construction"
            elif len(set(pairs[0] + pairs[1])) == 1:
                # Every run gives the same figure (stitched calls 0 under merges that never
                # stitch): no test can say anything, and counting it would tighten Holm.
                kind = "no variation"
            elif not endpoint.test or len(seeds) < 2:
                kind = "not tested"
            elif len({a - b for a, b in zip(*pairs, strict=True)}) == 1:
                # Equal per-seed differences leave a t-test no spread to judge them by; with
                # figures on a grid (a reward over 128 games) that happens by chance.
                kind = "no spread"
            else:
                kind = "tested"
            drafts.append(Comparison(endpoint, s.name, reference, seeds, *pairs, kind))
    family = sum(c.kind == "tested" for c in drafts)
    # Holm's first step tests the smallest p at ALPHA / family: the strictest level any
    # comparison meets, so the detectable difference at it holds for every step.
    level = stats.ALPHA / max(family, 1)
    found = [
        dataclasses.replace(
            c,
            p=stats.paired(c.values, c.reference_values),
            detectable=stats.min_detectable(statistics.stdev(c.differences), len(c.seeds), level),
            family=family,
        )
        if c.kind == "tested"
        else c
        for c in drafts
    ]
    adjusted = iter(stats.holm([c.p for c in found if c.p is not None]))
    return [c if c.p is None else dataclasses.replace(c, adjusted_p=next(adjusted)) for c in found]


# Every seed gave the same figure: its interval is a point and a t-test's p is 0 or 1,
# whatever the truth (figures on a grid, a reward over 128 games, meet by chance).
NO_SPREAD = "no claim: every seed gave the same figure, which leaves no spread to judge it by"


def baseline_lines(settings: Sequence[Setting], baselines: Sequence[Baseline]) -> list[str]:
    lines = []
    for baseline in baselines:
        for s in settings:
            values = s.last(baseline.metric)
            if values is None:
                continue
            ci = stats.interval(values)
            shown = bounded_interval(values, _metric_bounds(baseline.metric), baseline.metric)
            margin = ci.mean - baseline.value
            if ci.n < 2:
                verdict = "one seed: no interval, no claim"
            elif len(set(values)) == 1:
                verdict = NO_SPREAD
            elif ci.low > baseline.value:
                p = stats.one_sample(values, baseline.value)
                verdict = f"**beats it**: the whole interval lies above (p = {p:.3g})"
            else:
                verdict = "does not beat it: the interval reaches it"
            lines.append(
                f"- `{s.name}`: `{baseline.metric}` {shown.text()} vs {baseline.name} "
                f"{baseline.value:.3f} (margin {margin:+.3f}, ±{ci.half_width:.3f}): {verdict}."
            )
    return lines


LEARNED = "val/reward"  # what a run is meant to raise, before its first update and after


def learning_lines(settings: Sequence[Setting], key: str = LEARNED) -> list[str]:
    """What training added, per setting: ``key`` at the last step minus at the first
    (step 0, before any update), paired by seed; supported when its whole interval lies
    above 0."""
    lines = []
    for s in settings:
        series = s.series(key)
        if len(series) < 2:
            continue
        first, last = series[min(series)], series[max(series)]
        gains = [b - a for a, b in zip(first, last, strict=True)]
        ci = stats.interval(gains)
        if ci.n < 2:
            verdict = "one seed: no interval, no claim"
        elif len(set(gains)) == 1:
            verdict = NO_SPREAD
        elif ci.low > 0:
            p = stats.one_sample(gains, 0.0)
            verdict = f"**learned**: the whole interval lies above 0 (p = {p:.3g})"
        else:
            verdict = "not supported by these seeds: the interval reaches 0"
        bounds = _metric_bounds(key)
        lines.append(
            f"- `{s.name}`: `{key}` {bounded_interval(first, bounds, key).text()} at step "
            f"{min(series)}, {bounded_interval(last, bounds, key).text()} at step "
            f"{max(series)}; the gain per seed {ci.text()}: {verdict}."
        )
    return lines


def _decimals(*scales: float) -> int:
    """Decimals that show the largest of ``scales`` (a half width, a detectable
    difference) to two significant digits: 3 for 0.021, 4 for 0.0011, 0 for 300; 3
    where all are 0."""
    scale = max((abs(x) for x in scales if math.isfinite(x)), default=0.0)
    if scale == 0:
        return 3
    return min(max(1 - math.floor(math.log10(scale)), 0), 12)


def comparison_line(c: Comparison) -> str:
    """One sentence generated from the comparison: the difference, its interval, the
    tests, the verdict, and how small a difference the seeds could have seen."""
    ci = c.difference
    unit = "/step" if c.endpoint.reduction == "slope" else ""
    digits = _decimals(ci.half_width or ci.mean)
    pairs = f"{len(c.seeds)} paired seed{'s' if len(c.seeds) != 1 else ''}"
    head = f"- `{c.setting}` minus `{c.reference}`, {c.endpoint.name}: {ci.mean:+.{digits}f}{unit}"
    if ci.n >= 2:
        head += f" [{ci.low:+.{digits}f}, {ci.high:+.{digits}f}]"
    head += f" over {pairs}"
    if c.kind == "by construction":
        return f"{head}: by construction (what `{c.setting}` is makes it so): not tested."
    if c.kind == "no variation":
        return f"{head}: not tested (every run of both gave this same figure)."
    if c.kind == "no spread":
        return (
            f"{head}: not tested (every seed differs by the same amount, which leaves a "
            "t-test no spread to judge it by; more seeds would)."
        )
    if c.p is None or c.adjusted_p is None or c.detectable is None:
        why = "a paired test needs 2 pairs" if ci.n < 2 else "the endpoint says test: false"
        return f"{head}: not tested ({why})."
    head += f", paired p = {c.p:.3g}, Holm p = {c.adjusted_p:.3g}"
    detectable = f"{c.detectable:.{_decimals(c.detectable)}f}{unit}"
    low, high = c.endpoint.bounds
    if not c.supported and low is not None and high is not None and c.detectable >= high - low:
        return (
            f"{head}: not supported; with these seeds no difference within the figure's "
            f"range [{low:g}, {high:g}] would likely have shown ({stats.POWER:.0%} power: "
            f"{detectable})."
        )
    if c.supported:
        return (
            f"{head}: **supported**. With {len(c.seeds)} paired seeds a difference of "
            f"{detectable} would be seen {stats.POWER:.0%} of the time."
        )
    return (
        f"{head}: not supported; a true difference smaller than {detectable} would likely "
        f"not have shown ({stats.POWER:.0%} power)."
    )


def comparison_lines(found: Sequence[Comparison]) -> list[str]:
    """The sentences, under a numbered heading per endpoint in the study's order."""
    lines: list[str] = []
    endpoints = list(dict.fromkeys(c.endpoint for c in found))
    for number, endpoint in enumerate(endpoints, start=1):
        lines += ["", f"{number}. **{endpoint.name}**: {endpoint.describe()}", ""]
        lines += [comparison_line(c) for c in found if c.endpoint == endpoint]
    return lines[1:]


# ----------------------------------------------------------------------- tables


def table(settings: Sequence[Setting], first: bool) -> list[list[str]]:
    """A row per setting, a column per metric that some setting logged."""
    metrics = [
        m
        for m in METRICS
        if (m.at_first_step or not first) and any(s.series(m.key) for s in settings)
    ]
    head = ["setting", "seeds", *(m.title for m in metrics)]
    rows = [head]
    for s in settings:
        cells = [s.name, str(len(s.runs))]
        for m in metrics:
            values = s.first(m.key) if first else s.last(m.key)
            cells.append(bounded_interval(values, m.bounds, m.key).text(m.fmt) if values else "")
        rows.append(cells)
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


# ----------------------------------------------------------------------- plots


def chart(
    metric: StudyMetric, settings: Sequence[Setting], baselines: Sequence[Baseline] = ()
) -> Figure | None:
    """The settings' curves of ``metric`` with their bands, and the baselines on it as
    dashed lines: the comparison a reader checks first. None when no setting logged it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    drawn = [(s, s.series(metric.key)) for s in settings]
    drawn = [(s, series) for s, series in drawn if series]
    if not drawn:
        return None
    lines = [b for b in baselines if b.metric == metric.key]
    entries = len(drawn) + len(lines)
    figure = Figure(figsize=(8, 4.5 + 0.25 * math.ceil(entries / 2)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for s, series in drawn:
        steps = list(series)
        cis = [bounded_interval(series[step], metric.bounds, metric.key) for step in steps]
        (line,) = axes.plot(
            steps,
            [c.mean for c in cis],
            marker="o",
            markersize=3,
            label=f"{s.name} (n={len(s.runs)})",
        )
        axes.fill_between(
            steps, [c.low for c in cis], [c.high for c in cis], color=line.get_color(), alpha=0.15
        )
    for baseline in lines:
        axes.axhline(
            baseline.value,
            color="0.35",
            linestyle="--",
            linewidth=1,
            label=f"{baseline.name} ({baseline.value:.3f})",
        )
    axes.set_title(f"{metric.title}: mean and 95% interval over seeds")
    axes.set_xlabel("step")
    axes.set_ylabel(metric.key)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    figure.legend(loc="outside lower center", ncols=min(entries, 2), fontsize="small")
    return figure


def plot(
    metric: StudyMetric, settings: Sequence[Setting], out: Path, baselines: Sequence[Baseline] = ()
) -> bool:
    drawn = chart(metric, settings, baselines)
    if drawn is None:
        return False
    drawn.savefig(out, dpi=100)
    return True


def image_name(metric: StudyMetric) -> str:
    return metric.key.replace("/", "_") + ".png"


# ----------------------------------------------------------------------- the report


def coverage_line(study: Study, settings: Sequence[Setting]) -> str:
    """Which runs the report holds, so a study still under way says what it lacks."""
    done = {s.name: len(s.runs) for s in settings}
    wanted = len(study.seeds)
    missing = [name for name in study.settings if done.get(name, 0) < wanted]
    if not missing:
        return f"Every setting finished its {wanted} seeds."
    shown = ", ".join(f"`{name}` {done.get(name, 0)}/{wanted}" for name in missing)
    return f"**Not finished**: {shown} seeds; the figures below cover the finished runs only."


def design_lines(study: Study, settings: Sequence[Setting]) -> list[str]:
    """The seeds, whether they were fixed before running, and the study's note on what
    was fixed: what a reader needs to weigh the p-values below."""
    fixed = {
        True: "fixed before running (the study's config says so)",
        False: "**not** fixed before running (the study's config says so)",
        None: "the study's config does not say whether they were fixed before running",
    }[study.seeds_fixed_before_running]
    seeds = ", ".join(map(str, study.seeds))
    lines = [
        f"- Seeds {seeds} ({len(study.seeds)} per setting): {fixed}.",
        "- Finished seeds per setting: "
        + ", ".join(f"`{s.name}` {len(s.runs)}" for s in settings)
        + ".",
    ]
    if study.preregistration:
        lines.append(f"- Preregistration: {study.preregistration}")
    return lines


def endpoint_table(endpoints: Sequence[Endpoint], settings: Sequence[Setting]) -> list[list[str]]:
    """A row per setting, a column per endpoint: its figure over the seeds, with the
    t-interval clipped to the endpoint's bounds."""
    rows = [["setting", "seeds", *(e.name for e in endpoints)]]
    cells: dict[tuple[str, Endpoint], stats.Interval] = {}
    for e in endpoints:
        for s in settings:
            values = list(s.endpoint(e).values())
            if values:
                what = f"endpoint {e.name!r}"
                cells[s.name, e] = bounded_interval(values, e.bounds, what, strict=True)
    for s in settings:
        row = [s.name, str(len(s.runs))]
        for e in endpoints:
            shown = [ci for (name, end), ci in cells.items() if end == e]
            digits = _decimals(*(ci.half_width or ci.mean for ci in shown))
            ci = cells.get((s.name, e))
            row.append("" if ci is None else ci.text(f"{{:.{digits}f}}"))
        rows.append(row)
    return rows


def endpoint_lines(study: Study, settings: Sequence[Setting]) -> list[str]:
    if not study.endpoints:
        return [
            "The study names no endpoints (`endpoints` in its config): each metric above is "
            "compared at its last step."
        ]
    lines = ["Fixed in the study's config (`endpoints`) before it ran, in this order:", ""]
    for number, e in enumerate(study.endpoints, start=1):
        low, high = e.bounds
        bounds = "" if e.bounds == UNBOUNDED else f"; within [{low}, {high}]"
        tested = "" if e.test else "; reported, not tested"
        lines.append(f"- {number}. **{e.name}**: {e.describe()}{bounds}{tested}")
    return [*lines, "", markdown_table(endpoint_table(study.endpoints, settings))]


def summary(study: Study, settings: Sequence[Setting]) -> str:
    reference = study.reference or settings[0].name
    parts = [
        f"# Study `{study.name}`",
        "",
        "Mean over seeds and its 95% Student-t interval `[low, high]` (clipped where a "
        "figure cannot go past a bound, and saying so); computed by `python -m agl.study` "
        "from the runs' `metrics.jsonl`.",
        "",
        coverage_line(study, settings),
        "",
        "## Design",
        "",
        *design_lines(study, settings),
        "",
        "## At the first step",
        "",
        markdown_table(table(settings, first=True)),
        "",
        "## At the last step",
        "",
        markdown_table(table(settings, first=False)),
        "",
        "## Endpoints",
        "",
        *endpoint_lines(study, settings),
        "",
    ]
    lines = learning_lines(settings)
    if lines:
        parts += ["## What training added", "", *lines, ""]
    lines = baseline_lines(settings, study.baselines)
    if lines:
        parts += ["## Against the baselines", "", *lines, ""]
    parts += [f"## Against `{reference}`, paired by seed", ""]
    found = comparisons(study, settings)
    if not found:
        return "\n".join(
            [*parts, "Nothing to compare: no other setting has a seed the reference finished.", ""]
        )
    family = max(c.family for c in found)
    parts += [
        "Each setting minus the reference, seed by seed: a seed's runs start from the same "
        "warm-up, so the spread between seeds cancels out of the differences; only the seeds "
        "both finished pair. The mean difference with its paired 95% t-interval, the paired "
        f"t-test, and Holm's adjustment over every tested comparison of this study at once "
        f"(the family is all {family} tested (endpoint, setting) comparisons below, not each "
        "endpoint's); supported: Holm p <= 0.05. The detectable difference is the smallest "
        "true difference a paired t-test finds 80% of the time, given the pairs' spread, "
        f"at level {f'0.05/{family}' if family > 1 else '0.05'} (Holm's first step, the "
        "strictest: conservative for the others). Differences a setting makes by "
        "construction are shown so, and neither tested nor counted in the family.",
        "",
        *comparison_lines(found),
        "",
    ]
    return "\n".join(parts)


_STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:80em}table{border-collapse:collapse}"
    "th,td{border:1px solid #bbb;padding:.25em .6em;text-align:right}"
    "th:first-child,td:first-child{text-align:left}img{max-width:100%}"
)
_INLINE = re.compile(r"`([^`]+)`|\*\*([^*]+)\*\*")


def _inline(text: str) -> str:
    def one(match: re.Match[str]) -> str:
        code, bold = match.groups()
        return f"<code>{code}</code>" if code is not None else f"<b>{bold}</b>"

    return _INLINE.sub(one, html.escape(text, quote=False))


def page(markdown: str) -> str:
    """The summary's markdown (headings, tables, bullets, paragraphs; code and bold
    inline) as HTML: the page shows what summary.md says, from the same text."""
    out: list[str] = []
    rows: list[list[str]] = []

    def close_table() -> None:
        if rows:
            head, *body = rows
            out.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>")
            out.extend(
                "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in body
            )
            out.append("</table>")
            rows.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not all(set(c) <= {"-"} for c in cells):
                rows.append(cells)
            continue
        close_table()
        if line.startswith("## "):
            out.append(f"<h2>{_inline(line[3:])}</h2>")
        elif line.startswith("# "):
            out.append(f"<h1>{_inline(line[2:])}</h1>")
        elif line.startswith("- "):
            out.append(f"<p>&bull; {_inline(line[2:])}</p>")
        elif line.strip():
            out.append(f"<p>{_inline(line)}</p>")
    close_table()
    return "\n".join(out)


def build(study: Study, out: Path, folder: Path) -> Path | None:
    """Write the report of ``study``'s finished runs under ``out`` to ``folder``; answers
    the path of ``summary.md``, or None when no run has finished."""
    settings = load_settings(study, out)
    if not settings:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    text = summary(study, settings)
    (folder / "summary.md").write_text(text)
    figures = [
        m
        for m in (*METRICS, *endpoint_metrics(study))
        if plot(m, settings, folder / image_name(m), study.baselines)
    ]
    body = "".join(
        f'<figure><img src="{image_name(m)}" alt="{html.escape(m.title)}"></figure>\n'
        for m in figures
    )
    (folder / "index.html").write_text(
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>agl study {html.escape(study.name)}</title><style>{_STYLE}</style></head>"
        f"<body>\n{page(text)}\n{body}</body></html>\n"
    )
    return folder / "summary.md"
