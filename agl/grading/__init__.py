"""Rewards computed outside the agent: a task's *grader*, run on the controller's side.

Some tasks are graded by what the agent left behind, not by what it says: a coding
agent's reward is whether the task's tests pass on its edited repository. If the harness
computed that reward, anything the model's tools can reach (its files, its environment,
the harness's memory) could change it. A grader instead runs in the executor's process,
after the harness has exited, outside the agent's confinement, and is the only holder of
the attempt's report key:

- each attempt gets its own **workspace** (``AGL_WORKSPACE``, the command's working
  folder), the only part of the run's folder a confined agent sees: not the store, not
  another attempt's workspace;
- the harness gets **no report key** (``AGL_GRADED=1`` says why): its ``finish()`` posts
  nothing, and a tool that tries with the model key is refused as ever;
- when the harness exits 0, the executor calls the grader with the attempt's input and
  workspace and posts its verdict: the reward event (with the grade's metrics), a
  ``grade`` event with its details, and the attempt's end (succeeded). A harness that
  fails or times out is not graded: its failure is the agent's (``agl.core.contracts.failures``);
- a grader that raises fails the attempt as the agent's failure (``grader raised: ...``):
  an agent must not escape its zero by breaking what the grader reads.
- the workspace is the agent's: a link in it may point anywhere the grader (not the
  agent) can read, so a grader opens the agent's files through ``GradeRequest.file``.

A grader is an ``async def grade(request: GradeRequest) -> Grade | float`` named in the
task's yaml (``grader: module:function``); blocking work (running tests) goes through
``asyncio.to_thread`` or a subprocess. It runs with the local executor's command
harnesses (one process per attempt, so each has a workspace of its own) and with the
Kubernetes executor, where a Job's harness runs as its init container and the grader
(``python -m agl.grading``, ``__main__.py``) as its one container, the only one holding
the report key (agl/backends/execution/k8s/manifests.py).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import traceback
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agl.agent import AgentContext, event_id
from agl.backends.execution.worker import one_line
from agl.core.callables import load_callable
from agl.core.client import AsyncGatewayClient
from agl.core.contracts.failures import GRADE_NOT_POSTED, GRADER_RAISED
from agl.core.contracts.records import EventIn

log = logging.getLogger(__name__)

GRADE_EVENT = "grade"


@dataclass(frozen=True)
class GradeRequest:
    """What a grader sees of one attempt."""

    rollout_id: str
    attempt: int
    input: Any  # the rollout's input, as the harness got it
    workspace: Path  # the folder the harness worked in (its AGL_WORKSPACE)

    def file(self, name: str) -> Path:
        """``name`` in the workspace, links resolved; ValueError when it leads out of it.
        The grader runs outside the agent's confinement, so a link the agent planted
        (to another attempt's workspace, the store) would make it read what the agent
        cannot: read the agent's files through this."""
        root = self.workspace.resolve()
        path = (root / name).resolve()
        if not path.is_relative_to(root):
            raise ValueError(f"{name!r} leads out of the attempt's workspace")
        return path


@dataclass(frozen=True)
class Grade:
    """A grader's verdict: the reward, metrics riding on the reward event (as
    ``AgentContext.finish`` puts them), and details recorded as a ``grade`` event (e.g.
    which tests passed)."""

    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):
            raise ValueError(f"a grade's reward must be a finite number, not {self.reward!r}")


Grader = Callable[[GradeRequest], Awaitable["Grade | float"]]


def load_grader(spec: str) -> Grader:
    """The grader ``spec`` (``module:function``) names; ValueError (one line) when it is
    not an async function."""
    function = load_callable(spec)
    if not inspect.iscoroutinefunction(function):
        raise ValueError(
            f"grader {spec!r} is not an async function "
            "(want: async def grade(request: GradeRequest) -> Grade | float)"
        )
    return function


def as_grade(verdict: Grade | float) -> Grade:
    """A grader's answer as a ``Grade``; ValueError when it is neither a grade nor a
    number."""
    if isinstance(verdict, Grade):
        return verdict
    if isinstance(verdict, bool) or not isinstance(verdict, int | float):
        raise ValueError(f"a grader returns a Grade or a number, not {type(verdict).__name__}")
    return Grade(reward=float(verdict))


async def post_grade(
    context: AgentContext, grade: Grade, http: httpx.AsyncClient | None = None
) -> None:
    """Post ``grade`` with ``context``'s report key: its details (a ``grade`` event), then
    the reward and the attempt's end (``context.finish``). Event ids are derived from the
    attempt, so a repeated post appends nothing."""
    if grade.details:
        gateway = AsyncGatewayClient(context.gateway_url, context.report_key, http=http)
        try:
            event = EventIn(
                event_id=event_id(context.rollout_id, context.attempt, GRADE_EVENT),
                type=GRADE_EVENT,
                data=dict(grade.details),
            )
            await gateway.post_events(context.rollout_id, context.attempt, [event])
        finally:
            await gateway.close()
    await context.finish(reward=grade.reward, metrics=grade.metrics, http=http)


class GradeNotPosted(RuntimeError):
    """The gateway refused the grade or could not be reached: not the agent's doing."""


async def grade_attempt(
    grader: Grader, context: AgentContext, workspace: Path, timeout_s: float | None
) -> str | None:
    """Run ``grader`` on the attempt's ``workspace`` (within ``timeout_s``) and post its
    verdict with ``context``'s report key. Answers None when it is posted, or the
    attempt's error (``grader raised: ...``) when the grader raised or timed out, which
    the caller reports as the agent's failure. GradeNotPosted when the verdict cannot be
    posted."""
    request = GradeRequest(context.rollout_id, context.attempt, context.input, workspace)
    try:
        grade = as_grade(await asyncio.wait_for(grader(request), timeout_s))
    except asyncio.CancelledError:
        raise
    except Exception as error:
        timed_out = isinstance(error, TimeoutError) and timeout_s is not None
        text = f"timed out after {timeout_s:g} s" if timed_out else one_line(error)
        log.error(
            "rollout %s attempt %d: the grader raised\n%s",
            context.rollout_id,
            context.attempt,
            "".join(traceback.format_exception(error)).rstrip(),
        )
        return f"{GRADER_RAISED}: {text}"
    try:
        await post_grade(context, grade)
    except Exception as error:
        raise GradeNotPosted(f"{GRADE_NOT_POSTED}{one_line(error)}") from error
    return None
