"""What the gateway's API answers about rollouts beyond their records: rows with their
attempt's summary, status transitions, and the queries that select them. Shared by the
store (which computes them), the client and the tools that read them (``agl.rollouts``,
the viewer).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from agl.core.contracts.records import Rollout, Status

# Meta key: when this store started recording transitions, if it held rollouts before
# (their status history is incomplete).
HISTORY_SINCE = "history_since"


@dataclass(frozen=True)
class RolloutQuery:
    statuses: frozenset[Status] = frozenset()
    mode: str | None = None
    group_id: str | None = None
    after: int = 0
    limit: int = 100


@dataclass(frozen=True)
class EventQuery:
    attempt: int | None = None
    type: str | None = None
    after: int = 0
    limit: int = 1000


@dataclass(frozen=True)
class Summary:
    """One attempt of a rollout in numbers, kept up to date as its events are appended.

    ``tokens`` counts sampled (response) tokens over all calls, ``context`` is the longest
    call's prompt plus response; ``reward`` is the value of the last reward event (None
    when there is none, or when the last one holds no number, as the trainer reads it)."""

    attempt: int
    events: int
    calls: int
    failed_calls: int
    tokens: int
    context: int
    rewards: int
    reward: float | None
    last_event_at: float | None


@dataclass(frozen=True)
class Transition:
    """A status change, as the store applied it."""

    attempt: int
    status: Status
    time: float
    error: str | None


class SortKey(StrEnum):
    CREATED = "created"
    REWARD = "reward"
    TURNS = "turns"  # model calls of the current attempt
    TOKENS = "tokens"  # sampled tokens of the current attempt
    DURATION = "duration"  # ended_at - started_at of the current attempt


@dataclass(frozen=True)
class SummaryQuery:
    """Rollouts with their current attempt's summary, filtered and sorted. ``step`` is
    the training step whose metrics a rollout is in, from what the trainer writes:
    ``metadata.step`` (validation), else ``metadata.batch`` + 1 (a train batch ``b`` is
    trained at step ``b + 1``). Rows without the sort key come last; ties keep creation
    order."""

    statuses: frozenset[Status] = frozenset()
    mode: str | None = None
    group_id: str | None = None
    step: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    sort: SortKey = SortKey.CREATED
    descending: bool = False
    offset: int = 0
    limit: int = 50


@dataclass(frozen=True)
class RolloutRow:
    rollout: Rollout
    summary: Summary | None  # of the current attempt; None before its first event
