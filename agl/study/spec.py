"""A study as configured in ``conf/study/<name>.yaml``: settings (each a list of
``python -m agl.train`` overrides), the seeds each one runs with, the config and the
overrides all of them share, the setting the others are compared with, and the task's no-learning
baseline."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agl.core.user_error import UserError

STUDIES = Path(__file__).resolve().parents[2] / "conf" / "study"
_KEYS = frozenset({"settings", "seeds", "overrides", "config_name", "reference", "baselines"})
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


@dataclass(frozen=True)
class Baseline:
    """A figure no setting should need learning to reach, e.g. the best feedback-blind
    player's exact reward: a setting "beats" it when its whole 95% interval lies above."""

    metric: str
    value: float
    name: str


@dataclass(frozen=True)
class Study:
    name: str
    settings: dict[str, list[str]]
    seeds: list[int]
    overrides: list[str] = field(default_factory=list)
    config_name: str | None = None  # python -m agl.train --config-name (default: train)
    reference: str | None = None
    baselines: list[Baseline] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.settings:
            raise UserError(f"study {self.name}: no settings")
        for name in self.settings:
            if not _NAME.fullmatch(name):
                raise UserError(f"study {self.name}: {name!r} is no folder name for a setting")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise UserError(f"study {self.name}: seeds must be distinct, at least one")
        if self.reference is not None and self.reference not in self.settings:
            raise UserError(
                f"study {self.name}: reference {self.reference!r} is not one of its settings"
            )

    def runs(self) -> list[tuple[str, int]]:
        """(setting, seed) in the order they run: seed by seed, so that a study stopped
        half way has every setting at the seeds it finished."""
        return [(setting, seed) for seed in self.seeds for setting in self.settings]


def _strings(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{what} must be a list of key=value strings")
    return list(value)


def parse_study(data: Any, name: str) -> Study:
    if not isinstance(data, dict):
        raise UserError(f"study {name}: not a mapping")
    unknown = set(data) - {
        "settings",
        "seeds",
        "overrides",
        "config_name",
        "reference",
        "baselines",
    }
    if unknown:
        raise UserError(f"study {name}: unknown keys {sorted(unknown)}")
    settings = data.get("settings")
    if not isinstance(settings, dict):
        raise UserError(f"study {name}: 'settings' must map names to override lists")
    seeds = data.get("seeds", [0, 1, 2])
    if not isinstance(seeds, list) or not all(isinstance(s, int) for s in seeds):
        raise UserError(f"study {name}: 'seeds' must be a list of integers")
    baselines = []
    for i, b in enumerate(data.get("baselines") or []):
        try:
            baselines.append(Baseline(str(b["metric"]), float(b["value"]), str(b["name"])))
        except (KeyError, TypeError, ValueError):
            raise UserError(f"study {name}: baselines[{i}] needs metric, value and name") from None
    return Study(
        name=name,
        settings={str(k): _strings(v, f"settings.{k}") for k, v in settings.items()},
        seeds=seeds,
        overrides=_strings(data.get("overrides"), "overrides"),
        config_name=None if data.get("config_name") is None else str(data["config_name"]),
        reference=data.get("reference"),
        baselines=baselines,
    )


def load_study(spec: str) -> Study:
    """A study by name (``conf/study/NAME.yaml``) or by path."""
    path = Path(spec)
    if not path.suffix:
        path = STUDIES / f"{spec}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in STUDIES.glob("*.yaml")))
        raise UserError(f"no study {spec!r} (a yaml file, or one of: {known})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UserError(f"{path}: not YAML: {str(error).splitlines()[0]}") from None
    return parse_study(data, path.stem)
