"""Reading an offline W&B run back, for tests: its ``run-*.wandb`` file is a log of W&B's
own protobuf ``Record`` messages (``wandb.proto``) in LevelDB's log format (blocks of
32 KiB, each record a 7-byte header: crc32, length, kind), after a 7-byte file header.
wandb 0.31 no longer ships a reader of its own."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[pb.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        chunk, pos = data[pos : pos + length], pos + length
        if kind == FULL:
            yield _record(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield _record(pending + chunk)
        elif kind == 0 and length == 0:
            pos += left - HEADER  # zero padding up to the block's end
        else:
            raise ValueError(f"{path}: unknown record kind {kind} at {pos}")


def _record(chunk: bytes) -> pb.Record:
    record = pb.Record()
    record.ParseFromString(chunk)
    return record


def history(run: Path) -> list[dict[str, Any]]:
    """The run's logged rows, each as {key: value} with ``_step``."""
    (log,) = run.glob("run-*.wandb")
    rows = []
    for record in records(log):
        if record.WhichOneof("record_type") == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                path = [item.key] if item.key else list(item.nested_key)
                at = row
                for part in path[:-1]:  # a media value comes as its fields, nested
                    at = at.setdefault(part, {})
                at[path[-1]] = json.loads(item.value_json)
            rows.append(row)
    return rows


def tables(run: Path, key: str) -> dict[int, dict[str, Any]]:
    """step -> the table logged under ``key`` at that step (its columns and data)."""
    found = {}
    for row in history(run):
        value = row.get(key)
        if isinstance(value, dict) and value.get("_type") == "table-file":
            found[int(row["_step"])] = json.loads((run / "files" / value["path"]).read_text())
    return found
