"""Why a rollout gave no reward, named by cause: the agent's, or the infrastructure's.

An **agent** failure is the policy's doing as far as the trainer can tell — the harness
raised, it ended without a reward, it ran out of time — and is a learning signal: a policy
that crashes its harness or loops until the deadline must be scored for it (by default
reward 0 in its group). An **infrastructure** failure says nothing about the policy — the
worker or pod running the agent died or was lost, the model endpoint failed, the gateway
could not be reached — so it is retried while attempts remain and then left out.

The cause is a pure function of what the store holds (the attempt's status and error, its
reward, its failed model calls), so the controller (which retries) and the trainer (which
scores) reach the same verdict without talking to each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from agl.core.contracts.records import MODEL_REQUEST_FAILED, Event, Rollout, Status


class Cause(StrEnum):
    HARNESS_ERROR = "harness_error"  # the harness raised or exited non-zero
    NO_REWARD = "no_reward"  # it ended without reporting a reward (or a status)
    TIMEOUT = "timeout"  # the attempt ran past its deadline
    # The task's grader raised on what the agent left (agl/grading/): the agent's, so
    # that breaking what the grader reads never escapes a zero.
    GRADER = "grader"
    EXECUTOR = "executor"  # the worker / pod running it died, was lost or stopped
    UPSTREAM = "upstream"  # a model call failed at the inference endpoint
    GATEWAY = "gateway"  # the agent could not reach the gateway

    @property
    def agent(self) -> bool:
        return self in _AGENT


_AGENT = frozenset({Cause.HARNESS_ERROR, Cause.NO_REWARD, Cause.TIMEOUT, Cause.GRADER})

# Error texts the execution side writes (agl.core.controller.reconcile, agl.backends.execution,
# agl.core.gateway.app, agl.core.trainer.loop), by the cause they name.
_EXECUTOR_PREFIXES = (
    "worker exited with code",
    "worker killed by signal",
    "no live worker",
    "cannot start the command",
    "no execution found",  # controller.LOST
    "stopped by the controller",  # controller.ORPHANED
    "controller stopped",  # controller.STOPPED
    "interrupted:",  # the trainer restarted
)
GRADER_RAISED = "grader raised"  # how agl/grading/'s attempts fail when their grader raises
GRADE_NOT_POSTED = "cannot report the grade: "  # ... when the gateway took no grade
_TIMEOUT_PREFIXES = ("timed out after", "attempt timed out", "Job failed (DeadlineExceeded)")
_NO_STATUS = "agent exited without reporting a status"
# Exceptions a harness raises when the gateway is not there to answer (openai, httpx).
_UNREACHABLE = (
    "APIConnectionError",
    "APITimeoutError",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionRefusedError",
    "RemoteProtocolError",
)


def failure_cause(
    status: Status,
    error: str | None,
    has_reward: bool,
    failed_calls: Iterable[Mapping[str, Any]] = (),
) -> Cause | None:
    """The cause of a rollout attempt's end, None when it succeeded with a reward.

    ``failed_calls``: the data of the attempt's ``model_request_failed`` events; an
    endpoint error (5xx, or unreachable) among them makes the failure the upstream's.
    """
    if status is Status.SUCCEEDED:
        return None if has_reward else Cause.NO_REWARD
    if status is not Status.FAILED:
        raise ValueError(f"a rollout {status.value} has not ended")
    text = (error or "").strip()
    if text.startswith(_EXECUTOR_PREFIXES):
        return Cause.EXECUTOR
    if text.startswith(GRADER_RAISED):  # whatever it raised, even a connection error
        return Cause.GRADER
    if any(_is_endpoint_error(d) for d in failed_calls):
        return Cause.UPSTREAM
    # The exception's type, never a word of its message: a harness's message may carry
    # the model's text, which must not pass the agent's failure off as the gateway's.
    if text.removeprefix(GRADE_NOT_POSTED).partition(":")[0].strip() in _UNREACHABLE:
        return Cause.GATEWAY
    if text.startswith(_TIMEOUT_PREFIXES):
        return Cause.TIMEOUT
    if text.startswith(_NO_STATUS) or not text:
        return Cause.NO_REWARD
    return Cause.HARNESS_ERROR


def _is_endpoint_error(data: Mapping[str, Any]) -> bool:
    status = data.get("status")
    return isinstance(status, int) and (status >= 500 or status == 429)


def attempt_cause(rollout: Rollout, events: Sequence[Event], has_reward: bool) -> Cause | None:
    """``failure_cause`` of the rollout's current attempt, from its events."""
    failed = [e.data for e in events if e.type == MODEL_REQUEST_FAILED]
    return failure_cause(rollout.status, rollout.error, has_reward, failed)


def is_final(rollout: Rollout, cause: Cause | None) -> bool:
    """No attempt will follow: it succeeded, the agent failed it (never retried), or
    attempts ran out."""
    if rollout.status is Status.SUCCEEDED or (cause is not None and cause.agent):
        return True
    return rollout.status is Status.FAILED and rollout.attempt >= rollout.max_attempts
