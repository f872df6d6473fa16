"""Watches submitted rollouts through the gateway until each is final, then reads its calls
and reward: the trainer's view of the rollout side.

A rollout is *final* when it succeeded, or failed for a cause of the agent's, or failed
with no attempt left (a rollout failed by the infrastructure with attempts left is about
to be re-queued by the controller, so it is still pending: ``agl.core.contracts.failures``, the
rule the controller retries by). A group is *complete* when all its rollouts are final.

Per poll: one paged list of the non-final rollouts (bounded by what is in flight), then a
GET of each submitted rollout that left that list, and the events of those that are final.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agl.core.client import AsyncGatewayClient
from agl.core.contracts.failures import attempt_cause, is_final
from agl.core.contracts.records import Event, Rollout, RolloutSpec, Status
from agl.core.trainer.assemble import FinishedRollout
from agl.core.trainer.calls import read_calls

log = logging.getLogger(__name__)

_ACTIVE = (Status.QUEUING, Status.RUNNING)


@dataclass
class Group:
    group_id: str
    mode: str
    members: list[str]
    finished: dict[str, FinishedRollout] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.members)

    def rollouts(self) -> list[FinishedRollout]:
        return [self.finished[r] for r in self.members]


class Collector:
    def __init__(
        self,
        client: AsyncGatewayClient,
        poll_s: float = 0.1,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        """``decode``: the policy's tokenizer, to leave out calls whose token ids do not
        decode to the text the harness got."""
        self.client = client
        self.poll_s = poll_s
        self.decode = decode
        self.groups: dict[str, Group] = {}
        self._group_of: dict[str, str] = {}
        self._pending: set[str] = set()
        self._completed: list[str] = []  # complete groups, in completion order, not yet taken

    async def submit(self, specs: Sequence[RolloutSpec]) -> None:
        """Create rollouts (idempotent: ids that exist are left as they are) and watch them."""
        if not specs:
            return
        await self.client.create_rollouts(specs)
        for spec in specs:
            group = self.groups.setdefault(spec.group_id, Group(spec.group_id, spec.mode, []))
            if spec.rollout_id not in self._group_of:
                group.members.append(spec.rollout_id)
                self._group_of[spec.rollout_id] = spec.group_id
                self._pending.add(spec.rollout_id)

    def forget(self, group_ids: Sequence[str]) -> None:
        """Stop tracking groups (trained on, or already counted before a resume)."""
        for gid in group_ids:
            group = self.groups.pop(gid, None)
            if group is None:
                continue
            for rid in group.members:
                self._pending.discard(rid)
                self._group_of.pop(rid, None)
        dropped = set(group_ids)
        self._completed = [g for g in self._completed if g not in dropped]

    @property
    def pending(self) -> int:
        return len(self._pending)

    def take_complete(
        self, mode: str, limit: int | None = None, in_submission_order: bool = False
    ) -> list[Group]:
        """Complete groups of ``mode`` (oldest completion first), removed from tracking.
        ``in_submission_order``: the same groups in the order they were submitted, which
        unlike completion order does not depend on timing."""
        chosen = [g for g in self._completed if self.groups[g].mode == mode][:limit]
        if in_submission_order:
            taken_ids = set(chosen)
            chosen = [g for g in self.groups if g in taken_ids]
        taken = [self.groups[g] for g in chosen]
        self.forget(chosen)
        return taken

    def complete_count(self, mode: str) -> int:
        return sum(self.groups[g].mode == mode for g in self._completed)

    def outstanding(self, mode: str) -> int:
        """Groups of ``mode`` still tracked (running or complete and not yet taken)."""
        return sum(g.mode == mode for g in self.groups.values())

    async def poll(self) -> int:
        """One pass; answers how many rollouts became final."""
        if not self._pending:
            return 0
        active = await self._active_ids()
        left = [rid for rid in self._pending if rid not in active]
        rollouts = await asyncio.gather(*(self.client.get_rollout(rid) for rid in left))
        ended = [r for r in rollouts if r.status in (Status.SUCCEEDED, Status.FAILED)]
        events = await asyncio.gather(
            *(self.client.get_events(r.rollout_id, attempt=r.attempt) for r in ended)
        )
        finished = 0
        for rollout, evs in zip(ended, events, strict=True):
            finished += self._finish(rollout, evs)
        return finished

    async def wait(self, done: Callable[[], bool], timeout_s: float | None = None) -> None:
        """Poll until ``done()`` is true."""
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        while not done():
            if deadline is not None and asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"rollouts still pending after {timeout_s} s")
            if not await self.poll():
                await asyncio.sleep(self.poll_s)

    async def _active_ids(self) -> set[str]:
        active = await self.client.list_rollouts(status=_ACTIVE, page_size=1000)
        return {r.rollout_id for r in active}

    def _finish(self, rollout: Rollout, events: list[Event]) -> bool:
        """Take an ended rollout if it is final; answers whether it was."""
        rid = rollout.rollout_id
        if rid not in self._pending:
            return False
        rewards = [e for e in events if e.type == "reward"]
        reward: float | None = None
        metrics: dict[str, float] = {}
        if rewards:
            reward, metrics = _reward_value(max(rewards, key=lambda e: e.sequence).data)
        cause = attempt_cause(rollout, events, has_reward=reward is not None)
        if not is_final(rollout, cause):
            return False
        self._pending.discard(rid)
        read = read_calls(events, self.decode)
        finished = FinishedRollout(
            rollout_id=rid,
            group_id=rollout.group_id,
            mode=rollout.mode,
            status=rollout.status,
            reward=reward,
            calls=read.calls,
            error=rollout.error,
            invalid_calls=dict(read.invalid),
            cause=cause,
            metrics=metrics,
            input=rollout.input,
        )
        group = self.groups[self._group_of[rid]]
        group.finished[rid] = finished
        if group.complete:
            self._completed.append(group.group_id)
        return True


def _reward_value(data: object) -> tuple[float | None, dict[str, float]]:
    """A reward event's value, and the task metrics it carries (``data["metrics"]``)."""
    value = data.get("value") if isinstance(data, dict) else None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        log.warning("ignoring a malformed reward event: %.200r", data)
        return None, {}
    metrics = data.get("metrics") if isinstance(data, dict) else None
    if not isinstance(metrics, dict):
        return float(value), {}
    return float(value), {
        str(k): float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
