"""The gateway's records and the rollout state machine (DESIGN.md, "Records").

These pydantic models are the wire format: the gateway validates requests with them and
the client parses answers into them, so the two cannot drift apart.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


class Status(StrEnum):
    QUEUING = "queuing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED})

# The event types the recording proxy writes: a call it recorded, a call that failed.
MODEL_REQUEST = "model_request"
MODEL_REQUEST_FAILED = "model_request_failed"

# Legal moves. failed -> queuing starts the next attempt and is further bounded by
# max_attempts; queuing -> failed cancels a rollout that never started.
TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.QUEUING: frozenset({Status.RUNNING, Status.FAILED}),
    Status.RUNNING: frozenset({Status.SUCCEEDED, Status.FAILED}),
    Status.FAILED: frozenset({Status.QUEUING}),
    Status.SUCCEEDED: frozenset(),
}

Mode = Literal["train", "val"]

_ID_PATTERN = r"^[A-Za-z0-9._:\-]{1,200}$"

# What a caller's JSON may nest: what is stored is written back inside a few more levels
# (a page of events), and orjson writes at most 254.
MAX_JSON_DEPTH = 64
_INT_RANGE = (-(2**63), 2**64)  # what orjson can write back


def storable(value: Any) -> Any:
    """``value`` if the store can keep it exactly as sent and give it back, else
    ValueError saying why: nesting deeper than ``MAX_JSON_DEPTH``, an integer past 64
    bits, a NaN or infinite number (not JSON; it would come back as null)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int) and not _INT_RANGE[0] <= item < _INT_RANGE[1]:
            raise ValueError("an integer does not fit in 64 bits")
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError("NaN and infinite numbers are not JSON")
    return value


StorableJson = Annotated[Any, AfterValidator(storable)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutSpec(_Strict):
    """One element of the body of POST /api/rollouts."""

    rollout_id: str = Field(pattern=_ID_PATTERN)
    group_id: str = Field(default="", max_length=200)
    input: StorableJson = None
    mode: Mode = "train"
    metadata: Annotated[dict[str, Any], AfterValidator(storable)] = Field(default_factory=dict)
    max_attempts: int = Field(default=1, ge=1, le=100)
    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class Rollout(BaseModel):
    rollout_id: str
    group_id: str
    input: Any
    mode: Mode
    metadata: dict[str, Any]
    max_attempts: int
    timeout_s: float | None
    status: Status
    attempt: int
    version: int
    created_at: float
    updated_at: float
    started_at: float | None = None
    ended_at: float | None = None
    error: str | None = None
    # The current attempt's two keys (agl/core/auth.py), in the admin's answers only.
    attempt_key: str | None = None  # the model key: the proxy
    report_key: str | None = None  # events, the attempt's end, the rollout


class StatusPatch(_Strict):
    """Body of PATCH /api/rollouts/{id} and /api/rollouts/{id}/attempt/{attempt}.

    ``attempt`` names the attempt the caller believes is current. It makes a retried
    re-queue safe: asking to re-queue attempt 1 when attempt 2 already exists is a no-op.
    """

    status: Status
    attempt: int | None = Field(default=None, ge=1, le=1_000)
    error: str | None = Field(default=None, max_length=10_000)


class EventIn(_Strict):
    event_id: str | None = Field(default=None, pattern=_ID_PATTERN)
    type: str = Field(min_length=1, max_length=100)
    data: StorableJson = None


class Event(BaseModel):
    rollout_id: str
    attempt: int
    event_id: str
    sequence: int
    type: str
    data: Any
    time: float


class ModelEndpoint(_Strict):
    model: str = Field(min_length=1, max_length=200)
    endpoint: str = Field(pattern=r"^https?://.+/v1/?$")
    policy_version: int = Field(default=0, ge=0, lt=2**63)


class AdmissionIn(_Strict):
    state: Literal["paused", "running"]
    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class Admission(BaseModel):
    state: Literal["paused", "running"]
    in_flight: int
    waiting: int = 0
    drained: bool = True
