"""Pinned warm-ups: a seed's warmed weights kept in a folder a study commits.

A warm-up is a short supervised run, and two machines' float arithmetic differs in its
last bits: the same seed warms up to different weights on different CPUs, and a few
hundred steps later to a different policy (experiments/agentic/README.md measured one
that learned on one machine and not on another). A pin removes that source of
difference: ``seed-<seed>.pt`` holds the weights, ``seed-<seed>.json`` what made them
(the model, the warm-up, its options, a digest of its source, its metrics, the machine).

Invariants:
  - a pin is read only for the model, warm-up and options it was made for; any other
    is refused, never silently used;
  - a pin whose warm-up source changed since is still read (pinning across code changes
    is the point) and the change is logged;
  - a pin is written whole or not at all: the weights land before the record, and a
    folder holding one without the other is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupPin:
    weights: Path
    record: Path
    model_key: str
    warmup: str | None
    options: dict[str, Any]

    @classmethod
    def of(
        cls, folder: Path, model_key: str, warmup: str | None, options: Mapping[str, Any]
    ) -> WarmupPin:
        """The pin of ``options["seed"]``'s warm-up in ``folder``."""
        seed = options.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"task.warmup_pins: the warm-up's seed {seed!r} is not an integer")
        # The record holds options as JSON reads them back (lists, not tuples).
        normal = json.loads(json.dumps(dict(options), sort_keys=True))
        return cls(
            folder / f"seed-{seed}.pt", folder / f"seed-{seed}.json", model_key, warmup, normal
        )

    def load_or_make(
        self, model: Any, make: Callable[[], Mapping[str, float] | None], source: bytes
    ) -> Mapping[str, float] | None:
        """Load the pinned weights into ``model``, or run ``make`` (which warms ``model``
        up in place) and pin its result. Answers the warm-up's metrics."""
        import torch

        digest = hashlib.sha256(source).hexdigest()
        if self.weights.exists() != self.record.exists():
            have, missing = (
                (self.weights, self.record)
                if self.weights.exists()
                else (self.record, self.weights)
            )
            raise ValueError(
                f"task.warmup_pins: {have} has no {missing.name} beside it; "
                "remove it to pin this seed again"
            )
        if self.weights.exists():
            self._check(json.loads(self.record.read_text()), digest)
            model.load_state_dict(torch.load(self.weights, map_location="cpu"))
            return {"pinned": 1.0}
        metrics = make()
        self.weights.parent.mkdir(parents=True, exist_ok=True)
        partial = self.weights.with_suffix(".partial")
        torch.save(model.state_dict(), partial)
        partial.replace(self.weights)
        record = {
            "model": self.model_key,
            "warmup": self.warmup,
            "options": self.options,
            "source_sha256": digest,
            "metrics": dict(metrics or {}),
            "machine": {
                "processor": platform.processor() or platform.machine(),
                "python": platform.python_version(),
                "torch": torch.__version__,
            },
        }
        self.record.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        log.info("warm-up pinned: %s", self.weights)
        return metrics

    def _check(self, record: Mapping[str, Any], digest: str) -> None:
        made_for = {k: record.get(k) for k in ("model", "warmup", "options")}
        wanted = {"model": self.model_key, "warmup": self.warmup, "options": self.options}
        for key, value in wanted.items():
            if made_for[key] != value:
                raise ValueError(
                    f"task.warmup_pins: {self.weights} was pinned for {key} "
                    f"{made_for[key]!r}, and this run's is {value!r}; give another folder, "
                    "or remove the pin to make it again"
                )
        if record.get("source_sha256") != digest:
            log.warning(
                "warm-up pinned by other code: %s was made by a warm-up whose source has "
                "changed since; its weights are used as pinned",
                self.weights,
            )
