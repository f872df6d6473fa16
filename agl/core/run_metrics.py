"""A run folder read back: its ``metrics.jsonl`` rows and its strategy choices from
``config.yaml``, for the tools that compare runs (``python -m agl.report``,
``python -m agl.study``). Works on a run that is still going or that crashed."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agl.core.user_error import UserError

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"

# The strategy choices, as (name in a label, path in the resolved config.yaml); the same
# ones that name a multirun's folders (conf/train.yaml, hydra.sweep.subdir).
CHOICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("merge", ("merge", "name")),
    ("advantage", ("advantage", "name")),
    ("loss", ("loss", "name")),
    ("mode", ("trainer", "mode")),
)


@dataclass(frozen=True)
class Run:
    path: Path
    choices: dict[str, str]
    rows: list[dict[str, Any]]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of ``key``, leaving out steps without it (or non-finite there:
        the tracker writes ``null``, a hand-made file may say ``NaN``)."""
        points = [
            (row["step"], float(row[key]))
            for row in self.rows
            if row.get(key) is not None and math.isfinite(row[key])
        ]
        return [s for s, _ in points], [v for _, v in points]


def load_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl: each a JSON object with an integer ``step`` and numbers
    (``null`` where the value was not finite)."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{number}: malformed metrics line: {error.msg}") from None
        problem = _row_problem(row)
        if problem:
            raise UserError(f"{path}:{number}: malformed metrics line: {problem}")
        rows.append(row)
    return rows


def _row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return "not a JSON object"
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return "no integer 'step'"
    for key, value in row.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            return f"{key!r} is not a number"
    return None


def read_choices(run: Path) -> dict[str, str]:
    """The run's strategy choices from its config.yaml; those it does not say are left out."""
    path = run / CONFIG_FILE
    if not path.is_file():
        log.warning("%s: no %s; labelled by its folder name", run, CONFIG_FILE)
        return {}
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UserError(f"{path}: not YAML: {str(error).splitlines()[0]}") from None
    choices = {}
    for name, keys in CHOICES:
        value: Any = config
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            choices[name] = str(value)
    return choices


def load_run(path: Path) -> Run:
    return Run(path, read_choices(path), load_metrics(path / METRICS_FILE))
