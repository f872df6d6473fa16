"""How a Job (and its Secret) is tied to its attempt: the label and annotation keys the
controller owns, and the Job's deterministic, DNS-safe name per (instance, rollout, attempt)."""

from __future__ import annotations

import hashlib
import re

MANAGED_BY = "app.kubernetes.io/managed-by"
INSTANCE = "agl.dev/instance"
ROLLOUT = "agl.dev/rollout"
ATTEMPT = "agl.dev/attempt"
ROLE = "agl.dev/role"
ROLLOUT_ID = "agl.dev/rollout-id"  # annotation: the exact id (a label value is limited)
NAME_MAX = 63  # a Job's name becomes a label value of its pods


def _slug(text: str, limit: int) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-")


def job_name(instance: str, rollout_id: str, attempt: int) -> str:
    """A DNS-1123 label, unique per (instance, rollout, attempt), readable where it can."""
    digest = hashlib.sha256(f"{instance}/{rollout_id}".encode()).hexdigest()[:10]
    tail = f"-{digest}-{attempt}"
    head = _slug(f"{instance}-{rollout_id}", NAME_MAX - len(tail))
    return f"{head}{tail}"


def rollout_label(rollout_id: str) -> str:
    """The rollout id where it is a valid label value, else a slug plus a digest."""
    if re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", rollout_id):
        return rollout_id
    digest = hashlib.sha256(rollout_id.encode()).hexdigest()[:10]
    return f"{_slug(rollout_id, 50) or 'r'}-{digest}"
