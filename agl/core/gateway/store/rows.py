"""What every store shares about its rows: the columns of a rollout and of an attempt's
summary, how a row becomes a record, how the viewer's sort keys read, and the one rule
for what a new event adds to its attempt's summary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson

from agl.core.contracts.queries import SortKey
from agl.core.contracts.records import MODEL_REQUEST, MODEL_REQUEST_FAILED, Event, Rollout, Status
from agl.core.gateway.store.prompt_delta import PromptBase

ROLLOUT_COLUMNS = (
    "rollout_id, group_id, mode, status, attempt, version, max_attempts, timeout_s, "
    "created_at, updated_at, started_at, ended_at, error, input, metadata"
)
SUMMARY_COLUMNS = (
    "attempt, events, calls, failed_calls, tokens, context, rewards, reward, last_event_at"
)
# The viewer's sort keys, over rollouts AS r joined with attempt_summaries AS s.
SORT_KEYS = {
    SortKey.CREATED: "r.seq",
    SortKey.REWARD: "s.reward",
    SortKey.TURNS: "s.calls",
    SortKey.TOKENS: "s.tokens",
    SortKey.DURATION: "r.ended_at - r.started_at",
}


def rollout_from_row(row: Sequence[Any]) -> Rollout:
    """A rollout from its ``ROLLOUT_COLUMNS`` (input and metadata as orjson bytes)."""
    return Rollout.model_construct(
        rollout_id=row[0],
        group_id=row[1],
        mode=row[2],
        status=Status(row[3]),
        attempt=row[4],
        version=row[5],
        max_attempts=row[6],
        timeout_s=row[7],
        created_at=row[8],
        updated_at=row[9],
        started_at=row[10],
        ended_at=row[11],
        error=row[12],
        input=orjson.loads(row[13]),
        metadata=orjson.loads(row[14]),
        attempt_key=None,
        report_key=None,
    )


def event_from_row(row: Sequence[Any], data: Any) -> Event:
    """An event from its columns ``rollout_id, attempt, event_id, seq, type, data, time``
    with ``data`` as read (decoded, where it was stored by what it adds)."""
    return Event.model_construct(
        rollout_id=row[0],
        attempt=row[1],
        event_id=row[2],
        sequence=row[3],
        type=row[4],
        data=data,
        time=row[6],
    )


class Figures(NamedTuple):
    """What one new event adds to its attempt's summary."""

    calls: int
    failed: int
    tokens: int
    context: int
    rewards: int
    reward: float | None  # the reward's number, where ``rewards`` is 1


def figures(type_: str, data: Any, base: PromptBase | None) -> Figures:
    """One event's figures. A call's context is its whole prompt and response: a call
    stored by what it adds (``base``) holds only its tail, so the kept ids count too."""
    if type_ == MODEL_REQUEST:
        n = m = 0
        if isinstance(data, dict):
            response, prompt = data.get("response_ids"), data.get("prompt_ids")
            n = len(response) if isinstance(response, list) else 0
            m = len(prompt) if isinstance(prompt, list) else 0
        kept = 0 if base is None else base.keep_ids
        return Figures(1, 0, n, kept + m + n, 0, None)
    if type_ == MODEL_REQUEST_FAILED:
        return Figures(0, 1, 0, 0, 0, None)
    if type_ == "reward":
        # The trainer's reading (agl.core.trainer.collector): the last reward event's number.
        value = data.get("value") if isinstance(data, dict) else None
        return Figures(0, 0, 0, 0, 1, float(value) if isinstance(value, int | float) else None)
    return Figures(0, 0, 0, 0, 0, None)
