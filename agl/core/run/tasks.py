"""A task as configured in ``conf/task/<name>.yaml``: where its harness, data and warm-up
live (``module:function`` strings, imported from the experiments folder), and the options
they share. The data is Python (``train_inputs`` / ``val_inputs``) or dataset files
(``train_files`` / ``val_files``, see ``agl.core.datasets``)."""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl.core.callables import load_callable
from agl.core.datasets import DatasetLimits, DatasetStream, map_columns, read_rows
from agl.core.run.task_services import ServiceSpec
from agl.core.run.warmup_pins import WarmupPin


@dataclass
class TaskConfig:
    name: str
    harness: str
    train_inputs: str | None = None  # "module:function" (step, n, seed, **options)
    val_inputs: str | None = None  # "module:function" (n, **options)
    # Dataset files instead of train_inputs / val_inputs: a path or a list of paths
    # (.jsonl, .json, .parquet); without val_files, validation reads the train files.
    train_files: str | list[str] | None = None
    val_files: str | list[str] | None = None
    columns: dict[str, str] | None = None  # input key: column ("a.b" nests); None: the row
    shuffle: bool = True  # a new order every epoch
    data_seed: int | None = None  # the shuffle's seed; null: the run's seed
    epochs: int | None = None  # passes over the train files a run may take; null: no limit
    dataset_limits: dict[str, int] = field(default_factory=dict)  # datasets.DatasetLimits
    warmup: str | None = None
    # A folder of pinned warm-ups (agl/core/run/warmup_pins.py): a seed's warmed weights
    # are read from there when it has them, made and kept there when it does not. A study
    # commits them, so every machine starts a seed from the same weights. Relative to the
    # repository's root.
    warmup_pins: str | None = None
    # Rewards from what the agent left, posted by the controller (agl/grading/).
    grader: str | None = None
    warmup_options: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    # Merged into every input, like ``sampling``: knobs of the harness itself (e.g. the
    # think time bench/async.py gives the agents).
    agent: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 60.0
    # Extra validation sets, each reported apart (val/NAME/...): the task's val_inputs
    # with these ``options`` over ``options`` and ``sampling`` over ``sampling`` (other
    # targets, seeds, temperatures).
    val_sets: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Processes the run starts for the agents and stops after them (a retriever), each
    # {module, args}; every input carries each one's URL as <name>_url
    # (agl/core/run/task_services.py).
    services: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.train_inputs is None) == (self.train_files is None):
            raise ValueError(
                f"task {self.name}: give the data as train_inputs (Python) or as "
                "train_files (dataset files), one of the two"
            )
        if self.train_inputs is not None and self.val_inputs is None:
            raise ValueError(f"task {self.name}: train_inputs needs val_inputs too")
        if self.train_files is None and (self.val_files is not None or self.columns):
            raise ValueError(f"task {self.name}: val_files and columns need train_files")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"task.epochs={self.epochs}: at least 1, or null for no limit")
        for name, spec in self.val_sets.items():
            unknown = set(spec or {}) - {"options", "sampling"}
            if unknown or "/" in name:
                raise ValueError(
                    f"task.val_sets.{name}: a validation set has a name without '/' and "
                    f"only 'options' and 'sampling' (not {sorted(unknown)})"
                )


def _paths(files: str | list[str]) -> list[str]:
    return [files] if isinstance(files, str) else list(files)


