"""Rollout inputs from dataset files (``task.train_files`` / ``task.val_files``), as verl
and Agent Lightning read them: JSON lines or parquet, several files one after another,
each row mapped to an input by ``task.columns`` and shuffled anew every epoch.

Invariants (``DatasetStream``):

- every epoch is a permutation of all rows: each row once, before any row again;
- the rows of a step depend only on (rows, seed, step, n): a resumed run, or one started
  with other batch sizes before, gets the same inputs for the same step;
- a bad file says so in one line naming it (``DatasetError``).
"""

from __future__ import annotations

import copy
import functools
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names it and says why."""


def read_rows(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every row of ``paths``, in order: ``.jsonl`` (one JSON object a line), ``.json``
    (an array of objects) or ``.parquet``."""
    if not paths:
        raise DatasetError("no dataset files given")
    rows: list[dict[str, Any]] = []
    for path in map(Path, paths):
        found = _read_file(path)
        if not found:
            raise DatasetError(f"{path}: the file has no rows")
        for i, row in enumerate(found):  # a rollout input is JSON (dates, bytes are not)
            try:
                json.dumps(row, allow_nan=False)
            except (TypeError, ValueError) as error:
                raise DatasetError(f"{path}: row {i} is not JSON data ({error})") from None
        rows.extend(found)
    return rows


def _read_file(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix not in (".jsonl", ".json"):
        raise DatasetError(f"{path}: unknown format {suffix!r} (.jsonl, .json or .parquet)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{path}: cannot be read ({error})") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as error:
            raise DatasetError(f"{path}: not JSON ({error})") from None
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a .json dataset is an array of objects")
        return [_object(row, path, f"item {i}") for i, row in enumerate(data)]
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise DatasetError(f"{path}:{number}: not JSON ({error})") from None
        rows.append(_object(row, path, f"line {number}"))
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as error:
        raise DatasetError(f"{path}: not a readable parquet file ({error})") from None
    return table.to_pylist()


def _object(row: object, path: Path, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DatasetError(f"{path}: {where} is not a JSON object")
    return row


def map_columns(
    rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str], source: str
) -> list[dict[str, Any]]:
    """Each row as a rollout input: ``{key: row[column]}`` for ``columns`` (a dotted
    column reads into nested objects: ``reward_model.ground_truth``); the whole row when
    ``columns`` is empty. ``source`` names the files in errors."""
    if not columns:
        return [dict(row) for row in rows]
    return [
        {key: _column(row, column, source, i, key) for key, column in columns.items()}
        for i, row in enumerate(rows)
    ]


def _column(row: Mapping[str, Any], column: str, source: str, index: int, key: str) -> Any:
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise DatasetError(
                f"{source}: row {index} has no column {column!r} (task.columns.{key}); "
                f"its columns: {', '.join(sorted(row))}"
            )
        value = value[part]
    return value


@dataclass(frozen=True)
class DatasetStream:
    """The rows as an endless stream of epochs, each in its own order (shuffled by
    ``seed`` and the epoch's number, or the file order)."""

    rows: Sequence[dict[str, Any]]
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not self.rows:
            raise DatasetError("a dataset with no rows")

    def batch(self, step: int, n: int) -> list[dict[str, Any]]:
        """The ``n`` rows of ``step``: positions ``step * n`` to ``(step + 1) * n`` of the
        stream, across an epoch's end where they reach it."""
        if step < 0 or n < 0:
            raise ValueError(f"step {step} and n {n} must not be negative")
        size = len(self.rows)
        return [
            copy.deepcopy(self.rows[self._order(i // size)[i % size]])
            for i in range(step * n, (step + 1) * n)
        ]

    def first(self, n: int) -> list[dict[str, Any]]:
        """A fixed subset of ``n`` rows (all when there are fewer): the first of epoch 0,
        so a sorted file still gives a representative one."""
        return self.batch(0, min(n, len(self.rows)))

    def _order(self, epoch: int) -> Sequence[int]:
        size = len(self.rows)
        return _permutation(size, self.seed, epoch) if self.shuffle else range(size)


@functools.lru_cache(maxsize=8)
def _permutation(size: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(size))
    random.Random(f"agl-dataset-{seed}-{epoch}").shuffle(order)
    return tuple(order)
