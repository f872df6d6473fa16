"""Reading a Job as the API server answers it (JSON, not the client's models): the attempt
it runs, from its annotations, and whether and how it finished, from its conditions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agl.backends.execution.k8s.naming import ATTEMPT, ROLLOUT_ID


def job_outcome(job: Mapping[str, Any]) -> tuple[bool, str | None]:
    """(finished, error): Complete → (True, None); Failed → (True, "Job failed (...)")."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("status") != "True":
            continue
        if condition.get("type") == "Complete":
            return True, None
        if condition.get("type") == "Failed":
            reason = condition.get("reason") or "Failed"
            message = condition.get("message") or ""
            return True, f"Job failed ({reason}): {message}".rstrip(": ")[:500]
    return False, None


def job_attempt(job: Mapping[str, Any]) -> tuple[str, int] | None:
    meta = job.get("metadata") or {}
    notes = meta.get("annotations") or {}
    try:
        return str(notes[ROLLOUT_ID]), int(notes[ATTEMPT])
    except (KeyError, TypeError, ValueError):
        return None
