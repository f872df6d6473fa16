"""What an agent harness gets from agl, and how it reports back: ``AgentContext``.

A harness sees only its environment, as any harness would: the OpenAI base URL of its
attempt's proxy and its attempt's *model key* as ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``,
plus its rollout's input and where to report.

The model key calls the model and nothing else: harnesses pass their environment to the
model's shell tools, so a tool that posts ``reward 1.0`` with it is refused (403). The
*report key*, which posts the reward and ends the attempt, is never in an environment:
the worker running a Python harness holds it in memory, a command harness reads it once
from the pipe ``AGL_REPORT_FD`` names (``from_env`` does, and closes it), and a Kubernetes
Job's ``python -m agl.agent`` takes ``AGL_REPORT_KEY`` out of its environment before the
harness starts. ``AgentContext.from_env`` finds it wherever it is, so a harness author
changes nothing. The same variables reach a command harness (a
process per attempt) and a Python entry point run by a worker process (``module:function``
called with the mapping), so one harness runs either way::

    async def run(env: Mapping[str, str]) -> None:
        agent = AgentContext.from_env(env)
        client = openai.AsyncOpenAI(base_url=agent.base_url, api_key=agent.api_key)
        ...
        await agent.finish(reward=1.0)

(``agl.agent.harness`` does all of that but the task itself: ``run_episode``.) The
attempts of a worker process share its HTTP pool (``shared_http``; ``attempt_http`` makes
one outside a worker): a new ``httpx.AsyncClient`` costs ~80 ms of CPU (it loads the CA
store), more than a whole trivial rollout.

``finish`` posts the reward event (with the rollout's other metrics, if any) and sets the
attempt's status; both are idempotent, so a retried report changes nothing. An attempt
that ends without ``finish`` is failed by the controller ("agent exited without
reporting a status").

``python -m agl.agent MODULE:FUNCTION`` (``agl/agent/__main__.py``) runs one attempt of a
Python harness from this process's environment: what an agent container (a Kubernetes
Job) runs. It exits 0 when
the harness returned, 1 with one line on stderr when it raised, 2 on bad usage.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from agl.core.client import AsyncGatewayClient, fast_http_client
from agl.core.contracts.execution import (
    ENV_API_KEY,
    ENV_ATTEMPT,
    ENV_GATEWAY,
    ENV_INPUT,
    ENV_MODE,
    ENV_MODEL,
    ENV_ROLLOUT,
    AgentEnv,
)
from agl.core.contracts.records import EventIn, Status

log = logging.getLogger(__name__)

# Where a report key comes from when no wrapper in this process holds it: a pipe (a
# command harness; read once, then closed) or a variable that agl.agent removes at start.
ENV_REPORT_FD = "AGL_REPORT_FD"
ENV_REPORT_KEY = "AGL_REPORT_KEY"
# A task with a grader (agl/grading/): the attempt's own folder, and "1" to say that the
# grader, not the harness, reports (the harness holds no report key).
ENV_WORKSPACE = "AGL_WORKSPACE"
ENV_GRADED = "AGL_GRADED"
# A local run's graded attempts work in run_dir/WORKSPACES/<rollout>.<attempt>.
WORKSPACES = "workspaces"

# (rollout id, attempt as the environment spells it) -> report key, for the attempts this
# process runs: filled by the wrapper (the worker, agl.agent) or by the first read of
# AGL_REPORT_FD. Keyed by the variables' text, so no wrapper parses them twice.
_report_keys: dict[tuple[str, str], str] = {}
# The HTTP pool every attempt of this process shares: a worker's (``sharing_http``).
_shared_http: httpx.AsyncClient | None = None


@contextlib.contextmanager
def holding_report_key(rollout_id: str, attempt: int | str, key: str) -> Iterator[None]:
    """Make ``key`` the report key ``AgentContext.from_env`` finds for this attempt while
    the block runs (the wrapper around one attempt's harness)."""
    scope = (rollout_id, str(attempt))
    _report_keys[scope] = key
    try:
        yield
    finally:
        _report_keys.pop(scope, None)


@contextlib.contextmanager
def report_pipe(key: str) -> Iterator[int]:
    """The read end of a pipe holding ``key``: what a command harness reads its report key
    from (``AGL_REPORT_FD``), never its environment. Ours is closed once the child has it;
    a key is far below a pipe's buffer, so the write never blocks."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, key.encode())
    finally:
        os.close(write_fd)
    try:
        yield read_fd
    finally:
        os.close(read_fd)


def _report_key_from(env: Mapping[str, str]) -> str:
    scope = (env.get(ENV_ROLLOUT, ""), env.get(ENV_ATTEMPT, ""))
    held = _report_keys.get(scope)
    if held is not None or ENV_REPORT_FD not in env:
        return held or env.get(ENV_REPORT_KEY, "")
    try:
        fd = int(env[ENV_REPORT_FD])
        with os.fdopen(fd, "rb") as pipe:  # closes it: the harness's children lose it
            key = pipe.read().decode().strip()
    except (ValueError, OSError) as error:
        raise AgentEnvError(f"cannot read the report key from {ENV_REPORT_FD}: {error}") from None
    _report_keys[scope] = key
    return key


def undumpable() -> None:
    """Keep other processes of this user (the model's tools) out of this one's memory and
    ``/proc/<pid>/environ``: Linux's ``PR_SET_DUMPABLE`` 0 (a no-op elsewhere). It does
    not stop root."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4


def shared_http() -> httpx.AsyncClient | None:
    """The worker's HTTP pool, for harnesses to pass as ``http=`` (or to an OpenAI client
    as ``http_client=``); None outside a worker process. Never close it."""
    return _shared_http


@contextlib.asynccontextmanager
async def sharing_http(connections: int) -> AsyncIterator[None]:
    """A pool of ``connections`` that every attempt of this process shares while the
    block runs (a worker's), closed after it."""
    global _shared_http
    pool = _shared_http = fast_http_client(connections)
    try:
        yield
    finally:
        await pool.aclose()
        _shared_http = None


@contextlib.asynccontextmanager
async def attempt_http(timeout_s: float = 600.0) -> AsyncIterator[httpx.AsyncClient]:
    """The pool an attempt's calls go through: the worker's own in a worker process,
    else (the command form, a test) one for this attempt alone, closed after it."""
    if _shared_http is not None:
        yield _shared_http
        return
    async with fast_http_client(8, timeout_s) as own:
        yield own


class AgentEnvError(ValueError):
    """The environment lacks a variable an agent needs, or holds a malformed one."""


@dataclass(frozen=True)
class AgentContext(AgentEnv):
    """An attempt's ``AgentEnv`` as its harness holds it: with the report key, and what it
    reports with."""

    # The report key (events, the attempt's end); the model key where none is held, which
    # the gateway refuses for reporting.
    report_key: str = ""
    # The task's grader reports this attempt (agl/grading/): ``finish`` posts nothing.
    graded: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AgentContext:
        missing = [
            name
            for name in (ENV_API_KEY, ENV_GATEWAY, ENV_ROLLOUT, ENV_ATTEMPT, ENV_INPUT)
            if name not in env
        ]
        if missing:
            raise AgentEnvError(f"the agent's environment lacks {', '.join(missing)}")
        try:
            attempt = int(env[ENV_ATTEMPT])
            data = json.loads(env[ENV_INPUT])
        except ValueError as error:
            raise AgentEnvError(f"malformed {ENV_ATTEMPT} or {ENV_INPUT}: {error}") from None
        return cls(
            gateway_url=env[ENV_GATEWAY],
            rollout_id=env[ENV_ROLLOUT],
            attempt=attempt,
            mode=env.get(ENV_MODE, "train"),
            model=env.get(ENV_MODEL, ""),
            api_key=env[ENV_API_KEY],
            input=data,
            report_key=_report_key_from(env),
            graded=env.get(ENV_GRADED) == "1",
        )

    def client(self, http: httpx.AsyncClient | None = None) -> AsyncGatewayClient:
        """A gateway client holding this attempt's report key (it can touch this attempt
        only)."""
        return AsyncGatewayClient(self.gateway_url, self.report_key or self.api_key, http=http)

    async def finish(
        self,
        reward: float | None = None,
        error: str | None = None,
        http: httpx.AsyncClient | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Report the reward (if any), then the attempt's end: succeeded, or failed with
        ``error``. Event ids are derived from the attempt, so a repeated ``finish``
        appends nothing.

        ``metrics`` (name -> number) ride on the reward event, as
        ``{"value": reward, "metrics": {...}}``: what the rollout did besides its reward
        (the trainer reports their means). Non-finite values are left out (a metric
        undefined for this rollout has no value), and so is the key when none is left;
        without a reward there is no event to carry them.

        In a graded attempt (``graded``) it posts nothing: the task's grader reports once
        the harness has exited, so a harness runs unchanged with or without one."""
        if self.graded:
            log.info("rollout %s: graded by its task's grader; not reporting", self.rollout_id)
            return
        gateway = self.client(http)
        try:
            if reward is not None:
                data: dict[str, Any] = {"value": float(reward)}
                finite = _finite(metrics or {})
                if finite:
                    data["metrics"] = finite
                event = EventIn(
                    event_id=event_id(self.rollout_id, self.attempt, "reward"),
                    type="reward",
                    data=data,
                )
                await gateway.post_events(self.rollout_id, self.attempt, [event])
            status = Status.FAILED if error is not None else Status.SUCCEEDED
            await gateway.patch_attempt(self.rollout_id, self.attempt, status, error=error)
        finally:
            await gateway.close()


def _finite(metrics: Mapping[str, float]) -> dict[str, float]:
    # JSON has no NaN or infinity (the store would refuse or mangle them).
    values = {str(name): float(value) for name, value in metrics.items()}
    return {name: value for name, value in values.items() if math.isfinite(value)}


def event_id(rollout_id: str, attempt: int, name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"agl:{rollout_id}:{attempt}:{name}"))
