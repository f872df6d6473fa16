"""SWE-smith task instances, as the published dataset stores them (``SWE-bench/SWE-smith``).

One record is one bug in one repository snapshot:

- ``instance_id``: ``<owner>__<project>.<commit8>.<bug kind>__<hash>``; the mirror
  repository holds the bugged code on a *branch* of this name;
- ``repo``: the mirror (``swesmith/<owner>__<project>.<commit8>``);
- ``patch``: the diff that introduced the bug (the gold fix is its reverse);
- ``FAIL_TO_PASS`` / ``PASS_TO_PASS``: pytest node ids that the bug breaks, and that pass
  with and without it; SWE-bench's own files keep them as JSON strings, SWE-smith's as
  lists, so both are read;
- ``image_name``: the container image with the project installed (on Kubernetes, the
  agent's Job runs it); ``base_commit``, ``created_at``;
- ``problem_statement``: the issue text the agent gets (empty in a third of the
  published records: the pipeline's first filter).

``read_instances`` reads the published files (jsonl, json or parquet, through the
dataset reader the trainer uses), keeping every other column in ``extra`` so that what
the pipeline writes back is the record it read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agl.core.datasets import DatasetError, read_rows

_REQUIRED = ("instance_id", "repo", "FAIL_TO_PASS", "PASS_TO_PASS")
_KNOWN = (
    "instance_id",
    "repo",
    "patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "image_name",
    "base_commit",
    "created_at",
    "problem_statement",
)


@dataclass(frozen=True)
class Instance:
    """One SWE-smith task: a bug, the tests it breaks and those it must leave passing."""

    instance_id: str
    repo: str
    FAIL_TO_PASS: tuple[str, ...]
    PASS_TO_PASS: tuple[str, ...]
    patch: str = ""
    image_name: str = ""
    base_commit: str = ""
    created_at: str = ""
    problem_statement: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def branch(self) -> str:
        """The mirror's branch with the bugged code: SWE-smith names it after the
        instance."""
        return self.instance_id

    @property
    def tests(self) -> tuple[str, ...]:
        """Every test the reward runs."""
        return self.FAIL_TO_PASS + self.PASS_TO_PASS

    def record(self) -> dict[str, Any]:
        """The record as the dataset stores it (test lists as lists)."""
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out["FAIL_TO_PASS"] = list(self.FAIL_TO_PASS)
        out["PASS_TO_PASS"] = list(self.PASS_TO_PASS)
        return {**out, **self.extra}


def _tests(value: object, name: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):  # SWE-bench's files: a JSON array in a string
        try:
            value = json.loads(value)
        except ValueError:
            raise DatasetError(f"{where}: {name} is a string but not a JSON list") from None
    if hasattr(value, "tolist"):  # parquet through pandas: a numpy array
        value = value.tolist()
    if not isinstance(value, list | tuple) or not all(isinstance(t, str) for t in value):
        raise DatasetError(f"{where}: {name} must be a list of test ids")
    return tuple(value)


def instance_of(row: Mapping[str, Any], where: str = "record") -> Instance:
    """A record (a dataset row) as an ``Instance``; ``DatasetError`` names what is wrong."""
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise DatasetError(f"{where}: missing {', '.join(missing)}")
    text = {}
    for key in ("instance_id", "repo", "patch", "image_name", "base_commit", "created_at"):
        value = row.get(key) or ""
        if not isinstance(value, str):
            raise DatasetError(f"{where}: {key} must be a string")
        text[key] = value
    if not text["instance_id"]:
        raise DatasetError(f"{where}: empty instance_id")
    statement = row.get("problem_statement")
    return Instance(
        **text,
        FAIL_TO_PASS=_tests(row["FAIL_TO_PASS"], "FAIL_TO_PASS", where),
        PASS_TO_PASS=_tests(row["PASS_TO_PASS"], "PASS_TO_PASS", where),
        problem_statement=statement if isinstance(statement, str) else "",
        extra={k: v for k, v in row.items() if k not in _KNOWN},
    )


def read_instances(paths: Sequence[str | Path]) -> list[Instance]:
    """Every instance of ``paths`` (jsonl, json or parquet), in order; instance ids must be
    unique."""
    rows = read_rows(paths)
    instances = [instance_of(row, f"record {i}") for i, row in enumerate(rows)]
    seen: set[str] = set()
    for item in instances:
        if item.instance_id in seen:
            raise DatasetError(f"instance {item.instance_id!r} appears twice")
        seen.add(item.instance_id)
    return instances


def write_instances(path: Path, instances: Iterable[Instance]) -> None:
    """``instances`` as JSON lines (written whole, then moved into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(path.suffix + ".partial")
    with partial.open("w", encoding="utf-8") as out:
        for item in instances:
            out.write(json.dumps(item.record(), sort_keys=True) + "\n")
    partial.replace(path)
