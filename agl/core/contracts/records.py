"""The gateway's records and the rollout state machine (docs/design.md, "Records").

These pydantic models are the wire format: the gateway validates requests with them and
the client parses answers into them, so the two cannot drift apart.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import from_json


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
    ValueError saying why and where (a dotted path, as pydantic names a field): nesting
    deeper than ``MAX_JSON_DEPTH``, an integer past 64 bits, a NaN or infinite number
    (not JSON; it would come back as null)."""
    stack: list[tuple[Any, int, _Path]] = [(value, 1, None)]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels{_at(path)}")
            if isinstance(item, list) and _plain_list(item):
                continue
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            stack.extend((child, depth + 1, (path, key)) for key, child in pairs)
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int) and not _INT_RANGE[0] <= item < _INT_RANGE[1]:
            raise ValueError(f"an integer does not fit in 64 bits{_at(path)}")
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"NaN and infinite numbers are not JSON{_at(path)}")
    return value


def parse_storable(body: bytes) -> Any:
    """``body`` read as JSON that ``storable`` accepts, else ValueError saying why.
    Integers are read exactly: orjson reads one past 64 bits as a float, which would then
    be forwarded and recorded as a number nobody sent."""
    try:
        value = from_json(body, allow_inf_nan=False)
    except ValueError as error:
        if str(error).startswith("recursion limit exceeded"):  # the parser's own, at 200
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
        raise ValueError(f"not valid JSON: {error}") from None
    return storable(value)


# Where an item sits, as a linked list from the innermost key out: cheap to make for
# every item, spelled out only for the one that is refused.
_Path = tuple["_Path", "str | int"] | None
_SHOWN_KEYS = 8


def _at(path: _Path) -> str:
    keys: list[str] = []
    while path is not None:
        path, key = path
        keys.append(str(key))
    if not keys:
        return ""
    keys.reverse()
    shown = ".".join(keys[:_SHOWN_KEYS]) + (" ..." if len(keys) > _SHOWN_KEYS else "")
    return f" (at {shown})"


def _plain_list(items: list[Any]) -> bool:
    """Whether a list holds only scalars that are storable, checked at C speed: token
    ids and logprobs are long flat lists, walked item by item otherwise."""
    kinds = set(map(type, items))
    if kinds <= {str, bool, type(None)}:
        return True
    if kinds == {int}:
        return bool(_INT_RANGE[0] <= min(items) and max(items) < _INT_RANGE[1])
    if kinds == {float}:
        return all(map(math.isfinite, items))
    return False


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
    # The current attempt's two keys (agl/core/gateway/auth.py), in the admin's answers only.
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
