"""What every Python harness does around its task, so that a harness is its task alone:
the attempt's context from its environment, the HTTP pool, an OpenAI client through the
attempt's proxy, and the report of how the episode ended::

    async def run(env: Mapping[str, str]) -> None:  # the entry point, ``module:run``
        await run_episode(env, episode)


    async def episode(attempt: Attempt) -> Outcome:
        reply = await attempt.client.chat.completions.create(model=attempt.model, ...)
        return Outcome(reward=...)


    def main() -> None:  # the command form, ``python -m module``
        run_command(run, "module")

``run_episode`` reports the episode's ``Outcome`` (``AgentContext.finish``: the reward and
its metrics), or fails the attempt with one line when the episode raised ``BadInput``
(``bad input: ...``: the rollout's input describes no task), ``AttemptFailed`` (its
message: something the task needs is down) or an ``openai.APIStatusError`` that the
client's retries did not get past (``model call refused: ...``). Anything else it raises
propagates: the executor reports the harness's exception.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from agl.agent import AgentContext, AgentEnvError, attempt_http

# With one model registered the gateway routes any name to it; AGL_MODEL wins when set.
DEFAULT_MODEL = "policy"
# A call can wait at the gateway's admission gate for a whole training step.
CALL_TIMEOUT_S = 300.0
# The openai client's backoff (0.5 s doubling): 5 retries ride out a gateway restart.
MAX_RETRIES = 5


class BadInput(ValueError):
    """The rollout's input describes no task the harness can play."""


class AttemptFailed(Exception):
    """The attempt cannot go on, for a reason its harness names (its retriever is down,
    its sandbox will not start)."""


@dataclass(frozen=True)
class Attempt:
    """What an episode plays with."""

    agent: AgentContext  # the rollout's input, ids and keys
    http: httpx.AsyncClient  # the pool the model client goes through; never close it
    client: openai.AsyncOpenAI  # through the attempt's proxy

    @property
    def model(self) -> str:
        """The model name to call."""
        return self.agent.model or DEFAULT_MODEL


@dataclass(frozen=True)
class Outcome:
    """How an episode ended: its reward, and what the rollout did besides (the trainer
    reports their means)."""

    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)


async def run_episode(
    env: Mapping[str, str],
    episode: Callable[[Attempt], Awaitable[Outcome]],
    *,
    timeout_s: float = CALL_TIMEOUT_S,
    max_retries: int = MAX_RETRIES,
) -> None:
    """One attempt: play ``episode`` and report how it ended. ``timeout_s`` bounds each
    model call (and the pool's requests outside a worker); ``max_retries`` is the OpenAI
    client's."""
    agent = AgentContext.from_env(env)
    async with attempt_http(timeout_s) as http:
        # Never closed: closing an OpenAI client closes the pool under it, not its own.
        client = openai.AsyncOpenAI(
            base_url=agent.base_url,
            api_key=agent.api_key,
            # Typed as httpx2's client; httpx's passes its check too.
            http_client=http,  # type: ignore[arg-type]
            max_retries=max_retries,
            timeout=timeout_s,
        )
        try:
            outcome = await episode(Attempt(agent, http, client))
        except BadInput as error:
            failure = f"bad input: {error}"
        except openai.APIStatusError as error:
            failure = f"model call refused: {error}"
        except AttemptFailed as error:
            failure = str(error)
        else:
            await agent.finish(reward=outcome.reward, metrics=outcome.metrics, http=http)
            return
        await agent.finish(error=failure, http=http)


def run_command(run: Callable[[Mapping[str, str]], Coroutine[Any, Any, None]], name: str) -> None:
    """``python -m name``: one attempt of ``run`` from ``os.environ``; an environment that
    lacks or garbles a variable exits with one line saying which."""
    try:
        asyncio.run(run(os.environ))
    except AgentEnvError as error:
        sys.exit(f"{name}: {error}")
