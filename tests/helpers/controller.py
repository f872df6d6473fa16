"""The controller driving a LocalExecutor against a real gateway, for tests: rollout
specs, a controller running in the background, and waits for a group's final rollouts."""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx

from agl.backends.execution.local.executor import LocalExecutor
from agl.core.client import AsyncGatewayClient
from agl.core.contracts.failures import failure_cause
from agl.core.contracts.records import Rollout, Status
from agl.core.controller.reconcile import Controller
from agl.testing.processes import GatewayProcess


def specs(group: str, inputs: list[dict[str, Any]], **spec: Any) -> list[dict[str, Any]]:
    return [
        {"rollout_id": f"{group}-{i}", "group_id": group, "input": data, **spec}
        for i, data in enumerate(inputs)
    ]


def final(r: Rollout) -> bool:
    """Terminal for good: succeeded, failed by its agent (never retried), or failed with
    no attempt left."""
    if r.status is not Status.FAILED:
        return r.status is Status.SUCCEEDED
    cause = failure_cause(r.status, r.error, has_reward=False)
    return r.attempt == r.max_attempts or (cause is not None and cause.agent)


async def wait_until(check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 30.0) -> None:
    """Poll ``check`` (plain or async) every 50 ms until it holds."""
    deadline = time.monotonic() + timeout_s

    async def holds() -> bool:
        result = check()
        return await result if inspect.isawaitable(result) else result

    while not await holds():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.05)


@asynccontextmanager
async def running(
    gateway: GatewayProcess, ex: LocalExecutor
) -> AsyncIterator[tuple[Controller, AsyncGatewayClient]]:
    """A controller running ``ex`` in the background, and an admin client; the
    controller is cancelled on exit (which must close the executor)."""
    async with httpx.AsyncClient() as http:
        client = AsyncGatewayClient(gateway.url, gateway.token, http=http)
        controller = Controller(client, ex, gateway_url=gateway.url, model="policy", poll_s=0.02)
        task = asyncio.create_task(controller.run())
        try:
            await wait_until(lambda: _started(task, ex))
            yield controller, client
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _started(task: asyncio.Task[None], ex: LocalExecutor) -> bool:
    if task.done():
        task.result()  # raises what ended it
    return ex.free_slots > 0


async def group_final(
    client: AsyncGatewayClient, group: str, n: int, timeout_s: float = 30.0
) -> list[Rollout]:
    """The group's rollouts once all ``n`` are final (waits up to ``timeout_s``)."""
    out: list[Rollout] = []

    async def check() -> bool:
        out[:] = await client.list_rollouts(group_id=group)
        return len(out) == n and all(map(final, out))

    await wait_until(check, timeout_s)
    return sorted(out, key=lambda r: int(r.rollout_id.rsplit("-", 1)[1]))


def new_group() -> str:
    return f"g{uuid.uuid4().hex[:8]}"
