"""The agent's log of one rollout: what the controller recorded, and the run folder's.

Where agents write (``agl.backends.execution.local``): a command harness gets its own
``attempts/<rollout_id>.<attempt>.out`` and ``.err``; Python harnesses share the long-lived
workers' ``workers/worker-N.log``, so their lines are those that name the rollout (its
proxy calls, its errors) and the lines that continue them (a traceback). Agents on
Kubernetes log to their pods; the controller reads each container's log before it deletes
the Job and records it as the attempt's ``agent_log`` event (``recorded_logs``).

A file is read in pieces of ``CHUNK_BYTES``, so what a page costs does not grow with the
file (a 64 MiB log read whole once cost the gateway 1.6 GB a page): an attempt's own file
only as far back from its end as its last ``MAX_LINES`` lines (at most ``KEPT_BYTES``);
a worker's log from its last ``SCAN_BYTES`` on, keeping the last ``MAX_LINES`` lines
about the rollout (at most ``KEPT_BYTES`` characters of them).
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from agl.core.contracts.execution import AGENT_LOG_EVENT, agent_logs_of
from agl.core.contracts.records import Event

MAX_LINES = 2000
KEPT_BYTES = 2 * 2**20  # what one part shows at most
SCAN_BYTES = 64 * 2**20  # a worker's log is searched only this far back from its end
CHUNK_BYTES = 64 * 2**10  # one read; a line longer than this is read as several
_NEW_RECORD = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d")  # logging's asctime


@dataclass(frozen=True)
class LogPart:
    source: str  # the file, relative to the run folder; or the pod and container
    lines: list[str]
    truncated: bool
    note: str = ""  # how it ended, why there is nothing to read


def recorded_logs(events: list[Event]) -> list[LogPart]:
    """The logs the controller recorded with the attempts (a pod's containers)."""
    parts = []
    for event in events:
        if event.type != AGENT_LOG_EVENT:
            continue
        for log in agent_logs_of(event.data):
            lines = log.lines()
            note = "; ".join(n for n in (log.reason, log.note) if n)
            source = f"attempt {event.attempt}: {log.source}"
            cut = log.truncated or len(lines) > MAX_LINES
            parts.append(LogPart(source, lines[-MAX_LINES:], cut, note))
    return parts


def agent_log(run: Path, rollout_id: str, attempts: int) -> list[LogPart]:
    """Every attempt's own files, then the workers' lines about the rollout (which name
    no attempt reliably, so they are not split by attempt)."""
    parts = []
    for attempt in range(1, attempts + 1):
        for suffix in ("out", "err"):
            path = run / "attempts" / f"{rollout_id}.{attempt}.{suffix}"
            if path.is_file():
                lines, truncated = _tail(path)
                parts.append(LogPart(str(path.relative_to(run)), lines, truncated))
    # An id is followed by '/' (a proxy URL) or a space or ':' in a log line; a dot may
    # end a sentence, but not continue into another id ("t0.1.3" is not "t0.1.30").
    mention = re.compile(rf"(?<![\w.:-]){re.escape(rollout_id)}(?![\w:-]|\.\w)")
    for path in sorted((run / "workers").glob("worker-*.log")):
        part = _mentions(path, str(path.relative_to(run)), rollout_id.encode(), mention)
        if part.lines:
            parts.append(part)
    return parts


def _tail(path: Path) -> tuple[list[str], bool]:
    """The file's last ``MAX_LINES`` lines, read backwards a chunk at a time until they
    are in or ``KEPT_BYTES`` are; and whether anything before them was left out."""
    chunks: list[bytes] = []
    newlines = read = 0
    with path.open("rb") as f:
        start = f.seek(0, os.SEEK_END)
        while start > 0 and newlines <= MAX_LINES and read < KEPT_BYTES:
            size = min(CHUNK_BYTES, start, KEPT_BYTES - read)
            start -= size
            f.seek(start)
            chunk = f.read(size)
            chunks.append(chunk)
            newlines += chunk.count(b"\n")
            read += size
    lines = b"".join(reversed(chunks)).decode("utf-8", "replace").splitlines()
    return lines[-MAX_LINES:], start > 0 or len(lines) > MAX_LINES


@dataclass
class _LastLines:
    """The last ``MAX_LINES`` lines added, at most ``KEPT_BYTES`` characters together."""

    lines: deque[str] = field(default_factory=deque)
    chars: int = 0
    dropped: bool = False

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.chars += len(line)
        while len(self.lines) > MAX_LINES or self.chars > KEPT_BYTES:
            self.chars -= len(self.lines.popleft())
            self.dropped = True


def _mentions(path: Path, source: str, needle: bytes, mention: re.Pattern[str]) -> LogPart:
    """The lines of the file's last ``SCAN_BYTES`` that name the rollout, with the lines
    that continue each (up to the next record); the last ``MAX_LINES`` of them kept."""
    kept = _LastLines()
    following = False
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = f.seek(max(0, size - SCAN_BYTES))
        for block in _blocks(f, size - start):
            # Lines that do not name the rollout matter only while one is continued.
            if not following and needle not in block:
                continue
            for line in _lines(block):
                if mention.search(line):
                    following = True
                elif _NEW_RECORD.match(line):
                    following = False
                if following:
                    kept.add(line)
    searched = f"only the last {SCAN_BYTES // 2**20} MiB of the file were searched"
    return LogPart(source, list(kept.lines), kept.dropped, searched if size > SCAN_BYTES else "")


def _blocks(f: BinaryIO, size: int) -> Iterator[bytes]:
    """The next ``size`` bytes of ``f`` (not what an agent writes meanwhile), read
    ``CHUNK_BYTES`` at a time, as blocks of whole lines. A line that reaches
    ``CHUNK_BYTES`` unended is let out as it is, so that no line is held whole however
    long it is."""
    rest = b""
    while size > 0 and (chunk := f.read(min(CHUNK_BYTES, size))):
        size -= len(chunk)
        whole, newline, rest = (rest + chunk).rpartition(b"\n")
        if newline:
            yield whole + newline
        if len(rest) >= CHUNK_BYTES:
            yield rest
            rest = b""
    if rest:
        yield rest


def _lines(block: bytes) -> list[str]:
    """A block's lines as ``str.splitlines`` cuts the file's text (a block ends a line)."""
    return block.decode("utf-8", "replace").splitlines()
