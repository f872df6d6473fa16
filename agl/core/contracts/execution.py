"""How a rollout attempt is executed, as the rollout controller sees it: the
``Executor`` protocol (local processes, Kubernetes Jobs implement it in
``agl/backends/execution``), what it is told (``Launch``, with the agent's environment:
``AgentEnv``) and answers (``Exit``), and the outcome texts the controller writes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Protocol

NO_STATUS = "agent exited without reporting a status"
STOPPED = "controller stopped"
ORPHANED = "stopped by the controller: its rollout is no longer running at this attempt"
LOST = "no execution found for this running attempt (lost while no controller watched it)"


# The variables an attempt's agent is started with (``AgentEnv.to_env``): the OpenAI SDK
# reads the first two itself.
ENV_BASE_URL = "OPENAI_BASE_URL"
ENV_API_KEY = "OPENAI_API_KEY"
ENV_MODEL = "AGL_MODEL"
ENV_GATEWAY = "AGL_GATEWAY_URL"
ENV_ROLLOUT = "AGL_ROLLOUT_ID"
ENV_ATTEMPT = "AGL_ATTEMPT"
ENV_MODE = "AGL_MODE"
ENV_INPUT = "AGL_INPUT"
# An attempt's OpenAI base URL below the gateway's: its recording proxy.
PROXY_BASE_PATH = "/proxy/rollout/{rollout_id}/attempt/{attempt}/mode/{mode}/openai/v1"


@dataclass(frozen=True)
class AgentEnv:
    """What an attempt's agent is told: the controller makes one per launch (its
    ``to_env()`` is ``Launch.env``) and ``agl.agent.AgentContext`` reads it back. The
    report key is never part of it."""

    gateway_url: str
    rollout_id: str
    attempt: int
    mode: str
    model: str
    api_key: str  # the model key
    input: Any

    @property
    def base_url(self) -> str:
        """The attempt's OpenAI base URL (the gateway's recording proxy)."""
        path = PROXY_BASE_PATH.format(
            rollout_id=self.rollout_id, attempt=self.attempt, mode=self.mode
        )
        return self.gateway_url.rstrip("/") + path

    def to_env(self) -> dict[str, str]:
        return {
            ENV_BASE_URL: self.base_url,
            ENV_API_KEY: self.api_key,
            ENV_MODEL: self.model,
            ENV_GATEWAY: self.gateway_url,
            ENV_ROLLOUT: self.rollout_id,
            ENV_ATTEMPT: str(self.attempt),
            ENV_MODE: self.mode,
            ENV_INPUT: json.dumps(self.input),
        }


@dataclass(frozen=True)
class Launch:
    """One attempt to execute."""

    rollout_id: str
    attempt: int
    timeout_s: float | None
    env: dict[str, str]  # AgentEnv(...).to_env(): proxy base URL, model key, input, ...
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
