"""A study as configured in ``conf/study/<name>.yaml``: settings (each a list of
``python -m agl.train`` overrides), the seeds each one runs with, the config and the
overrides all of them share, the setting the others are compared with, the task's no-learning
baseline, and what its report tests, fixed before it runs.

The keys of the analysis (each optional):

- ``endpoints``: the figures each setting is compared on, in order; each
  ``{name, metric, reduction, bounds, test}``: ``metric`` a ``metrics.jsonl`` key (or
  ``time/wall_s``), ``reduction`` how one run's series becomes one figure: ``last`` (its
  last value), ``{at_step: N}`` (its value at step N, e.g. 1 for a manipulation check),
  ``slope`` (the least-squares slope over every logged step) or ``auc`` (the mean over
  every logged step); ``bounds: [low, high]`` what that figure can be (``null``: no bound
  on that side; intervals are clipped to them); ``test: false`` reports the difference
  without testing it (outside Holm's family). Without ``endpoints`` the report tests the
  last value of each metric it plots.
- ``by_construction``: setting -> the metrics whose difference from the reference the
  setting makes by what it is (tree's one sample per rollout): shown, labelled so, not
  tested.
- ``seeds_fixed_before_running`` (true or false) and ``preregistration`` (a short note:
  what was fixed before the first run, and what was changed after a look), quoted by the
  report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agl.core.user_error import UserError

STUDIES = Path(__file__).resolve().parents[2] / "conf" / "study"
_KEYS = frozenset(
    {
        "settings",
        "seeds",
        "overrides",
        "config_name",
        "reference",
        "baselines",
        "endpoints",
        "by_construction",
        "seeds_fixed_before_running",
        "preregistration",
    }
)
_ENDPOINT_KEYS = frozenset({"name", "metric", "reduction", "bounds", "test"})
REDUCTIONS = ("last", "at_step", "slope", "auc")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


@dataclass(frozen=True)
class Baseline:
    """A figure no setting should need learning to reach, e.g. the best feedback-blind
    player's exact reward: a setting "beats" it when its whole 95% interval lies above."""

    metric: str
    value: float
    name: str


@dataclass(frozen=True)
class Endpoint:
    """One figure per run, compared between settings seed by seed: ``metric``'s series
    reduced by ``reduction`` (``at_step``: the value at ``step``). ``bounds``: what the
    figure can be (``None``: unbounded on that side). ``test``: False to show the
    difference without a test."""

    name: str
    metric: str
    reduction: str
    step: int | None = None
    bounds: tuple[float | None, float | None] = (None, None)
    test: bool = True

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise UserError(
                f"endpoint {self.name!r}: reduction {self.reduction!r} is not one of {REDUCTIONS}"
            )
        if (self.reduction == "at_step") != (self.step is not None):
            raise UserError(f"endpoint {self.name!r}: a step goes with at_step, and only there")
        if self.step is not None and self.step < 0:
            raise UserError(f"endpoint {self.name!r}: step {self.step} is before step 0")
        low, high = self.bounds
        if low is not None and high is not None and not low < high:
            raise UserError(f"endpoint {self.name!r}: bounds need low < high, not {self.bounds}")

    def describe(self) -> str:
        """``metric`` and its reduction in words: "`val/reward`, mean over its steps"."""
        how = {
            "last": "at the last step",
            "at_step": f"at step {self.step}",
            "slope": "slope per step over its steps",
            "auc": "mean over its steps",
        }[self.reduction]
        return f"`{self.metric}` {how}"


