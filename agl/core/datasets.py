"""Rollout inputs from dataset files (``task.train_files`` / ``task.val_files``), as verl
and Agent Lightning read them: JSON lines or parquet, several files one after another,
each row mapped to an input by ``task.columns`` and shuffled anew every epoch.

Invariants (``read_rows``, ``DatasetStream``):

- every epoch is a permutation of all rows: each row once, before any row again;
- the rows of a step depend only on (rows, seed, step, n): a resumed run, or one started
  with other batch sizes before, gets the same inputs for the same step;
- a bad file says so in one line naming it, and the row where one is to blame
  (``DatasetError``), when the files are read, before the run starts: every row read is
  a JSON object that the gateway stores as a rollout input as it is (``storable``:
  nested at most ``MAX_JSON_DEPTH`` levels, integers of 64 bits, no NaN), so no row
  fails later, when it is copied, sent or stored;
- what a read holds is bounded by ``DatasetLimits``: a file's bytes, a parquet file's
  decoded size, the rows, a row's size. Reading stops at the first row past one; a
  parquet file's decoded sizes are known before its rows are decoded
  (``agl.core.parquet_sizes``), so a small file that expands is refused small;
- a JSON Lines row ends at ``\\n`` only: a line separator in a string (U+2028) is text.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.core.contracts.records import MAX_JSON_DEPTH, storable

if TYPE_CHECKING:  # pyarrow and numpy are imported when a parquet file is read
    import pyarrow.parquet as pq

    from agl.core.parquet_sizes import Sizes


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names it and says why."""


@dataclass(frozen=True)
class DatasetLimits:
    """What one read of dataset files may hold (``task.dataset_limits``; a task raises
    one it needs more of). Each bounds the trainer's memory. A row's nesting is not one
    of them: the gateway stores at most ``MAX_JSON_DEPTH`` levels, so a row has no more."""

    max_file_bytes: int = 512 << 20  # a file's bytes, and a parquet file's decoded size
    max_rows: int = 1_000_000  # the rows of the files read together (train, or val)
    max_row_bytes: int = 1 << 20  # a row's line or item, or its decoded parquet values

    def __post_init__(self) -> None:
        for name in self._names():
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"task.dataset_limits.{name}={value!r}: a positive whole number")

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> DatasetLimits:
        """The limits ``settings`` names, the defaults for the others."""
        unknown = sorted(set(settings) - set(cls._names()))
        if unknown:
            raise ValueError(
                f"task.dataset_limits has no {', '.join(unknown)} "
                f"(it has {', '.join(cls._names())})"
            )
        return cls(**settings)

    @classmethod
    def _names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def setting(self, name: str) -> str:
        """The limit ``name`` as set, for messages: a user raises it there."""
        return f"task.dataset_limits.{name}={getattr(self, name)}"


DEFAULT_LIMITS = DatasetLimits()

_Rows = Iterator[tuple[str, dict[str, Any]]]  # (where in its file: a line, an item, a row; the row)


def read_rows(
    paths: Sequence[str | Path], limits: DatasetLimits = DEFAULT_LIMITS
) -> list[dict[str, Any]]:
    """Every row of ``paths``, in order: ``.jsonl`` (one JSON object a line), ``.json``
    (an array of objects) or ``.parquet``."""
    if not paths:
        raise DatasetError("no dataset files given")
    rows: list[dict[str, Any]] = []
    for path in map(Path, paths):
        before = len(rows)
        for where, row in _file_rows(path, limits, limits.max_rows - len(rows)):
            if len(rows) == limits.max_rows:
                raise DatasetError(f"{path}: {where}: more rows than {limits.setting('max_rows')}")
            rows.append(row)
        if len(rows) == before:
            raise DatasetError(f"{path}: the file has no rows")
    return rows


