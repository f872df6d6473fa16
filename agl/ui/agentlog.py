"""The agent's log of one rollout: what the controller recorded, and the run folder's.

Where agents write (``agl.backends.execution.local``): a command harness gets its own
``attempts/<rollout_id>.<attempt>.out`` and ``.err``; Python harnesses share the long-lived
workers' ``workers/worker-N.log``, so their lines are those that name the rollout (its
proxy calls, its errors) and the lines that continue them (a traceback). Agents on
Kubernetes log to their pods; the controller reads each container's log before it deletes
the Job and records it as the attempt's ``agent_log`` event (``recorded_logs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from agl.core.contracts.execution import AGENT_LOG_EVENT, agent_logs_of
from agl.core.contracts.records import Event

MAX_BYTES = 64 * 2**20  # read at most the last 64 MiB of a file
MAX_LINES = 2000
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
        lines, truncated = _mentions(path, mention)
        if lines:
            parts.append(LogPart(str(path.relative_to(run)), lines, truncated))
    return parts


def _read(path: Path) -> tuple[str, bool]:
    with path.open("rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - MAX_BYTES))
        return f.read().decode("utf-8", "replace"), size > MAX_BYTES


def _tail(path: Path) -> tuple[list[str], bool]:
    text, cut = _read(path)
    lines = text.splitlines()
    return lines[-MAX_LINES:], cut or len(lines) > MAX_LINES


def _mentions(path: Path, mention: re.Pattern[str]) -> tuple[list[str], bool]:
    text, cut = _read(path)
    if not mention.search(text):
        return [], False
    found: list[str] = []
    following = False
    for line in text.splitlines():
        if mention.search(line):
            following = True
        elif _NEW_RECORD.match(line):
            following = False
        if following:
            if len(found) == MAX_LINES:
                return found, True
            found.append(line)
    return found, cut
