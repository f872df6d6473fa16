"""The admission gate of collocated async training.

``pause`` closes the gate and returns once every admitted call has finished; a call that
arrives while the gate is closed waits (it is never refused) and goes on after ``resume``.
The harness sees only a slower answer, never the phase switch. The gate is this
process's; replicas sharing a store follow one admission state through
:mod:`agl.core.gateway.replicas`.

A gate may also hold calls for want of news: a replica renews it after each heartbeat
(:meth:`AdmissionGate.renew`), and past the renewal's end a call waits as at a closed
gate, so a replica that stalled long enough for the others to count it dead admits
nothing before it has learnt the shared state again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class AdmissionGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0
        self.waiting = 0  # calls held at the closed gate
        # Loop time past which calls wait for renew() (None: a gateway alone, never).
        self._valid_until: float | None = None
        self._renewed = asyncio.Event()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def enter(self) -> Ticket:
        """Wait until the gate is open, then count the caller in flight until its ticket
        is released."""
        if not self._open.is_set() or self._expired():
            self.waiting += 1
            try:
                while not self._open.is_set() or self._expired():
                    if not self._open.is_set():
                        await self._open.wait()
                    else:
                        self._renewed.clear()
                        await self._renewed.wait()
            finally:
                self.waiting -= 1
        self.in_flight += 1
        self._idle.clear()
        return Ticket(self)

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        ticket = await self.enter()
        try:
            yield
        finally:
            ticket.release()

    async def pause(self, timeout_s: float | None = None) -> bool:
        """Close the gate; True once drained, False if ``timeout_s`` passed first."""
        self.close()
        try:
            await asyncio.wait_for(self.idle(), timeout_s)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Hold every call that arrives from now on (see :meth:`pause`)."""
        self._open.clear()

    async def idle(self) -> None:
        """Return once no admitted call is in flight."""
        await self._idle.wait()

    def resume(self) -> None:
        self._open.set()

    def renew(self, until: float) -> None:
        """Admit calls until the event loop's time ``until``; past it they wait for the
        next renewal (see the module)."""
        self._valid_until = until
        self._renewed.set()

    @property
    def valid_until(self) -> float | None:
        """The last renewal's end (None: never renewed, so never expires)."""
        return self._valid_until

    def _expired(self) -> bool:
        until = self._valid_until
        return until is not None and asyncio.get_running_loop().time() > until


class Ticket:
    """One admitted call; releasing it twice counts once, so every path that ends a call
    may release it without bookkeeping of who did."""

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate: AdmissionGate | None = gate

    def release(self) -> None:
        if self._gate is not None:
            self._gate._leave()
            self._gate = None
