"""The rollout controller: reconciles the gateway's rollouts with executions
(docs/design.md, "Rollout controller").

Each pass (``Controller.step``):

1. settles the attempts that ended: a rollout still ``running`` at that attempt is
   failed with the exit's reason (or "agent exited without reporting a status"); a
   ``failed`` attempt is re-queued while attempts remain if the infrastructure failed it
   (``agl.core.contracts.failures``: worker died, upstream down, ...); one its agent
   failed is final, a learning signal the trainer scores;
2. starts ``queuing`` rollouts, oldest first, as many as the executor has free slots:
   PATCH ``running`` at the listed attempt (a 409 means someone else moved it), then
   launch with the attempt key from the answered record.

Invariants:
- within one controller an attempt is launched at most once and settled once per exit;
- every HTTP call a pass makes per rollout runs concurrently with the others;
- a gateway error on one rollout is logged and retried on a later pass; it never ends
  the loop. Every PATCH names its attempt, so a retry is a no-op where it already took;
- the executor is told to ``forget`` an exit only once the gateway has recorded it, so
  what is left of an execution (a Job) survives until then for a restarted controller;
- the logs an exit carries (a pod's) are recorded as the attempt's ``agent_log`` event
  before its status, under one event id, so a repeated settle records them once.

With ``reconcile_s`` set, every so often a pass also compares the gateway's running
rollouts with what executes:

- a rollout running at an attempt that nothing executes (the controller restarted
  between moving it to running and launching it; its Job deleted while no controller
  watched) is failed with ``LOST`` and re-queued: never launched a second time;
- an execution whose rollout is no longer running at that attempt (finished, re-queued,
  unknown to the gateway) in two passes in a row is stopped: an orphan.

The executor (local processes, Kubernetes Jobs) is behind the small ``Executor``
protocol, so this loop knows nothing about how an attempt runs. An executor whose
executions outlive the controller (``detached``: Jobs) keeps them running when the
controller stops, and hands them to the next controller through ``running()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import httpx

from agl.core.client import AsyncGatewayClient, GatewayError
from agl.core.contracts.execution import (
    AGENT_LOG_EVENT,
    AGENT_LOG_EVENT_ID,
    LOST,
    NO_STATUS,
    STOPPED,
    AgentEnv,
    Executor,
    Exit,
    Key,
    Launch,
    agent_log_data,
)
from agl.core.contracts.failures import attempt_cause
from agl.core.contracts.records import EventIn, Rollout, Status

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0  # how long stopping may spend failing the attempts it ran


@dataclass
class ControllerStats:
    launched: int = 0  # attempts handed to the executor
    exited_ok: int = 0  # attempts that ended succeeded
    exited_without_status: int = 0  # clean exits the controller had to fail
    agent_failed: int = 0  # attempts that ended failed otherwise (error, timeout, agent's word)
    requeued: int = 0  # failed attempts sent back to queuing
    given_up: int = 0  # failed attempts with no attempt left
    agent_final: int = 0  # failed attempts not retried: their agent failed them
    lost: int = 0  # running attempts that nothing executed
    orphans_stopped: int = 0  # executions of rollouts no longer running at that attempt


class Controller:
    def __init__(
        self,
        client: AsyncGatewayClient,
        executor: Executor,
        *,
        gateway_url: str,
        model: str,
        poll_s: float = 0.05,
        batch: int = 256,
        max_calls: int = 4,
        reconcile_s: float | None = None,
    ) -> None:
        """``client`` must hold the admin token: only it sees attempt keys.

        ``max_calls`` bounds the HTTP calls in flight at once. More would not make the
        gateway faster, and httpx's pool scans every open connection on each request, so
        a few hundred concurrent calls cost several times the CPU per call."""
        self.client = client
        self.executor = executor
        self.gateway_url = gateway_url
        self.model = model
        self.poll_s = poll_s
        self.batch = batch
        self.stats = ControllerStats()
        self._running: set[tuple[str, int]] = set()  # launched, not yet exited
        self._unsettled: list[Exit] = []  # exits whose settling failed; retried next pass
        self._outcome: dict[tuple[str, int], str] = {}  # first verdict of an unsettled exit
        self._unsure: set[tuple[str, int]] = set()  # PATCH running failed in transit
        self._busy = False  # the last pass settled or started something: more may follow
        self._calls = asyncio.Semaphore(max_calls)
        self.reconcile_s = reconcile_s
        self._next_reconcile = 0.0  # monotonic time; the first pass reconciles
        self._orphans: set[Key] = set()  # seen orphaned by the last reconcile

    # -- the loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """Start the executor and reconcile every ``poll_s`` until cancelled; on the way
        out, kill what runs and fail (re-queue) those attempts."""
        await self.executor.start()
        self._running.update(self.executor.running())
        try:
            while True:
                try:
                    await self.step()
                except Exception:  # a bug or an outage must not end the controller
                    log.exception("controller pass failed; retrying")
                    self._busy = False
                # Right after a pass that did work, the next one likely has work too.
                await asyncio.sleep(0 if self._busy else self.poll_s)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop the executor; fail (and re-queue) the attempts it ran unless they outlive
        it (``detached``), best effort within ``RELEASE_TIMEOUT_S``. Idempotent."""
        await self.executor.close()
        stopped = [] if self.executor.detached else self._running
        exits = [*self._unsettled, *(Exit(rid, a, STOPPED) for rid, a in stopped)]
        self._unsettled = []
        if exits:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settle_all(exits), RELEASE_TIMEOUT_S)

    async def step(self) -> None:
        """One reconcile pass: settle exits, then start queued rollouts into free slots."""
        exits = [*self._unsettled, *await self.executor.exits()]
        self._unsettled = []
        self._busy = bool(exits)
        if exits:
            await self._settle_all(exits)
        if self.reconcile_s is not None and time.monotonic() >= self._next_reconcile:
            self._next_reconcile = time.monotonic() + self.reconcile_s
            await self._reconcile()
        if self._unsure:
            unsure, self._unsure = self._unsure, set()
            await asyncio.gather(*(self._start(rid, attempt) for rid, attempt in unsure))
        free = self.executor.free_slots
        if free <= 0:
            return
        limit = min(free, self.batch)
        queued = await self._list_queuing(limit)
        self._busy = self._busy or bool(queued)
        await asyncio.gather(
            *(
                self._start(r.rollout_id, r.attempt)
                for r in queued
                if (r.rollout_id, r.attempt) not in self._running
            )
        )

    # -- settling exits ---------------------------------------------------------------

    async def _settle_all(self, exits: list[Exit]) -> None:
        for exit, done in zip(exits, await asyncio.gather(*map(self._settle, exits)), strict=True):
            if not done:
                self._unsettled.append(exit)

    async def _settle(self, exit: Exit) -> bool:
        """Bring the gateway in line with an ended attempt; False: retry next pass."""
        async with self._calls:
            return await self._settle_unbounded(exit)

    async def _settle_unbounded(self, exit: Exit) -> bool:
        key = (exit.rollout_id, exit.attempt)
        self._running.discard(key)
        try:
            if exit.logs:
                data = agent_log_data(exit.logs)
                event = EventIn(event_id=AGENT_LOG_EVENT_ID, type=AGENT_LOG_EVENT, data=data)
                await self.client.post_events(exit.rollout_id, exit.attempt, [event])
            rollout = await self.client.get_rollout(exit.rollout_id)
            for _ in range(3):  # a 409 answers the rollout as it is now: decide again
                try:
                    await self._settle_rollout(exit, rollout)
                    break
                except GatewayError as error:
                    if error.status != 409 or error.current is None:
                        raise
                    rollout = error.current
        except GatewayError as error:
            if error.status == 404:
                log.warning("rollout %s is gone; dropping its exit", exit.rollout_id)
                self._outcome.pop(key, None)
                await self.executor.forget(exit.rollout_id, exit.attempt)
                return True
            log.warning("settling %s attempt %d: %s", exit.rollout_id, exit.attempt, error)
            return False
        except httpx.HTTPError as error:
            log.warning("settling %s attempt %d: %r", exit.rollout_id, exit.attempt, error)
            return False
        outcome = self._outcome.pop(key, None)
        if outcome is not None:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
        await self.executor.forget(exit.rollout_id, exit.attempt)
        return True

    async def _settle_rollout(self, exit: Exit, rollout: Rollout) -> None:
        """One decision on ``rollout`` as read; raises GatewayError (409: read is stale)."""
        key = (exit.rollout_id, exit.attempt)
        if rollout.attempt != exit.attempt:
            return  # the rollout moved on to another attempt: nothing of ours to settle
        if rollout.status is Status.RUNNING:
            error = exit.error or NO_STATUS
            rollout = await self.client.patch_rollout(
                exit.rollout_id, Status.FAILED, attempt=exit.attempt, error=error
            )
            self._outcome.setdefault(key, "agent_failed" if exit.error else "exited_without_status")
        if rollout.status is Status.SUCCEEDED:
            self.stats.exited_ok += 1
        elif rollout.status is Status.FAILED:
            self._outcome.setdefault(key, "agent_failed")
            if rollout.attempt < rollout.max_attempts and await self._retried(rollout):
                await self.client.patch_rollout(
                    exit.rollout_id, Status.QUEUING, attempt=exit.attempt
                )
                self.stats.requeued += 1
            else:
                self.stats.given_up += 1

    async def _retried(self, rollout: Rollout) -> bool:
        """Whether a failed attempt gets another: only when the infrastructure failed it."""
        events = await self.client.get_events(rollout.rollout_id, attempt=rollout.attempt)
        cause = attempt_cause(rollout, events, has_reward=False)
        if cause is not None and cause.agent:
            self.stats.agent_final += 1
            return False
        return True

    # -- reconciling with the gateway --------------------------------------------------

    async def _reconcile(self) -> None:
        try:
            rollouts = await self.client.list_rollouts(Status.RUNNING)
        except (GatewayError, httpx.HTTPError) as error:
            log.warning("listing running rollouts: %r", error)
            return
        running = {(r.rollout_id, r.attempt) for r in rollouts}
        executing = self.executor.running()
        known = self._running | executing | self._unsure
        known |= {(e.rollout_id, e.attempt) for e in self._unsettled}
        lost = running - known
        if lost:
            log.warning("%d running attempts have no execution; failing them", len(lost))
            self.stats.lost += len(lost)
            await self._settle_all([Exit(rid, attempt, LOST) for rid, attempt in lost])
        orphans = executing - running
        stop = orphans & self._orphans
        self._orphans = orphans - stop
        if stop:
            log.info("stopping %d executions whose rollouts moved on", len(stop))
            self.stats.orphans_stopped += len(stop)
            await self.executor.stop(stop)

    # -- starting queued rollouts -----------------------------------------------------

    async def _list_queuing(self, limit: int) -> list[Rollout]:
        """The oldest ``limit`` queuing rollouts: one page, not the whole list."""
        try:
            page, _ = await self.client.list_rollouts_page(Status.QUEUING, limit=limit)
        except (GatewayError, httpx.HTTPError) as error:
            log.warning("listing queuing rollouts: %r", error)
            return []
        return page

    async def _start(self, rollout_id: str, attempt: int) -> None:
        """Move one attempt to running and launch it; never raises."""
        key = (rollout_id, attempt)
        try:
            async with self._calls:
                rollout = await self.client.patch_rollout(
                    rollout_id, Status.RUNNING, attempt=attempt
                )
        except (GatewayError, httpx.HTTPError) as error:
            if isinstance(error, GatewayError) and error.status < 500:
                if error.status != 409:  # 409: someone else moved it
                    log.warning("starting %s attempt %d: %s", rollout_id, attempt, error)
                return
            # It may have landed: retry next pass (a repeat is a no-op), so that it cannot
            # stay running with nothing running it.
            log.warning("starting %s attempt %d: %r; retrying", rollout_id, attempt, error)
            self._unsure.add(key)
            return
        if key in self._running or rollout.status is not Status.RUNNING:
            return
        self._running.add(key)
        self.stats.launched += 1
        if rollout.attempt_key is None:
            log.error("no attempt key for %s: the controller needs the admin token", rollout_id)
            self._unsettled.append(Exit(rollout_id, attempt, "no attempt key (not admin)"))
            return
        agent = AgentEnv(
            gateway_url=self.gateway_url,
            rollout_id=rollout_id,
            attempt=attempt,
            mode=rollout.mode,
            model=self.model,
            api_key=rollout.attempt_key,
            input=rollout.input,
        )
        launch = Launch(
            rollout_id, attempt, rollout.timeout_s, agent.to_env(), rollout.report_key or ""
        )
        try:
            await self.executor.launch(launch)
        except Exception as error:
            log.exception("launching %s attempt %d", rollout_id, attempt)
            self._unsettled.append(Exit(rollout_id, attempt, f"launch failed: {error!r}"[:500]))
