"""The trainer loop, backend-agnostic: submit rollouts, collect them, assemble a batch,
update the policy, publish the new weights, repeat (docs/design.md, "Trainer loop").

- **sync**: step ``k`` submits batch ``k`` (``groups_per_step`` training examples x
  ``group_size`` rollouts, one ``group_id`` per example), waits for all of it, trains.
- **async** (collocated): keeps up to ``max_inflight_groups`` groups submitted; as soon
  as ``groups_per_step`` groups are complete it pauses admission at the gateway (calls in
  flight drain, new calls wait), trains on those groups, publishes the new weights and
  resumes. Unfinished rollouts carry on under the new weights; each call records the
  ``policy_version`` that sampled it, and calls more than ``max_staleness`` versions
  behind are dropped from the loss (``staleness/*`` metrics).

Invariants:
- a group is trained on at most once, also across a resume (checkpoints list the groups
  consumed; rollout ids are deterministic, so re-submitting a batch creates nothing);
- the policy is updated only while no generation runs (sync: none in flight; async:
  admission paused and drained), so every recorded ``policy_version`` is exact;
- a rollout its agent failed (the harness raised, gave no reward, timed out) scores 0 in
  its group (``agent_failures=zero``; ``drop`` leaves it out); one the infrastructure
  failed after all attempts is left out; both are counted by cause;
- validation counts every validation rollout: agent failures as 0, infrastructure
  failures reported apart (``val/left_out``), with the reward's standard error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from agl.core.client import AsyncGatewayClient
from agl.core.contracts.records import RolloutSpec, Status
from agl.core.contracts.strategies import Advantage, Loss
from agl.core.contracts.training import Policy, TaskInputs
from agl.core.trainer.assemble import (
    AGENT_FAILURES,
    AgentFailures,
    Batch,
    FinishedRollout,
    MergeStrategy,
    assemble,
    task_metrics,
)
from agl.core.trainer.collector import Collector, Group
from agl.strategies.dedup import DEDUP_RULES
from agl.strategies.weights import push

log = logging.getLogger(__name__)

StepCallback = Callable[[int, dict[str, float]], None]
# (step, "train" or "val", the rollouts): what a step trained on, or validated with.
RolloutsCallback = Callable[[int, str, list[FinishedRollout]], None]


# Makes ``policy_version`` the served weights (inference swap + gateway registration).
Publish = Callable[[int], Awaitable[None]]


@dataclass
class TrainerConfig:
    mode: Literal["sync", "async"] = "sync"
    steps: int = 60
    groups_per_step: int = 32
    group_size: int = 8
    max_inflight_groups: int = 64  # async: groups submitted and not yet trained on
    max_staleness: int | None = 1  # async: calls more versions behind are dropped
    val_every: int = 5  # 0: never
    val_size: int = 64
    # rollouts of each validation input: a small set's validation reward, sampled at the
    # task's temperature, has that much less noise (its mean is over all of them)
    val_samples: int = 1
    checkpoint_every: int = 10  # 0: never
    keep_checkpoints: int = 2
    max_attempts: int = 2
    timeout_s: float = 60.0
    poll_s: float = 0.1
    drain_timeout_s: float = 120.0
    # A rollout its agent failed: "zero" scores it 0 in its group, "drop" leaves it out.
    agent_failures: AgentFailures = "zero"
    dedup: str = "continued"  # agl.core.trainer.calls.dedup: continued | last (the paper's)

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"trainer.mode must be sync or async, not {self.mode!r}")
        if self.agent_failures not in AGENT_FAILURES:
            raise ValueError(
                f"trainer.agent_failures must be one of {', '.join(AGENT_FAILURES)}, "
                f"not {self.agent_failures!r}"
            )
        if self.dedup not in DEDUP_RULES:
            raise ValueError(
                f"trainer.dedup must be one of {', '.join(DEDUP_RULES)}, not {self.dedup!r}"
            )
        for name in ("steps", "groups_per_step", "group_size", "max_attempts", "val_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be at least 1")
        if self.mode == "async" and self.max_inflight_groups < self.groups_per_step:
            raise ValueError("trainer.max_inflight_groups must be at least groups_per_step")


@dataclass
class TrainerState:
    step: int = 0  # updates done
    policy_version: int = 0
    next_batch: int = 0  # async: batches submitted
    consumed: list[str] = field(default_factory=list)  # groups trained on or counted
    rollouts_trained: int = 0


@dataclass
class Timer:
    rollout_s: float = 0.0
    train_s: float = 0.0
    sync_s: float = 0.0


class Trainer:
    def __init__(
        self,
        *,
        client: AsyncGatewayClient,
        policy: Policy,
        publish: Publish,
        task: TaskInputs,
        merge: MergeStrategy,
        advantage: Advantage,
        loss: Loss,
        config: TrainerConfig,
        run_dir: Path,
        on_step: StepCallback | None = None,
        on_rollouts: RolloutsCallback | None = None,
    ) -> None:
        self.client = client
        self.policy = policy
        self.publish = publish
        self.task = task
        self.merge = merge
        self.advantage = advantage
        self.loss = loss
        self.config = config
        self.run_dir = run_dir
        self.on_step = on_step or (lambda step, metrics: None)
        self.on_rollouts = on_rollouts or (lambda step, mode, rollouts: None)
        self.collector = Collector(client, config.poll_s, decode=merge.decode)
        self.state = TrainerState()

    # ------------------------------------------------------------------ the loop

    async def run(self, resume: bool = False) -> TrainerState:
        if resume:
            await self._resume()
        else:
            await self.publish(self.state.policy_version)
        if self.config.val_every and self.state.step == 0:
            self.on_step(0, await self._validate(0))
        while self.state.step < self.config.steps:
            started = time.monotonic()
            groups = await (
                self._sync_groups() if self.config.mode == "sync" else self._async_groups()
            )
            waited = time.monotonic() - started
            metrics = await self._update(groups)
            metrics["time/rollout_s"] = waited
            step = self.state.step
            self.on_rollouts(step, "train", [r for g in groups for r in g.rollouts()])
            if self.config.val_every and step % self.config.val_every == 0:
                metrics |= await self._validate(step)
            if self.config.checkpoint_every and step % self.config.checkpoint_every == 0:
                self.save_checkpoint()
            metrics["time/step_s"] = time.monotonic() - started
            self.on_step(step, metrics)
        if self.config.checkpoint_every and self.state.step % self.config.checkpoint_every:
            self.save_checkpoint()
        return self.state

    async def _sync_groups(self) -> list[Group]:
        batch = self.state.step
        await self._submit_train_batch(batch)
        await self.collector.wait(
            lambda: self.collector.outstanding("train") == self.collector.complete_count("train")
        )
        # A batch in the same order in two runs with the same seed: the same update.
        return self.collector.take_complete("train", in_submission_order=True)

    async def _async_groups(self) -> list[Group]:
        need = self.config.groups_per_step
        while self.collector.outstanding("train") + need <= self.config.max_inflight_groups:
            await self._submit_train_batch(self.state.next_batch)
        await self.collector.wait(lambda: self.collector.complete_count("train") >= need)
        return self.collector.take_complete("train", need)

    async def _submit_train_batch(self, batch: int) -> None:
        inputs = self.task.train_inputs(batch, self.config.groups_per_step)
        specs = [
            self._spec(f"t{batch}.{j}.{k}", f"t{batch}.{j}", data, "train", {"batch": batch})
            for j, data in enumerate(inputs)
            for k in range(self.config.group_size)
        ]
        consumed = set(self.state.consumed)
        await self.collector.submit([s for s in specs if s.group_id not in consumed])
        self.state.next_batch = max(self.state.next_batch, batch + 1)

    def _spec(
        self, rollout_id: str, group_id: str, data: Any, mode: str, metadata: dict[str, int]
    ) -> RolloutSpec:
        """``metadata`` says which submission batch (train) or step (val) the rollout is
        of, for the tools that read the store afterwards (``agl.rollouts ls --step``)."""
        return RolloutSpec(
            rollout_id=rollout_id,
            group_id=group_id,
            input=data,
            mode=mode,  # type: ignore[arg-type]
            metadata=metadata,
            max_attempts=self.config.max_attempts,
            timeout_s=self.config.timeout_s,
        )

    # ------------------------------------------------------------------ one update

    async def _update(self, groups: Sequence[Group]) -> dict[str, float]:
        rollouts = [r for g in groups for r in g.rollouts()]
        batch = assemble(
            rollouts,
            self.merge,
            self.advantage,
            policy_version=self.state.policy_version,
            max_staleness=self.config.max_staleness if self.config.mode == "async" else None,
            agent_failures=self.config.agent_failures,
            dedup_rule=self.config.dedup,
        )
        timer = Timer()
        metrics = dict(batch.metrics)
        paused = self.config.mode == "async"
        if paused:
            started = time.monotonic()
            await self.client.pause(timeout_s=self.config.drain_timeout_s)
            timer.sync_s += time.monotonic() - started
        try:
            if batch.samples:
                started = time.monotonic()
                metrics |= await asyncio.to_thread(self._train, batch)
                timer.train_s = time.monotonic() - started
                # Outside the timer: a diagnostic, not part of the training's cost.
                pushed = push(self.loss(batch.samples), batch.advantages)
                metrics |= {f"train/{k}": v for k, v in pushed.items()}
            self.state.policy_version += 1
            started = time.monotonic()
            await self.publish(self.state.policy_version)
            timer.sync_s += time.monotonic() - started
        finally:
            if paused:
                await self.client.resume()
        self.state.step += 1
        self.state.consumed.extend(g.group_id for g in groups)
        self.state.rollouts_trained += len(batch.rewards)
        metrics |= {
            "policy_version": float(self.state.policy_version),
            "time/train_s": timer.train_s,
            "time/sync_s": timer.sync_s,
            "samples": float(len(batch.samples)),
            "groups": float(len(groups)),
        }
        return metrics

    def _train(self, batch: Batch) -> dict[str, float]:
        metrics = self.policy.train(batch.samples, batch.advantages, self.loss)
        return {f"train/{k}": v for k, v in metrics.items()}

    # ------------------------------------------------------------------ validation

    async def _validate(self, step: int) -> dict[str, float]:
        """Every validation set at once: the task's own (``val/...``) and each extra one
        (``val/<name>/...``)."""
        started = time.monotonic()
        sets = [None, *self.task.val_sets]
        groups = {name: f"v{step}" if name is None else f"v{step}.{name}" for name in sets}
        for name, group in groups.items():
            inputs = self.task.val_inputs(self.config.val_size, name)
            await self.collector.submit(
                [
                    self._spec(
                        f"{group}.{i}{f'.{k}' if k else ''}", group, data, "val", {"step": step}
                    )
                    for i, data in enumerate(inputs)
                    for k in range(self.config.val_samples)
                ]
            )
        await self.collector.wait(lambda: self.collector.complete_count("val") >= len(sets))
        done = {g.group_id: g for g in self.collector.take_complete("val")}
        metrics: dict[str, float] = {"time/val_s": time.monotonic() - started}
        self.on_rollouts(step, "val", [r for g in groups.values() for r in done[g].rollouts()])
        for name, group in groups.items():
            prefix = "val" if name is None else f"val/{name}"
            metrics |= validation_metrics(
                done[group].rollouts(), prefix, self.config.agent_failures
            )
        return metrics

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Weights, optimizer and loop state of the current step, written to a temporary
        folder and renamed, so a crash mid-save leaves the previous checkpoint intact."""
        final = self.checkpoint_dir / f"step-{self.state.step:06d}"
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        self.policy.save(partial)
        (partial / "trainer.json").write_text(json.dumps(asdict(self.state)))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in self._checkpoints()[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s", final)
        return final

    def _checkpoints(self) -> list[Path]:
        if not self.checkpoint_dir.exists():
            return []
        return sorted(
            p for p in self.checkpoint_dir.glob("step-*") if not p.name.endswith(".partial")
        )

    async def _resume(self) -> None:
        checkpoints = self._checkpoints()
        if checkpoints:
            latest = checkpoints[-1]
            self.policy.load(latest)
            self.state = TrainerState(**json.loads((latest / "trainer.json").read_text()))
            log.info("resumed from %s (step %d)", latest, self.state.step)
        await self._fail_interrupted()
        await self.publish(self.state.policy_version)
        if self.config.mode == "async":
            # Batches submitted before the stop: their unconsumed groups are trained on as
            # they complete (finished rollouts are not run again).
            for batch in range(self.state.next_batch):
                await self._submit_train_batch(batch)

    async def _fail_interrupted(self) -> None:
        """Attempts that were running when the run stopped lost their agents: fail them
        and re-queue where attempts remain."""
        for rollout in await self.client.list_rollouts(status=Status.RUNNING):
            await self.client.patch_rollout(
                rollout.rollout_id,
                Status.FAILED,
                attempt=rollout.attempt,
                error="interrupted: the trainer restarted",
            )
            if rollout.attempt < rollout.max_attempts:
                await self.client.patch_rollout(
                    rollout.rollout_id, Status.QUEUING, attempt=rollout.attempt
                )


def validation_metrics(
    rollouts: Sequence[FinishedRollout], prefix: str, agent_failures: AgentFailures
) -> dict[str, float]:
    """The validation reward over every rollout the agent ran (its failures as 0, unless
    ``agent_failures`` drops them), its standard error and normal 95% interval, and the
    failures by kind; plus the task's metrics."""
    scored = [reward for r in rollouts if (reward := r.scored_reward(agent_failures)) is not None]
    n = len(scored)
    mean = math.fsum(scored) / n if n else 0.0
    var = math.fsum((x - mean) ** 2 for x in scored) / (n - 1) if n > 1 else 0.0
    failed = [r for r in rollouts if r.cause is not None]
    se = math.sqrt(var / n) if n else 0.0
    return {
        f"{prefix}/reward": mean,
        f"{prefix}/reward_se": se,
        # The normal 95% interval, beside the mean: one W&B panel shows all three.
        f"{prefix}/reward_ci95_low": mean - 1.96 * se,
        f"{prefix}/reward_ci95_high": mean + 1.96 * se,
        f"{prefix}/rollouts": float(n),
        f"{prefix}/failed": float(sum(r.cause.agent for r in failed)),  # type: ignore[union-attr]
        f"{prefix}/left_out": float(len(rollouts) - n),
        **task_metrics(rollouts, prefix),
    }
