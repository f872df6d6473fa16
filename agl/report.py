"""``python -m agl.report DIR [--out FOLDER]``: compare the runs under ``DIR`` (one run
folder, or a Hydra multirun folder of them).

Writes to ``FOLDER`` (default ``DIR/report/``) one PNG per metric (x = step, one line per
run), and ``index.html`` with the plots and a table of final figures. Runs are labelled by
the strategy choices (merge, advantage, loss, trainer mode) that differ between them.
"""

from __future__ import annotations

import argparse
import html
import logging
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl.core.run_metrics import CHOICES, METRICS_FILE, Run, load_run
from agl.core.user_error import UserError

log = logging.getLogger("agl.report")


@dataclass(frozen=True)
class Metric:
    key: str  # as in metrics.jsonl
    title: str
    fmt: str
    reward_like: bool = False  # the table also shows the best (highest) value


METRICS: tuple[Metric, ...] = (
    Metric("reward/mean", "train reward", "{:.3f}", reward_like=True),
    Metric("val/reward", "validation reward", "{:.3f}", reward_like=True),
    Metric("merge/samples_per_rollout", "samples per rollout", "{:.2f}"),
    Metric("merge/single_sample_rollouts", "single-sample rollouts (share)", "{:.1%}"),
    Metric("train/entropy", "entropy", "{:.3f}"),
    Metric("train/clip_fraction", "clip fraction", "{:.3f}"),
    Metric("throughput/generated_tokens_per_s", "generated tokens/s (rollout phase)", "{:.0f}"),
    Metric("throughput/train_tokens_per_s", "trained tokens/s (train phase)", "{:.0f}"),
)


@dataclass(frozen=True)
class FinalRow:
    label: str
    last_step: int | None
    last: dict[str, float]
    best: dict[str, float]


# ---------------------------------------------------------------------- reading runs


def find_runs(folder: Path) -> list[Path]:
    """``folder`` if it is a run (holds metrics.jsonl), else its subfolders that are runs,
    in the order of their job numbers (``2-...`` before ``10-...``)."""
    if not folder.is_dir():
        raise UserError(f"no run ({METRICS_FILE}) under {folder}: no such folder")
    if (folder / METRICS_FILE).is_file():
        return [folder]
    runs = [p for p in folder.iterdir() if p.is_dir() and (p / METRICS_FILE).is_file()]
    if not runs:
        raise UserError(f"no run ({METRICS_FILE}) under {folder}")
    return sorted(runs, key=_natural)


