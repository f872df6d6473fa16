"""Which rollouts a command is about: the selection options (``--status``, ``--mode``,
``--group``, ``--step``, ``--min-reward``, ``--max-reward``) as ``Filters``, the step a
rollout belongs to, and the matching rollouts read a page at a time with their events
(``export`` and ``scan``; ``ls`` asks the store to filter instead, by the same rules)."""

from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from agl.core.client import AsyncGatewayClient
from agl.core.contracts.records import Event, Rollout, Status
from agl.core.user_error import UserError

T = TypeVar("T")

PAGE = 200  # rollouts per page: what export and scan hold at a time, with their events
CONCURRENCY = 16  # event reads in flight


@dataclass(frozen=True)
class Filters:
    """The selection options; empty ones select everything."""

    statuses: tuple[Status, ...] = ()
    mode: str | None = None
    group: str | None = None
    step: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None

    def keeps_record(self, rollout: Rollout) -> bool:
        """What the record alone decides (the gateway filters status, mode and group)."""
        return self.step is None or step_of(rollout) == self.step

    def keeps_reward(self, reward: float | None) -> bool:
        if self.min_reward is None and self.max_reward is None:
            return True
        if reward is None:
            return False
        low = -math.inf if self.min_reward is None else self.min_reward
        high = math.inf if self.max_reward is None else self.max_reward
        return low <= reward <= high


def filters(args: argparse.Namespace) -> Filters:
    """The selection options of a command line (``--status`` is repeatable and takes
    comma-separated lists)."""
    try:
        statuses = tuple(Status(s) for arg in args.status for s in arg.split(",") if s)
    except ValueError:
        known = ", ".join(s.value for s in Status)
        raise UserError(f"--status {','.join(args.status)}: choose from {known}") from None
    return Filters(
        statuses=statuses,
        mode=args.mode,
        group=args.group,
        step=args.step,
        min_reward=args.min_reward,
        max_reward=args.max_reward,
    )


def step_of(rollout: Rollout) -> int | None:
    """The training step whose metrics the rollout is in (``agl.rollouts.__main__``'s
    docstring), from the metadata the trainer gives it; None for rollouts made otherwise.
    The store's rule (``SummaryQuery.step``), which ``ls --step`` uses: JSON integers only,
    not booleans."""
    step, batch = rollout.metadata.get("step"), rollout.metadata.get("batch")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    if isinstance(batch, int) and not isinstance(batch, bool):
        return batch + 1
    return None


def of_attempt(events: Iterable[Event], attempt: int) -> list[Event]:
    return sorted((e for e in events if e.attempt == attempt), key=lambda e: e.sequence)


def fields(event: Event) -> dict[str, Any]:
    """An event's data as a mapping: agents write events too, not always well formed."""
    return event.data if isinstance(event.data, dict) else {}


def reward_of(events: Sequence[Event], attempt: int) -> float | None:
    """The attempt's last reward, as the trainer counts it."""
    rewards = [fields(e) for e in of_attempt(events, attempt) if e.type == "reward"]
    value = rewards[-1].get("value") if rewards else None
    return float(value) if isinstance(value, int | float) else None


async def bounded(calls: Iterable[Awaitable[T]], limit: int = CONCURRENCY) -> list[T]:
    """``asyncio.gather`` with at most ``limit`` awaitables running at once."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Awaitable[T]) -> T:
        async with gate:
            return await call

    return await asyncio.gather(*(one(c) for c in calls))


async def matching(
    client: AsyncGatewayClient, filters: Filters
) -> AsyncIterator[tuple[Rollout, list[Event]]]:
    """The rollouts that pass ``filters``, with all their events, a page at a time: at
    most ``PAGE`` rollouts' events are held at once, however many rollouts there are."""
    cursor: str | None = None
    while True:
        page, cursor = await client.list_rollouts_page(
            filters.statuses or None, filters.mode, filters.group, cursor, PAGE
        )
        page = [r for r in page if filters.keeps_record(r)]
        events = await bounded(client.get_events(r.rollout_id) for r in page)
        for rollout, evs in zip(page, events, strict=True):
            if filters.keeps_reward(reward_of(evs, rollout.attempt)):
                yield rollout, evs
        if cursor is None:
            return
