"""A retry storm changes nothing: every call sent 1 to 5 times, copies concurrently and some
landing late (after the calls that followed it), leaves the gateway in the state that
sending each call once leaves it in — rollouts, statuses, attempts, versions, events.

Two real gateways on loopback: one gets each call once, in order; the other the storm.
Their rollouts and events are compared field by field (timestamps and keys aside).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from agl.testing.processes import GatewayProcess, gateway_process

ROLLOUTS = 40
VOLATILE = {
    "created_at",
    "updated_at",
    "started_at",
    "ended_at",
    "attempt_key",
    "report_key",
    "time",
}


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: Any
    as_agent: bool  # sent with the attempt's key (else the admin token)


def plan(rid: str, kind: str) -> list[Call]:
    """One rollout's calls, in the order a trainer, a controller and an agent make them."""
    base, key = f"/api/rollouts/{rid}", f"/api/rollouts/{rid}/attempt"

    def attempt(n: int, reward: float, ok: bool) -> list[Call]:
        events = [
            {"event_id": f"{rid}-{n}-note", "type": "note", "data": {"turn": n}},
            {"event_id": f"{rid}-{n}-reward", "type": "reward", "data": {"value": reward}},
        ]
        end = {"status": "succeeded"} if ok else {"status": "failed", "error": "tool crashed"}
        return [
            Call("PATCH", base, {"status": "running", "attempt": n}, False),
            Call("POST", f"{key}/{n}/events", events, True),
            Call("PATCH", f"{key}/{n}", end, True),
        ]

    calls = [Call("POST", "/api/rollouts", [{"rollout_id": rid, "max_attempts": 2}], False)]
    if kind == "ok":
        return calls + attempt(1, 1.0, True)
    if kind == "retried":
        requeue = Call("PATCH", base, {"status": "queuing", "attempt": 1}, False)
        return calls + attempt(1, 0.0, False) + [requeue] + attempt(2, 0.5, True)
    stop = Call("PATCH", base, {"status": "failed", "attempt": 1, "error": "cancelled"}, False)
    return [*calls, Call("PATCH", base, {"status": "running", "attempt": 1}, False), stop]


class Sender:
    def __init__(self, http: httpx.AsyncClient, gateway: GatewayProcess) -> None:
        self.http, self.gateway = http, gateway
        self.keys: dict[str, str] = {}
        self.statuses: list[int] = []

    async def send(self, rid: str, call: Call) -> None:
        token = self.keys[rid] if call.as_agent else self.gateway.token
        response = await self.http.request(
            call.method,
            self.gateway.url + call.path,
            json=call.body,
            headers={"Authorization": f"Bearer {token}"},
        )
        self.statuses.append(response.status_code)
        assert response.status_code < 500, response.text
        if call.method == "PATCH" and call.body.get("status") == "running" and response.is_success:
            self.keys[rid] = response.json()["report_key"]


async def once(sender: Sender, plans: dict[str, list[Call]]) -> None:
    for rid, calls in plans.items():
        for call in calls:
            await sender.send(rid, call)


async def storm(sender: Sender, plans: dict[str, list[Call]], rng: random.Random) -> None:
    late: list[asyncio.Task[None]] = []

    async def later(rid: str, call: Call, delay: float) -> None:
        await asyncio.sleep(delay)
        await sender.send(rid, call)

    async def one(rid: str, calls: list[Call]) -> None:
        for call in calls:
            copies = rng.randint(1, 5)
            now = rng.randint(1, copies)
            await asyncio.gather(*(sender.send(rid, call) for _ in range(now)))
            late.extend(
                asyncio.create_task(later(rid, call, rng.uniform(0, 0.3)))
                for _ in range(copies - now)
            )

    await asyncio.gather(*(one(rid, calls) for rid, calls in plans.items()))
    await asyncio.gather(*late)


async def snapshot(http: httpx.AsyncClient, gateway: GatewayProcess, ids: list[str]) -> dict:
    headers = {"Authorization": f"Bearer {gateway.token}"}
    state = {}
    for rid in ids:
        rollout = (await http.get(f"{gateway.url}/api/rollouts/{rid}", headers=headers)).json()
        events = (
            await http.get(f"{gateway.url}/api/rollouts/{rid}/events", headers=headers)
        ).json()
        items = events["items"] if isinstance(events, dict) else events
        sequences = [e["sequence"] for e in items]
        assert sequences == sorted(set(sequences))  # one per event, in order
        # The sequence counts across the store, so it differs between the two runs;
        # each rollout's order of events must not.
        state[rid] = (
            {k: v for k, v in rollout.items() if k not in VOLATILE},
            [{k: v for k, v in e.items() if k not in VOLATILE | {"sequence"}} for e in items],
        )
    return state


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, ...]]:
    with (
        gateway_process(tmp_path_factory.mktemp("clean")) as clean,
        gateway_process(tmp_path_factory.mktemp("storm")) as stormy,
    ):
        yield clean, stormy


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_retry_storm_leaves_the_state_of_sending_each_call_once(
    gateways: tuple[GatewayProcess, GatewayProcess], seed: int
) -> None:
    clean, stormy = gateways
    rng = random.Random(seed)
    plans = {
        f"s{seed}-{i}": plan(f"s{seed}-{i}", rng.choice(["ok", "retried", "cancelled"]))
        for i in range(ROLLOUTS)
    }

    async def main() -> tuple[dict, dict, list[int]]:
        async with httpx.AsyncClient(timeout=30) as http:
            reference, stormed = Sender(http, clean), Sender(http, stormy)
            await once(reference, plans)
            await storm(stormed, plans, rng)
            ids = list(plans)
            return (
                await snapshot(http, clean, ids),
                await snapshot(http, stormy, ids),
                stormed.statuses,
            )

    expected, got, statuses = asyncio.run(main())
    assert got == expected
    calls = sum(len(c) for c in plans.values())
    assert len(statuses) > calls  # there were repeats
    # 409: a repeat of a transition already made; 403: a late repeat of an agent's call
    # whose attempt has since been replaced (its key no longer opens anything).
    assert set(statuses) <= {200, 201, 403, 409}, sorted(set(statuses))