def _natural(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


# ---------------------------------------------------------------------- labels


def label_runs(choices: Sequence[Mapping[str, str]], names: Sequence[str]) -> list[str]:
    """One label per run: its choices that differ between the runs (all of them for one
    run), as ``merge=tree mode=async``. Where that leaves runs alike (a sweep over
    something else), the run's folder name tells them apart; distinct names give distinct
    labels as long as choices and names are plain words (options are yaml file stems)."""
    order = [name for name, _ in CHOICES]
    present = [n for n in order if any(n in c for c in choices)]
    if len(choices) > 1:
        present = [n for n in present if len({c.get(n) for c in choices}) > 1]
    labels = [" ".join(f"{n}={c[n]}" for n in present if n in c) for c in choices]
    if len(set(labels)) == len(labels):
        return labels
    return [
        f"{label} ({name})" if label else name for label, name in zip(labels, names, strict=True)
    ]


# ---------------------------------------------------------------------- figures


def plot_metric(metric: Metric, runs: Sequence[Run], labels: Sequence[str], out: Path) -> bool:
    """Write ``out`` (a PNG) with one line per run that has ``metric``; False if none has."""
    # The object API with an explicit Agg canvas: no pyplot state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    series = [(run.series(metric.key), label) for run, label in zip(runs, labels, strict=True)]
    lines = sum(bool(steps) for (steps, _), _ in series)
    if not lines:
        return False
    # Taller for each row of the legend, so that a big sweep leaves the axes their height.
    figure = Figure(figsize=(8, 4.5 + 0.25 * math.ceil(lines / 2)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for (steps, values), label in series:
        if steps:
            # Markers: a short run (or validation every few steps) has few points.
            axes.plot(steps, values, marker="o", markersize=3, label=label)
    axes.set_title(metric.title)
    axes.set_xlabel("step")
    axes.set_ylabel(metric.key)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    # Below the axes: a sweep of many runs would otherwise cover its lines, and a label
    # with every choice (one run) would squeeze the axes at the side.
    figure.legend(loc="outside lower center", ncols=min(lines, 2), fontsize="small")
    figure.savefig(out, dpi=100)
    return True


def image_name(metric: Metric) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", metric.key) + ".png"


def final_rows(runs: Sequence[Run], labels: Sequence[str]) -> list[FinalRow]:
    """Per run: its last step, each metric's last value and, for reward-like ones, its best."""
    rows = []
    for run, label in zip(runs, labels, strict=True):
        last: dict[str, float] = {}
        best: dict[str, float] = {}
        for metric in METRICS:
            _, values = run.series(metric.key)
            if values:
                last[metric.key] = values[-1]
                if metric.reward_like:
                    best[metric.key] = max(values)
        steps = [row["step"] for row in run.rows]
        rows.append(FinalRow(label, max(steps, default=None), last, best))
    return rows


# ---------------------------------------------------------------------- index.html

_STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 72em; }
table { border-collapse: collapse; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
img { max-width: 100%; }
figure { margin: 1.5em 0; }
"""


def render_index(
    source: Path,
    runs: Sequence[Run],
    labels: Sequence[str],
    table: Sequence[FinalRow],
    plotted: Sequence[Metric],
    missing: Sequence[Metric],
) -> str:
    """The report page: runs, final figures, then the plots (by relative path)."""
    esc = html.escape
    shown = [m for m in METRICS if m not in missing]
    head = ["run", "last step"]
    for metric in shown:
        head.append(f"{metric.title} (last)")
        if metric.reward_like:
            head.append(f"{metric.title} (best)")
    body = []
    for row in table:
        cells = [esc(row.label), "" if row.last_step is None else str(row.last_step)]
        for metric in shown:
            cells.append(_cell(metric, row.last.get(metric.key)))
            if metric.reward_like:
                cells.append(_cell(metric, row.best.get(metric.key)))
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    parts = [
        "<!doctype html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f"<title>agl report: {esc(str(source))}</title>",
        f"<style>{_STYLE}</style>",
        "</head>",
        "<body>",
        "<h1>agl report</h1>",
        f"<p>{len(runs)} run(s) under <code>{esc(str(source))}</code></p>",
        "<h2>Runs</h2>",
        "<ul>",
        *(
            f"<li><b>{esc(label)}</b>: <code>{esc(_relative(run.path, source))}</code></li>"
            for run, label in zip(runs, labels, strict=True)
        ),
        "</ul>",
        "<h2>Final figures</h2>",
        "<table>",
        "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>",
        *body,
        "</table>",
        "<h2>Metrics</h2>",
    ]
    for metric in plotted:
        name = esc(image_name(metric))
        parts += [
            "<figure>",
            f'<img src="{name}" alt="{esc(metric.title)}">',
            f"<figcaption>{esc(metric.title)} (<code>{esc(metric.key)}</code>)</figcaption>",
            "</figure>",
        ]
    if missing:
        names = ", ".join(f"{esc(m.title)} (<code>{esc(m.key)}</code>)" for m in missing)
        parts.append(f"<p>In no run, so not plotted: {names}.</p>")
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def _cell(metric: Metric, value: float | None) -> str:
    return "" if value is None else metric.fmt.format(value)


def _relative(path: Path, source: Path) -> str:
    return "." if path == source else str(path.relative_to(source))


# ---------------------------------------------------------------------- the report


def build_report(source: Path, out: Path) -> Path:
    """Read the runs under ``source``, write the plots and index.html to ``out``; answers
    the path of index.html."""
    runs = [load_run(path) for path in find_runs(source)]
    for run in runs:
        if not run.rows:
            log.warning("%s: %s is empty", run.path, METRICS_FILE)
    labels = label_runs([run.choices for run in runs], [run.path.name for run in runs])
    out.mkdir(parents=True, exist_ok=True)
    plotted, missing = [], []
    for metric in METRICS:
        if plot_metric(metric, runs, labels, out / image_name(metric)):
            plotted.append(metric)
        else:
            missing.append(metric)
    table = final_rows(runs, labels)
    index = out / "index.html"
    index.write_text(render_index(source, runs, labels, table, plotted, missing))
    return index


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agl.report",
        description="Compare runs: one PNG per metric and index.html with final figures.",
    )
    parser.add_argument("dir", type=Path, help="a run folder or a Hydra multirun folder")
    parser.add_argument("--out", type=Path, help="where to write (default: DIR/report/)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="agl.report: %(message)s")
    try:
        index = build_report(args.dir, args.out or args.dir / "report")
    except UserError as error:
        sys.stderr.write(f"agl.report: {error}\n")
        return 2
    except OSError as error:
        sys.stderr.write(f"agl.report: {error}\n")
        return 2
    print(f"report: {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