@dataclass(frozen=True)
class Study:
    name: str
    settings: dict[str, list[str]]
    seeds: list[int]
    overrides: list[str] = field(default_factory=list)
    config_name: str | None = None  # python -m agl.train --config-name (default: train)
    reference: str | None = None
    baselines: list[Baseline] = field(default_factory=list)
    endpoints: list[Endpoint] = field(default_factory=list)  # empty: the report's default
    by_construction: dict[str, list[str]] = field(default_factory=dict)
    seeds_fixed_before_running: bool | None = None  # None: the config does not say
    preregistration: str | None = None

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
        names = [e.name for e in self.endpoints]
        if len(set(names)) != len(names):
            raise UserError(f"study {self.name}: endpoint names must be distinct: {names}")
        for setting in self.by_construction:
            if setting not in self.settings or setting == self.reference:
                raise UserError(
                    f"study {self.name}: by_construction names {setting!r}, "
                    "which is no setting other than the reference"
                )

    def runs(self) -> list[tuple[str, int]]:
        """(setting, seed) in the order they run: seed by seed, so that a study stopped
        half way has every setting at the seeds it finished, and the reference first in
        each seed, so that a seed stopped half way still pairs what it ran."""
        first = [self.reference] if self.reference is not None else []
        order = first + [s for s in self.settings if s != self.reference]
        return [(setting, seed) for seed in self.seeds for setting in order]


def _strings(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{what} must be a list of key=value strings")
    return list(value)


def _bound(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{what}: a bound is a number or null, not {value!r}")
    return float(value)


def _endpoint(data: Any, what: str) -> Endpoint:
    if not isinstance(data, dict):
        raise UserError(f"{what}: an endpoint is a mapping with name, metric and reduction")
    unknown = set(data) - _ENDPOINT_KEYS
    if unknown:
        raise UserError(f"{what}: unknown keys {sorted(unknown)}")
    if not isinstance(data.get("name"), str) or not isinstance(data.get("metric"), str):
        raise UserError(f"{what}: needs a name and a metric (strings)")
    given = data.get("reduction", "last")
    step: int | None = None
    if isinstance(given, dict):  # {at_step: N}
        step = given.get("at_step")
        if list(given) != ["at_step"] or not isinstance(step, int) or isinstance(step, bool):
            raise UserError(f"{what}: a reduction mapping is {{at_step: N}}, not {given}")
        reduction = "at_step"
    elif given == "at_step":
        raise UserError(f"{what}: at_step needs its step: reduction: {{at_step: N}}")
    else:
        reduction = str(given)
    bounds = data.get("bounds")
    if bounds is None:
        bounds = [None, None]
    if not isinstance(bounds, list) or len(bounds) != 2:
        raise UserError(f"{what}: bounds are [low, high] (null for no bound)")
    test = data.get("test", True)
    if not isinstance(test, bool):
        raise UserError(f"{what}: test is true or false")
    return Endpoint(
        name=data["name"],
        metric=data["metric"],
        reduction=reduction,
        step=step,
        bounds=(_bound(bounds[0], what), _bound(bounds[1], what)),
        test=test,
    )


def _by_construction(value: Any, name: str) -> dict[str, list[str]]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(keys, list) and all(isinstance(k, str) for k in keys) for keys in value.values()
    ):
        raise UserError(f"study {name}: 'by_construction' maps settings to lists of metric keys")
    return {str(setting): list(keys) for setting, keys in value.items()}


def parse_study(data: Any, name: str) -> Study:
    if not isinstance(data, dict):
        raise UserError(f"study {name}: not a mapping")
    unknown = set(data) - _KEYS
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
    endpoints = data.get("endpoints") or []
    if not isinstance(endpoints, list):
        raise UserError(f"study {name}: 'endpoints' must be a list")
    fixed = data.get("seeds_fixed_before_running")
    if fixed is not None and not isinstance(fixed, bool):
        raise UserError(f"study {name}: 'seeds_fixed_before_running' is true or false")
    note = data.get("preregistration")
    if note is not None and not isinstance(note, str):
        raise UserError(f"study {name}: 'preregistration' is a short note (a string)")
    return Study(
        name=name,
        settings={str(k): _strings(v, f"settings.{k}") for k, v in settings.items()},
        seeds=seeds,
        overrides=_strings(data.get("overrides"), "overrides"),
        config_name=None if data.get("config_name") is None else str(data["config_name"]),
        reference=data.get("reference"),
        baselines=baselines,
        endpoints=[_endpoint(e, f"study {name}: endpoints[{i}]") for i, e in enumerate(endpoints)],
        by_construction=_by_construction(data.get("by_construction"), name),
        seeds_fixed_before_running=fixed,
        preregistration=None if note is None else note.strip(),
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
