"""``LocalExecutor``, the controller's ``Executor`` on this machine: it checks the harness
string and hands its attempts to a worker pool (Python harness) or a command runner."""

from __future__ import annotations

from agl.backends.execution.local.commands import CommandRunner
from agl.backends.execution.local.config import LocalExecutorConfig
from agl.backends.execution.local.pool import WorkerPool
from agl.backends.execution.worker import split_harness
from agl.core.contracts.execution import Exit, Key, Launch


class LocalExecutor:
    """Implements ``agl.core.controller.reconcile.Executor`` with local processes.

    Invariants: every launched attempt yields exactly one ``Exit`` (unless ``close()``
    comes first); a (rollout, attempt) already running is not launched again;
    ``free_slots`` is 0 before ``start()`` and after ``close()``."""

    detached = False  # nothing it starts outlives it

    def __init__(self, config: LocalExecutorConfig) -> None:
        self.config = config
        self._backend: WorkerPool | CommandRunner | None = None

    @property
    def free_slots(self) -> int:
        return 0 if self._backend is None else self._backend.free_slots

    async def start(self) -> None:
        """Check the harness and start what runs it; ValueError (one line) if it is bad.
        Idempotent."""
        if self._backend is not None:
            return
        harness = self.config.harness
        self.config.confining  # noqa: B018 - refuses confine=true where it cannot be had
        if harness.startswith("command:"):
            command = harness.removeprefix("command:").strip()
            if not command:
                raise ValueError(f"harness {harness!r}: the command is empty")
            self._backend = CommandRunner(self.config, command)
        else:
            split_harness(harness)
            pool = WorkerPool(self.config)
            await pool.start()
            self._backend = pool

    async def launch(self, launch: Launch) -> None:
        if self._backend is None:
            raise RuntimeError("LocalExecutor.launch before start()")
        await self._backend.launch(launch)

    async def exits(self) -> list[Exit]:
        return [] if self._backend is None else self._backend.take_exits()

    def running(self) -> set[Key]:
        return set() if self._backend is None else self._backend.running_keys()

    async def forget(self, rollout_id: str, attempt: int) -> None:
        """Nothing of an attempt outlives its exit here."""

    async def stop(self, keys: set[Key]) -> None:
        if self._backend is not None:
            await self._backend.stop(keys)

    async def close(self) -> None:
        if self._backend is not None:
            await self._backend.close()

    def pids(self) -> list[int]:
        """Live child process ids (workers or attempt processes): for tests and monitoring."""
        return [] if self._backend is None else self._backend.pids()
