"""How a part of ``bench/gpu_check.py`` keeps its results: one JSON file per part,
rewritten (atomically) after every measurement, and a time budget it checks between them.

Invariants: the file on disk is always complete JSON (written to a temporary name, then
renamed), so a part that crashes or is killed midway leaves what it measured so far, with
``status: running``; the runner then marks it ``timeout`` or ``error``. A measurement that
raises (``Report.measure``) leaves its one-line error and traceback under its own key and
the part goes on; the part then ends as ``error``, naming it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from traceback import format_exc
from typing import Any

import torch

GIB = 1024**3


def one_line(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


@dataclass
class Budget:
    """Seconds a part may run; its sub-measurements ask ``allows`` before they start."""

    seconds: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def allows(self, seconds: float) -> bool:
        return self.left() >= seconds


@dataclass
class Report:
    """One part's JSON file: ``results`` is filled in by the part, ``save`` writes it."""

    path: Path
    part: int
    name: str
    dry_run: bool
    device: str
    budget_s: float
    results: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # "key: one line" per failed measurement
    started: float = field(default_factory=time.monotonic)

    def save(
        self, status: str = "running", error: str | None = None, trace: str | None = None
    ) -> None:
        """Write the file; ``error`` is one line, ``trace`` the traceback behind it."""
        write_json(
            self.path,
            {
                "part": self.part,
                "name": self.name,
                "status": status,  # running | ok | error | timeout
                "error": error,
                "traceback": trace,
                "dry_run": self.dry_run,
                "device": self.device,
                "budget_s": self.budget_s,
                "wall_s": round(time.monotonic() - self.started, 3),
                "results": self.results,
            },
        )

    def measure(self, key: str, run: Callable[[], dict[str, Any]]) -> None:
        """``results[key] = run()``, saved. An exception there becomes that key's error
        (its traceback kept) and the part goes on with its next measurement: on a device
        lent once, one failure must not cost the rest."""
        try:
            self.results[key] = run()
        except Exception as error:
            self.results[key] = {"error": one_line(error), "traceback": format_exc(limit=-8)}
            self.errors.append(f"{key}: {one_line(error)}")
        self.save()

    def skip(self, key: str, why: str) -> None:
        """A sub-measurement left out (out of budget, not possible here): said, not absent."""
        self.results[key] = {"skipped": why}
        self.save()


@dataclass
class Context:
    """What a part runs with: its device, whether the run is the CPU dry run, its budget
    and its report."""

    device: str  # "cuda" or "cpu"
    dry_run: bool
    out: Path
    budget: Budget
    report: Report


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    """Return cached blocks, so the next measurement's peak is its own."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    """``torch.cuda.max_memory_allocated`` in GiB since the last ``free_memory``; None on CPU."""
    if device != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated() / GIB, 3)


def allocated_gib(device: str) -> float | None:
    if device != "cuda":
        return None
    return round(torch.cuda.memory_allocated() / GIB, 3)
