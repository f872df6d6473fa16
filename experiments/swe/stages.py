"""Resumable pipeline stages: each writes its instances and a report of what it removed.

A stage's folder holds ``instances.jsonl`` (what it kept, in the dataset's format) and
``report.json``: how many it read and kept, how many each reason removed, every removed
instance with its reason, the stage's own details, and a *digest* of its inputs (the
instances it read and its options). A stage whose folder already has a report with the
same digest is finished and is not run again; a changed input or option runs it anew.
The report is written last, so a stage stopped half-way is run again whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.swe.filters import Removed
from experiments.swe.instances import Instance, read_instances, write_instances

log = logging.getLogger(__name__)

INSTANCES = "instances.jsonl"
REPORT = "report.json"


@dataclass
class Outcome:
    """What a stage made of its input."""

    kept: list[Instance]
    removed: list[Removed] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


def digest(instances: Sequence[Instance], options: Mapping[str, Any]) -> str:
    """A stage's inputs, hashed: the records it reads and its options."""
    h = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode())
    for item in instances:
        h.update(json.dumps(item.record(), sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def finished(folder: Path, key: str) -> bool:
    """Whether ``folder`` holds this stage's output for inputs hashed to ``key``."""
    try:
        report = json.loads((folder / REPORT).read_text())
    except (OSError, ValueError):
        return False
    return report.get("digest") == key and (folder / INSTANCES).is_file()


def run_stage(
    name: str,
    folder: Path,
    instances: Sequence[Instance],
    options: Mapping[str, Any],
    work: Callable[[Sequence[Instance]], Outcome],
) -> list[Instance]:
    """``work`` over ``instances`` into ``folder``, unless a finished run with the same
    inputs is there; the stage's kept instances either way."""
    key = digest(instances, options)
    if finished(folder, key):
        log.info("%s: finished before (%s), skipped", name, folder)
        return read_instances([folder / INSTANCES])
    outcome = work(instances)
    folder.mkdir(parents=True, exist_ok=True)
    write_instances(folder / INSTANCES, outcome.kept)
    report = {
        "stage": name,
        "digest": key,
        "options": dict(options),
        "read": len(instances),
        "kept": len(outcome.kept),
        "removed": dict(Counter(r.kind for r in outcome.removed)),
        "details": outcome.details,
        "removed_instances": [
            {"instance_id": r.instance_id, "reason": r.reason} for r in outcome.removed
        ],
    }
    partial = folder / (REPORT + ".partial")
    partial.write_text(json.dumps(report, indent=1, default=str) + "\n")
    partial.replace(folder / REPORT)
    return outcome.kept


def summary_line(folder: Path) -> str:
    """One line from a stage's report: read, kept, removed by reason."""
    try:
        report = json.loads((folder / REPORT).read_text())
        return _summary(report)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{folder.name}: an unreadable report ({folder / REPORT})"


def _summary(report: dict[str, Any]) -> str:
    removed = ", ".join(f"{n} {kind}" for kind, n in sorted(report["removed"].items()))
    return f"{report['stage']}: {report['read']} read, {report['kept']} kept" + (
        f"; removed {removed}" if removed else ""
    )
