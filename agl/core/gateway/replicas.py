"""Admission across gateway processes: one process on its own store (:class:`Solo`), or
replicas sharing a PostgreSQL store (:class:`ReplicaGroup`), each behind the same API.

A replica is stateless apart from the store, with two exceptions that stay per process
by design: its admission gate (the calls it holds and runs) and its router's
stickiness and load (``agl.core.gateway.router``: a rollout whose calls reach two
replicas may be placed on two endpoints, costing a prefix cache, never a wrong record).

The replica protocol (:class:`ReplicaGroup`), invariants:
- the admission state and its generation live in the store; a replica *applies* a
  generation by closing or opening its gate, and reports the generation it applied,
  its calls in flight and waiting in its heartbeat (every ``heartbeat_s``, and at once
  when the state changes or its gate drains);
- a change is announced with LISTEN/NOTIFY; the heartbeat reads the state too, so a
  lost notice delays a replica by one beat, never forever;
- before opening its gate a replica reloads the model registry whenever its generation
  changed (the trainer registers the new weights' ``policy_version`` before it resumes,
  in an earlier transaction), so no call is admitted with the old version after a resume;
- a pause answers ``drained`` once every live replica has applied it and has nothing in
  flight; a replica that dies (silent past the lease) stops counting, and one that only
  stalled that long admits nothing more before its next beat (its gate's renewal ends
  ``heartbeat_s`` before its lease); a call it admitted before the stall may still be in
  flight, as with any lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from agl.core.contracts.records import Admission
from agl.core.gateway.admission import AdmissionGate
from agl.core.gateway.proxy import RecordingProxy
from agl.core.gateway.store.base import ADMISSION_META, Replica, SharedState, SharedStore, Store

log = logging.getLogger(__name__)

# How often a pause looks at the registry while it waits for the replicas to drain.
_DRAIN_POLL_S = 0.05


class Solo:
    """The gateway alone on its store (SQLite): the gate is the whole admission state."""

    def __init__(self, store: Store, proxy: RecordingProxy) -> None:
        self.store = store
        self.proxy = proxy
        self.gate: AdmissionGate = proxy.gate

    async def start(self) -> None:
        # A gateway restarted while the trainer updates weights keeps calls out until the
        # trainer resumes admission, as the one that died did.
        if await self.store.get_meta(ADMISSION_META) == "paused":
            self.gate.close()

    async def stop(self) -> None:
        pass

    async def set(self, state: str, timeout_s: float | None) -> Admission:
        await self.store.set_meta(ADMISSION_META, state)
        drained = True
        if state == "paused":
            drained = await self.gate.pause(timeout_s)
        else:
            self.gate.resume()
        return self._admission(drained)

    async def status(self) -> Admission:
        return self._admission(self.gate.in_flight == 0)

    def _admission(self, drained: bool) -> Admission:
        return Admission(
            state="paused" if self.gate.paused else "running",
            in_flight=self.gate.in_flight,
            waiting=self.gate.waiting,
            drained=drained,
        )


class ReplicaGroup:
    """This process's part in the replicas sharing ``store`` (see the module)."""

    def __init__(
        self, store: SharedStore, proxy: RecordingProxy, heartbeat_s: float, lease_s: float
    ) -> None:
        self.store = store
        self.proxy = proxy
        self.gate: AdmissionGate = proxy.gate
        self.boot = proxy.boot
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s
        self.applied = 0  # the admission generation this gate follows
        self._models = -1  # the models generation the router holds (-1: none yet)
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()  # one beat (and application) at a time
        self._beating: asyncio.Task[None] | None = None
        self._draining: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Join the registry with the shared state applied (paused if it is), then beat."""
        await self.store.watch(self._changed.set)
        await self.beat()
        self._beating = asyncio.create_task(self._beat_forever())

    async def stop(self) -> None:
        for task in (self._beating, self._draining):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # Stopped: the answers it still held will never be sent; others may replay them
        # at once (a store that cannot be reached lets them wait out the lease instead).
        try:
            await self.store.leave(self.boot)
        except Exception:
            log.warning("could not leave the replica registry; the lease will end it")

    async def beat(self) -> SharedState:
        """Report this replica, apply the shared state, and report again if it changed."""
        async with self._lock:
            sent = asyncio.get_running_loop().time()
            state = await self.store.heartbeat(self._replica())
            if await self._apply(state):
                await self.store.heartbeat(self._replica())
            # The others count this replica alive until lease_s after the beat reached the
            # store, which was after ``sent``: stop admitting a beat's length before that.
            self.gate.renew(sent + self.lease_s - self.heartbeat_s)
            return state

    def _replica(self) -> Replica:
        return Replica(self.boot, self.gate.in_flight, self.gate.waiting, self.applied)

    async def _apply(self, state: SharedState) -> bool:
        """Follow ``state``; True if the admission generation applied changed."""
        if state.models != self._models:
            self.proxy.router.load(await self.store.list_models())
            self._models = state.models
        if state.generation == self.applied:
            return False
        if state.admission == "paused":
            self.gate.close()
            if self._draining is None or self._draining.done():
                self._draining = asyncio.create_task(self._report_drained())
        else:
            self.gate.resume()
        self.applied = state.generation
        return True

    async def _report_drained(self) -> None:
        """Beat as soon as the closed gate's last call is over: a pause waits on it."""
        await self.gate.idle()
        self._changed.set()

    async def _beat_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.heartbeat_s)
            self._changed.clear()
            try:
                await self.beat()
            except Exception:
                # The store is unreachable: the calls it would record fail alike; past
                # the lease the other replicas count this one dead.
                log.exception("replica heartbeat failed; retrying next beat")

    async def set(self, state: str, timeout_s: float | None) -> Admission:
        """Change the admission state of every replica. A pause answers once every live
        replica has applied it and drained (``drained`` True) or ``timeout_s`` passed."""
        shared = await self.store.set_admission(state)
        await self.beat()
        if state != "paused":
            return await self.status()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            replicas = await self.store.live_replicas()
            if self._drained(replicas, shared.generation):
                return self._admission(shared.admission, replicas, drained=True)
            if deadline is not None and loop.time() >= deadline:
                return self._admission(shared.admission, replicas, drained=False)
            await asyncio.sleep(_DRAIN_POLL_S)

    async def status(self) -> Admission:
        shared = await self.store.shared_state()
        replicas = await self.store.live_replicas()
        drained = self._drained(replicas, shared.generation)
        return self._admission(shared.admission, replicas, drained)

    def _fresh(self, replicas: list[Replica]) -> list[Replica]:
        """The live replicas, this one as it is now rather than at its last beat."""
        return [r for r in replicas if r.boot != self.boot] + [self._replica()]

    def _drained(self, replicas: list[Replica], generation: int) -> bool:
        return all(r.applied >= generation and r.in_flight == 0 for r in self._fresh(replicas))

    def _admission(self, state: str, replicas: list[Replica], drained: bool) -> Admission:
        fresh = self._fresh(replicas)
        return Admission(
            state="paused" if state == "paused" else "running",
            in_flight=sum(r.in_flight for r in fresh),
            waiting=sum(r.waiting for r in fresh),
            drained=drained,
        )
