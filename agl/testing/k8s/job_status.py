"""Jobs as the node handles them (JSON objects, ``Manifest``), and the status the Job
controller writes when a Job ends: pure functions, no API calls."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

# The node handles Jobs as the server sends them (JSON objects), not as V1Job models: the
# client takes ~3 ms of CPU to build one, under the GIL of the process the node shares with
# what it tests, and a benchmark's 1,000 Jobs, each seen ~3 times, would make that the
# bottleneck. A V1Job is built only for the ``start``/``outcome`` callbacks, once per Job.

Manifest = dict[str, Any]  # a Kubernetes object as JSON


def job_uid(job: Manifest) -> str:
    return str(job["metadata"]["uid"])


def job_name(job: Manifest) -> str:
    return str(job["metadata"]["name"])


def rfc3339(moment: datetime) -> str:
    """As metav1.Time serializes: seconds, UTC."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_terminal(job: Manifest) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conditions
    )


def _condition(kind: str, reason: str, message: str, now: str) -> dict[str, str]:
    return {
        "type": kind,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastProbeTime": now,
        "lastTransitionTime": now,
    }


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str


BACKOFF_LIMIT_EXCEEDED = Failure(
    "BackoffLimitExceeded", "Job has reached the specified backoff limit"
)
DEADLINE_EXCEEDED = Failure("DeadlineExceeded", "Job was active longer than specified deadline")
_COMPLETIONS_REACHED = ("CompletionsReached", "Reached expected number of succeeded pods")


def final_status(failure: Failure | None, now: datetime) -> dict[str, Any]:
    """The status the Job controller (1.31+) writes when the Job's one pod succeeded
    (``failure`` None) or the Job failed: the interim condition and the terminal one.

    The simulator is the only writer of a Job's conditions: a merge patch replaces the list.
    """
    ts = rfc3339(now)
    if failure is None:
        return {
            "active": 0,
            "succeeded": 1,
            "completionTime": ts,
            "conditions": [
                _condition("SuccessCriteriaMet", *_COMPLETIONS_REACHED, ts),
                _condition("Complete", *_COMPLETIONS_REACHED, ts),
            ],
        }
    return {
        "active": 0,
        "failed": 1,
        "conditions": [
            _condition("FailureTarget", failure.reason, failure.message, ts),
            _condition("Failed", failure.reason, failure.message, ts),
        ],
    }