def _input(row: object, path: Path, where: str) -> dict[str, Any]:
    """``row`` if it is a rollout input the gateway will store as it is."""
    if not isinstance(row, dict):
        raise DatasetError(f"{path}: {where} is not a JSON object")
    try:  # it walks a row without recursing: one too deep to recurse on stops here
        storable(row)
    except ValueError as error:
        raise DatasetError(f"{path}: {where}: {error}") from None
    return row


def _file_rows(path: Path, limits: DatasetLimits, room: int) -> _Rows:
    """The rows of ``path``, read lazily; ``room``: how many more rows the read may hold."""
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise DatasetError(f"{path}: unknown format {suffix!r} (.jsonl, .json or .parquet)")
    size = path.stat().st_size
    if size > limits.max_file_bytes:
        raise DatasetError(f"{path}: {size} bytes, more than {limits.setting('max_file_bytes')}")
    if suffix == ".parquet":
        return _parquet_rows(path, limits, room)
    if suffix == ".json":
        return _json_rows(path, _text(path, limits), limits)
    return _jsonl_rows(path, limits)


def _jsonl_rows(path: Path, limits: DatasetLimits) -> _Rows:
    # A line ends at "\n" (JSON Lines), not where str.splitlines ends one: that also
    # splits at U+2028, which a JSON string may hold as it is. A line is read no further
    # than just past its limit, however long it is.
    read = 0
    with path.open("rb") as file:
        for number in itertools.count(1):
            line = file.readline(limits.max_row_bytes + 2)  # + "\r\n"
            if not line:
                return
            where = f"line {number}"
            read += len(line)
            if read > limits.max_file_bytes:  # a file that grew since it was sized
                raise DatasetError(
                    f"{path}: {where}: the file is longer than {limits.setting('max_file_bytes')}"
                )
            if len(line.rstrip(b"\r\n")) > limits.max_row_bytes:
                raise DatasetError(
                    f"{path}: {where} is longer than {limits.setting('max_row_bytes')}"
                )
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DatasetError(f"{path}:{number}: not UTF-8 ({error})") from None
            if text.strip():
                yield where, _input(_parsed(text, path, where, f"{path}:{number}"), path, where)


def _parsed(text: str, path: Path, where: str, at: str) -> object:
    try:
        return json.loads(text)
    except ValueError as error:
        raise DatasetError(f"{at}: not JSON ({error})") from None
    except RecursionError:  # json recurses once a level: far deeper than a row may nest
        raise DatasetError(f"{path}: {where}: {_TOO_DEEP}") from None


_TOO_DEEP = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"


def _text(path: Path, limits: DatasetLimits) -> str:
    with path.open("rb") as file:
        data = file.read(limits.max_file_bytes + 1)
    if len(data) > limits.max_file_bytes:  # a file that grew since it was sized
        raise DatasetError(f"{path}: the file is longer than {limits.setting('max_file_bytes')}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path}: cannot be read ({error})") from None


def _json_rows(path: Path, text: str, limits: DatasetLimits) -> _Rows:
    """The items of a JSON array, parsed one at a time: json.loads would parse them all
    before one could be counted or refused."""
    decoder = json.JSONDecoder()
    position = _skip(text, 0)
    if not text.startswith("[", position):
        raise DatasetError(f"{path}: a .json dataset is an array of objects")
    position, index = _skip(text, position + 1), 0
    while not text.startswith("]", position):
        if index:
            if not text.startswith(",", position):
                raise DatasetError(f"{path}: not JSON (',' or ']' expected at {position})")
            position = _skip(text, position + 1)
        where = f"item {index}"
        try:
            item, end = decoder.raw_decode(text, position)
        except ValueError as error:
            raise DatasetError(f"{path}: {where}: not JSON ({error})") from None
        except RecursionError:  # as in _parsed
            raise DatasetError(f"{path}: {where}: {_TOO_DEEP}") from None
        if len(text[position:end].encode()) > limits.max_row_bytes:
            raise DatasetError(f"{path}: {where} is longer than {limits.setting('max_row_bytes')}")
        yield where, _input(item, path, where)
        position, index = _skip(text, end), index + 1
    if _skip(text, position + 1) != len(text):
        raise DatasetError(f"{path}: not JSON (extra data after the array)")


