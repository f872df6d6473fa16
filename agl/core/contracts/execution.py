"""How a rollout attempt is executed, as the rollout controller sees it: the
``Executor`` protocol (local processes, Kubernetes Jobs implement it in
``agl/backends/execution``), what it is told (``Launch``) and answers (``Exit``), and the
outcome texts the controller writes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
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
class AgentLog:
    """What one of an attempt's processes printed, where nothing else keeps it: a pod's
    container, whose log goes with the Job. ``text`` is the tail if the log was longer
    than the executor keeps (``truncated``); ``reason`` is how it ended ("Error, exit code
    1"); ``note`` says why there is no text, when there is none to read."""

    source: str  # "pod NAME, container NAME"
    text: str
    truncated: bool = False
    reason: str | None = None
    note: str = ""

    def lines(self) -> list[str]:
        return self.text.splitlines()


# The event the controller records an attempt's AgentLogs as; only the admin writes it
# (an agent could otherwise post a log of its choosing, or take the id first).
AGENT_LOG_EVENT = "agent_log"
AGENT_LOG_EVENT_ID = "agent-log"


def agent_log_data(logs: tuple[AgentLog, ...]) -> dict[str, object]:
    return {"logs": [asdict(log) for log in logs]}


def agent_logs_of(data: object) -> list[AgentLog]:
    """The AgentLogs an ``agent_log`` event holds; what is not one is left out."""
    items = data.get("logs") if isinstance(data, dict) else None
    logs = []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            logs.append(
                AgentLog(
                    source=str(item.get("source", "?")),
                    text=item["text"],
                    truncated=bool(item.get("truncated")),
                    reason=None if item.get("reason") is None else str(item["reason"]),
                    note=str(item.get("note") or ""),
                )
            )
    return logs


@dataclass(frozen=True)
class Exit:
    """An attempt that ended. ``error`` is None when the harness returned (or the process
    exited 0), else one line: "exit code 3", "timed out after 5 s", "ValueError: ...".
    ``logs``: what the executor kept of its output that would otherwise be lost."""

    rollout_id: str
    attempt: int
    error: str | None
    logs: tuple[AgentLog, ...] = ()


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
