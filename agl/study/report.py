"""A study's report: each setting's mean over its seeds with a 95% band, a table of
figures at the first and the last step, and what the seeds support.

Written to ``FOLDER``: one PNG per metric (mean line and t-interval band per setting),
``summary.md`` (the tables and the statements, for a README or a commit) and
``index.html`` (the same with the plots). Every statement is computed here from the
runs' ``metrics.jsonl``: a difference is called supported when Welch's test, Holm-
adjusted over the settings compared with the reference, gives p <= 0.05; a baseline is
called beaten when the whole 95% interval lies above it.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agl.core.run_metrics import Run, load_run
from agl.study import stats
from agl.study.runner import is_done, run_folder
from agl.study.spec import Baseline, Study

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WALL = "time/wall_s"  # derived: the sum of time/step_s so far (training and validation)


@dataclass(frozen=True)
class StudyMetric:
    key: str
    title: str
    fmt: str
    at_first_step: bool = False  # also reported at step 1 (what the merge made at once)


METRICS: tuple[StudyMetric, ...] = (
    StudyMetric("val/reward", "validation reward", "{:.3f}"),
    StudyMetric("val/uniform/reward", "validation reward, uniform targets", "{:.3f}"),
    StudyMetric("train/entropy", "entropy", "{:.3f}"),
    StudyMetric("merge/samples_per_rollout", "samples per rollout", "{:.2f}", True),
    StudyMetric("merge/single_sample_rollouts", "single-sample rollouts", "{:.2f}", True),
    StudyMetric("merge/stitched_calls", "stitched calls (share)", "{:.3f}", True),
    StudyMetric(
        "merge/tokens_per_unique_token", "tokens computed per unique token", "{:.2f}", True
    ),
    StudyMetric(WALL, "wall time (s, training and validation)", "{:.0f}"),
)


@dataclass(frozen=True)
class Setting:
    name: str
    runs: list[Run]

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


def _series(run: Run, key: str) -> tuple[list[int], list[float]]:
    if key != WALL:
        return run.series(key)
    steps, values = run.series("time/step_s")
    return steps, [sum(values[: i + 1]) for i in range(len(values))]


def load_settings(study: Study, out: Path) -> list[Setting]:
    """The finished runs of each setting (settings without any are left out)."""
    settings = []
    for name in study.settings:
        runs = [
            load_run(folder)
            for seed in study.seeds
            if is_done(folder := run_folder(out, name, seed))
        ]
        if runs:
            settings.append(Setting(name, runs))
    return settings


# ----------------------------------------------------------------------- statements


@dataclass(frozen=True)
class Comparison:
    metric: StudyMetric
    setting: str
    reference: str
    difference: float
    p: float
    adjusted_p: float

    @property
    def supported(self) -> bool:
        return self.adjusted_p <= stats.ALPHA


def comparisons(settings: Sequence[Setting], reference: str) -> list[Comparison]:
    """Each setting's last value against the reference's, per metric (Holm over the
    settings of one metric); settings or metrics with fewer than 2 seeds are left out."""
    by_name = {s.name: s for s in settings}
    if reference not in by_name:
        return []
    found = []
    for metric in METRICS:
        base = by_name[reference].last(metric.key)
        if base is None or len(base) < 2:
            continue
        rows = []
        for s in settings:
            values = s.last(metric.key)
            if s.name == reference or values is None or len(values) < 2:
                continue
            rows.append((s.name, _mean(values) - _mean(base), stats.welch(values, base)))
        for (name, diff, p), adjusted in zip(rows, stats.holm([p for *_, p in rows]), strict=True):
            found.append(Comparison(metric, name, reference, diff, p, adjusted))
    return found


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def baseline_lines(settings: Sequence[Setting], baselines: Sequence[Baseline]) -> list[str]:
    lines = []
    for baseline in baselines:
        for s in settings:
            values = s.last(baseline.metric)
            if values is None:
                continue
            ci = stats.interval(values)
            margin = ci.mean - baseline.value
            if ci.n < 2:
                verdict = "one seed: no interval, no claim"
            elif ci.low > baseline.value:
                p = stats.one_sample(values, baseline.value)
                verdict = f"**beats it**: the whole interval lies above (p = {p:.3g})"
            else:
                verdict = "does not beat it: the interval reaches it"
            lines.append(
                f"- `{s.name}`: `{baseline.metric}` {ci.text()} vs {baseline.name} "
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
        elif ci.low > 0:
            p = stats.one_sample(gains, 0.0)
            verdict = f"**learned**: the whole interval lies above 0 (p = {p:.3g})"
        else:
            verdict = "not supported by these seeds: the interval reaches 0"
        lines.append(
            f"- `{s.name}`: `{key}` {stats.interval(first).text()} at step {min(series)}, "
            f"{stats.interval(last).text()} at step {max(series)}; the gain per seed "
            f"{ci.text()}: {verdict}."
        )
    return lines


def comparison_lines(found: Sequence[Comparison]) -> list[str]:
    lines = []
    for c in found:
        fmt = c.metric.fmt
        verdict = "supported" if c.supported else "not supported by these seeds"
        lines.append(
            f"- {c.metric.title}: `{c.setting}` minus `{c.reference}` = "
            f"{'' if c.difference < 0 else '+'}{fmt.format(c.difference)} "
            f"(Welch p = {c.p:.3g}, Holm {c.adjusted_p:.3g}): {verdict}."
        )
    return lines


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
            cells.append(stats.interval(values).text(m.fmt) if values else "")
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
        cis = [stats.interval(series[step]) for step in steps]
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


def summary(study: Study, settings: Sequence[Setting]) -> str:
    reference = study.reference or settings[0].name
    parts = [
        f"# Study `{study.name}`",
        "",
        "Mean over seeds and its 95% Student-t interval `[low, high]`; computed by "
        "`python -m agl.study` from the runs' `metrics.jsonl`.",
        "",
        coverage_line(study, settings),
        "",
        "## At the first step",
        "",
        markdown_table(table(settings, first=True)),
        "",
        "## At the last step",
        "",
        markdown_table(table(settings, first=False)),
        "",
    ]
    lines = learning_lines(settings)
    if lines:
        parts += ["## What training added", "", *lines, ""]
    lines = baseline_lines(settings, study.baselines)
    if lines:
        parts += ["## Against the baselines", "", *lines, ""]
    lines = comparison_lines(comparisons(settings, reference))
    parts += [
        f"## Against `{reference}`",
        "",
        "Last-step values; Welch's t-test, Holm-adjusted over the settings of each metric;"
        " supported: adjusted p <= 0.05.",
        "",
        *(lines or ["- Nothing to compare: no other setting has 2 finished seeds or more."]),
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
    figures = [m for m in METRICS if plot(m, settings, folder / image_name(m), study.baselines)]
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