_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's white space


def _skip(text: str, position: int) -> int:
    """Where the first character from ``position`` on that is not white space is."""
    match = _SPACE.match(text, position)
    return match.end() if match else position


def _parquet_rows(path: Path, limits: DatasetLimits, room: int) -> _Rows:
    """A row group at a time, read compactly (strings as dictionaries) and sized before
    its rows are decoded; the footer alone refuses a file it shows is past a limit."""
    import pyarrow as pa

    from agl.core import parquet_sizes

    with _parquet_file(path) as file:
        metadata = file.metadata
        if metadata.num_rows > room:
            raise DatasetError(f"{path}: row {room}: more rows than {limits.setting('max_rows')}")
        bound = parquet_sizes.compact_bound(metadata, file.schema)
        if bound > limits.max_file_bytes:
            raise DatasetError(
                f"{path}: its footer says it holds {bound} bytes decoded, "
                f"more than {limits.setting('max_file_bytes')}"
            )
        first, total = 0, 0
        for group in range(metadata.num_row_groups):
            try:
                table = file.read_row_group(group, use_threads=False)
                sizes = parquet_sizes.row_sizes(table)
            except (OSError, ValueError, pa.ArrowException) as error:
                raise DatasetError(
                    f"{path}: not a readable parquet file ({_line(error)})"
                ) from None
            total = _check_sizes(path, first, sizes, total, limits)
            for i, row in enumerate(table.to_pylist()):
                where = f"row {first + i}"
                yield where, _json_data(_input(row, path, where), path, where)
            first += table.num_rows


def _parquet_file(path: Path) -> pq.ParquetFile:
    """``path`` open, its string and binary columns to be read as dictionaries."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from agl.core.parquet_sizes import byte_columns

    try:
        with pq.ParquetFile(path) as footer:
            metadata, columns = footer.metadata, byte_columns(footer.schema)
        return pq.ParquetFile(path, metadata=metadata, read_dictionary=columns)
    except (OSError, pa.ArrowException) as error:
        raise DatasetError(f"{path}: not a readable parquet file ({_line(error)})") from None


def _check_sizes(path: Path, first: int, sizes: Sizes, total: int, limits: DatasetLimits) -> int:
    """The decoded size of the rows read so far, ``total`` before these rows (numbered
    from ``first``, sized ``sizes``); DatasetError at the first row past a limit."""
    import numpy as np

    running = total + np.cumsum(sizes)
    over = np.flatnonzero((sizes > limits.max_row_bytes) | (running > limits.max_file_bytes))
    if over.size:
        i = int(over[0])
        if sizes[i] > limits.max_row_bytes:
            raise DatasetError(
                f"{path}: row {first + i} decodes to {sizes[i]} bytes, "
                f"more than {limits.setting('max_row_bytes')}"
            )
        raise DatasetError(
            f"{path}: the rows up to row {first + i} decode to {running[i]} bytes, "
            f"more than {limits.setting('max_file_bytes')}"
        )
    return int(running[-1]) if running.size else total


def _json_data(row: dict[str, Any], path: Path, where: str) -> dict[str, Any]:
    """``row`` if it holds JSON values only: a parquet row may hold dates or bytes."""
    try:  # storable has bounded its depth: this recursion cannot run out
        json.dumps(row, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise DatasetError(f"{path}: {where} is not JSON data ({error})") from None
    return row


def _line(error: Exception) -> str:
    return " ".join(str(error).split())


def map_columns(
    rows: Sequence[dict[str, Any]], columns: Mapping[str, str], source: str
) -> list[dict[str, Any]]:
    """Each row as a rollout input: ``{key: row[column]}`` for ``columns`` (a dotted
    column reads into nested objects: ``reward_model.ground_truth``); the whole row when
    ``columns`` is empty. ``source`` names the files in errors."""
    if not columns:  # the rows themselves: read for this, they are no one else's
        return list(rows)
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
