"""How a rollout attempt is executed, as the rollout controller sees it: the
``Executor`` protocol (local processes, Kubernetes Jobs implement it in
``agl/backends/execution``), what it is told (``Launch``) and answers (``Exit``), and the
outcome texts the controller writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

NO_STATUS = "agent exited without reporting a status"
STOPPED = "controller stopped"
ORPHANED = "stopped by the controller: its rollout is no longer running at this attempt"
LOST = "no execution found for this running attempt (lost while no controller watched it)"


@dataclass(frozen=True)
class Launch:
    """One attempt to execute."""

    rollout_id: str
    attempt: int
    timeout_s: float | None
    env: dict[str, str]  # AgentContext(...).to_env(): proxy base URL, model key, input, ...
    # Never in ``env``: the executor hands it to the harness wrapper alone (agl/agent.py).
    report_key: str = ""


@dataclass(frozen=True)
class Exit:
    """An attempt that ended. ``error`` is None when the harness returned (or the process
    exited 0), else one line: "exit code 3", "timed out after 5 s", "ValueError: ..."."""

    rollout_id: str
    attempt: int
    error: str | None


Key = tuple[str, int]  # (rollout_id, attempt)


class Executor(Protocol):
    detached: bool  # executions outlive the controller; close() leaves them running

    @property
    def free_slots(self) -> int:
        """How many more attempts it can run now."""
        ...

    async def start(self) -> None: ...

    async def launch(self, launch: Launch) -> None: ...

    async def exits(self) -> list[Exit]:
        """Attempts finished since the last call; must not block long."""
        ...

    def running(self) -> set[Key]:
        """Attempts executing now, those found at ``start()`` included."""
        ...

    async def forget(self, rollout_id: str, attempt: int) -> None:
        """The attempt's exit is recorded at the gateway: drop what is left of it."""
        ...

    async def stop(self, keys: set[Key]) -> None:
        """End these executions; each yields its ``Exit``."""
        ...

    async def close(self) -> None:
        """Kill everything still running; idempotent."""
        ...
