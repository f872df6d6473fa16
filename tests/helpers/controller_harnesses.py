"""Small Python harnesses for tests/core/controller/test_controller.py, run by LocalExecutor's
workers (``tests.helpers.controller_harnesses:<name>``, imported from the repo root).

Each reads its rollout's input from ``env`` and reports with ``AgentContext``, sharing the
worker's HTTP pool. ``input`` keys they understand: ``reward`` (float), ``sleep`` (s),
``until`` (a path: wait until that file exists, the test's go, before finishing).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import Mapping
from pathlib import Path

import httpx
import openai

from agl.agent import AgentContext, shared_http
from agl.core.contracts.records import EventIn


async def _seen(agent: AgentContext) -> None:
    """Record a hash of the attempt key this attempt got (the test checks they differ)."""
    digest = hashlib.sha256(agent.api_key.encode()).hexdigest()
    event = EventIn(type="seen", data={"key": digest, "pool": shared_http() is not None})
    await agent.client(shared_http()).post_events(agent.rollout_id, agent.attempt, [event])


async def _hold(agent: AgentContext) -> None:
    """Sleep ``sleep`` s, then wait for the file ``until`` names: a test that kills the
    attempt meanwhile knows it was still running, however slow the machine."""
    await asyncio.sleep(float(agent.input.get("sleep", 0)))
    until = agent.input.get("until")
    while until and not Path(until).exists():
        await asyncio.sleep(0.05)


async def reward_from_input(env: Mapping[str, str]) -> None:
    agent = AgentContext.from_env(env)
    await _seen(agent)
    await _hold(agent)
    print(f"rollout {agent.rollout_id} done")  # lands in the worker log, not the protocol
    await agent.finish(reward=float(agent.input["reward"]), http=shared_http())


async def finish_only(env: Mapping[str, str]) -> None:
    await AgentContext.from_env(env).finish(reward=1.0, http=shared_http())


async def second_time_lucky(env: Mapping[str, str]) -> None:
    """Attempt 1 ends without a status; attempt 2 succeeds."""
    agent = AgentContext.from_env(env)
    await _seen(agent)
    if agent.attempt >= 2:
        await agent.finish(reward=1.0, http=shared_http())


async def no_status(env: Mapping[str, str]) -> None:
    print("returning without finish", file=sys.stderr)


async def raises(env: Mapping[str, str]) -> None:
    raise ValueError("the input is bad\nand this second line is not reported")


async def hangs(env: Mapping[str, str]) -> None:
    await asyncio.sleep(3600)


async def exits_process(env: Mapping[str, str]) -> None:
    sys.exit(3)  # must not take the worker down


def not_async(env: Mapping[str, str]) -> None:
    """Not a valid harness: a plain function."""


async def by_input(env: Mapping[str, str]) -> None:
    """One harness for many behaviours, so one worker pool serves a whole test:
    input ``{"do": "finish" | "none" | "lucky" | "raise" | "hang" | "exit" | "flood" |
    "calls" | "reward_twice", ...}``."""
    agent = AgentContext.from_env(env)
    do = agent.input.get("do", "finish")
    if do in ("flood", "calls"):
        await calls(agent, int(agent.input["n"]), concurrent=do == "flood")
        return
    if do == "reward_twice":
        await agent.finish(reward=0.25, http=shared_http())
        await agent.finish(reward=1.0, http=shared_http())  # the same event id: a no-op
        return
    if do in ("finish", "lucky", "none"):
        await _seen(agent)
    await _hold(agent)
    if do == "finish" or (do == "lucky" and agent.attempt >= 2):
        print(f"rollout {agent.rollout_id} done")  # lands in the worker log
        await agent.finish(reward=float(agent.input.get("reward", 1.0)), http=shared_http())
    elif do == "lucky":
        # The agent could not reach its gateway: the infrastructure's failure, retried.
        raise ConnectionRefusedError("[Errno 111] Connection refused")
    elif do == "raise":
        await raises(env)
    elif do == "hang":
        await hangs(env)
    elif do == "exit":
        await exits_process(env)


async def calls(agent: AgentContext, n: int, concurrent: bool) -> None:
    """``n`` chat calls through the attempt's proxy, all at once (a runaway agent) or one
    after another; their HTTP statuses are reported as a ``calls`` event."""
    statuses: list[int] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n), timeout=60) as http:
        # The flooder must see its 429s, so it never retries; the polite agent (never
        # throttled) rides out a connection reset while the flood saturates the gateway.
        client = openai.AsyncOpenAI(
            base_url=agent.base_url,
            api_key=agent.api_key,
            http_client=http,
            max_retries=0 if concurrent else 2,
        )

        async def one(i: int) -> None:
            try:
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": f"call {i}"}]
                )
                statuses.append(200)
            except openai.APIStatusError as error:
                statuses.append(error.status_code)

        if concurrent:
            await asyncio.gather(*(one(i) for i in range(n)))
        else:
            for i in range(n):
                await one(i)
    event = EventIn(type="calls", data={"statuses": statuses})
    await agent.client(shared_http()).post_events(agent.rollout_id, agent.attempt, [event])
    await agent.finish(reward=1.0, http=shared_http())