class Task:
    """The trainer's view of a task (``agl.core.trainer.loop.Task``)."""

    def __init__(self, config: TaskConfig, root: Path, seed: int = 0) -> None:
        self.config = config
        self.root = root
        self.seed = seed
        self._warmup = load_callable(config.warmup, root) if config.warmup else None
        self.services = [ServiceSpec.of(name, spec) for name, spec in config.services.items()]
        # The running services' URLs, as input keys; set once they are up.
        self.service_urls: dict[str, str] = {}
        self._train: Callable[..., list[Any]]
        self._val: Callable[..., list[Any]]
        if config.train_files is None:
            assert config.train_inputs is not None and config.val_inputs is not None
            self._train = load_callable(config.train_inputs, root)
            self._val = load_callable(config.val_inputs, root)
            self.train_rows: int | None = None
        else:
            self._train, self._val, self.train_rows = self._dataset(config, seed)

    @staticmethod
    def _dataset(
        config: TaskConfig, seed: int
    ) -> tuple[Callable[..., list[Any]], Callable[..., list[Any]], int]:
        """train_inputs / val_inputs over the dataset files, and the train rows' count."""
        assert config.train_files is not None
        data_seed = seed if config.data_seed is None else config.data_seed

        def stream(files: list[str]) -> DatasetStream:
            limits = DatasetLimits.of(config.dataset_limits)
            rows = map_columns(read_rows(files, limits), config.columns or {}, ", ".join(files))
            return DatasetStream(rows, data_seed, config.shuffle)

        train = stream(_paths(config.train_files))
        # Without val_files, validation reads the train rows: read once.
        val = stream(_paths(config.val_files)) if config.val_files is not None else train
        return (
            lambda step, n, seed, **options: [{**options, **x} for x in train.batch(step, n)],
            lambda n, **options: [{**options, **x} for x in val.first(n)],
            len(train.rows),
        )

    def check_length(self, steps: int, per_step: int) -> None:
        """ValueError when ``steps`` of ``per_step`` inputs take more than ``task.epochs``
        passes over the train files."""
        epochs, rows = self.config.epochs, self.train_rows
        if epochs is None or rows is None or steps * per_step <= epochs * rows:
            return
        raise ValueError(
            f"task.epochs={epochs}: {rows} train rows give {epochs * rows // per_step} steps "
            f"of trainer.groups_per_step={per_step}, and trainer.steps={steps} asks for more"
        )

    def train_inputs(self, batch: int, n: int) -> list[Any]:
        inputs = self._train(batch, n, self.seed, **self.config.options)
        return [self._with_sampling(x) for x in inputs]

    @property
    def val_sets(self) -> list[str]:
        return list(self.config.val_sets)

    def val_inputs(self, n: int, val_set: str | None = None) -> list[Any]:
        """The fixed validation inputs; ``val_set`` names one of ``task.val_sets``."""
        if val_set is None:
            return [self._with_sampling(x) for x in self._val(n, **self.config.options)]
        if val_set not in self.config.val_sets:
            raise ValueError(f"no validation set {val_set!r}; the task has {self.val_sets}")
        spec = self.config.val_sets[val_set] or {}
        options = {**self.config.options, **(spec.get("options") or {})}
        sampling = {**self.config.sampling, **(spec.get("sampling") or {})}
        return [self._with_sampling(x, sampling) for x in self._val(n, **options)]

    def warm_up(
        self, model: Any, tokenizer: Any, cache_dir: Path | None = None, model_key: str = ""
    ) -> Mapping[str, float] | None:
        """Run the task's warm-up on ``model`` in place. With ``task.warmup_pins``, a
        seed's pinned weights are loaded instead (and pinned when missing). Otherwise, with
        ``cache_dir``, the warmed weights are kept there, keyed by ``model_key`` (which
        model, which seed), the warm-up's options and its source, so sweeps and tests warm
        up once."""
        warmup = self._warmup
        if warmup is None:
            return None
        options = {**self.config.options, **self.config.warmup_options}
        options.setdefault("seed", self.seed)
        if self.config.warmup_pins is not None:
            pin = WarmupPin.of(
                self.root / self.config.warmup_pins, model_key, self.config.warmup, options
            )
            return pin.load_or_make(
                model, lambda: warmup(model, tokenizer, **options), self._warmup_source()
            )
        if cache_dir is None:
            return warmup(model, tokenizer, **options)
        import torch

        key = hashlib.sha256(
            json.dumps([model_key, self.config.warmup, options], sort_keys=True).encode()
            + self._warmup_source()
        ).hexdigest()[:16]
        path = cache_dir / f"{self.config.name}-{key}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        # Runs that start together (a sweep, parallel tests) want the same warm-up: the
        # first makes it, the others wait for it and read it, instead of each making it
        # and writing one file at once.
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                model.load_state_dict(torch.load(path, map_location="cpu"))
                return {"cached": 1.0}
            metrics = warmup(model, tokenizer, **options)
            partial = path.with_suffix(".partial")
            torch.save(model.state_dict(), partial)
            partial.replace(path)
        return metrics

    def _warmup_source(self) -> bytes:
        """The warm-up's whole folder: it may use the harness's messages."""
        assert self._warmup is not None
        folder = Path(inspect.getfile(self._warmup)).parent
        return b"".join(p.read_bytes() for p in sorted(folder.glob("*.py")))

    def _with_sampling(self, data: Any, sampling: dict[str, Any] | None = None) -> Any:
        if isinstance(data, dict):
            return {
                **(self.config.sampling if sampling is None else sampling),
                **self.config.agent,
                **data,
                **self.service_urls,
            }
        return data
