"""``GET /api/summaries`` and ``GET /api/rollouts/{id}/transitions`` against a real gateway
process: filters, sorts and pages against a model of planted rollouts (odd ones included),
the items as an admin reads them, both clients, the 400s, 401/403, the OpenAPI
declaration, and the status history, also of a store made before it kept one."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl.core.client import AsyncGatewayClient, GatewayClient, GatewayError
from agl.core.contracts.queries import RolloutRow, SortKey, Summary, SummaryQuery
from agl.core.contracts.records import EventIn, Rollout, Status
from agl.core.http_errors import ErrorResponse
from agl.testing.processes import GatewayProcess, gateway_process


def call(tokens: int) -> EventIn:
    return EventIn(
        type="model_request",
        data={"prompt_ids": [1, 2], "response_ids": [7] * tokens, "logprobs": [-0.1] * tokens},
    )


@dataclass(frozen=True)
class Plan:
    """One planted rollout: its calls' sampled tokens, the rewards posted in order, and
    how it ends (``retry``: attempt 1 fails with events, attempt 2 waits)."""

    name: str
    mode: str
    metadata: dict[str, Any]
    calls: tuple[int, ...]
    rewards: tuple[Any, ...]
    end: str


PLANS = (
    Plan("a", "train", {"batch": 0}, (5, 7), (1.0,), "succeeded"),
    Plan("b", "train", {"batch": 0}, (3,), (0.5,), "succeeded"),
    Plan("c", "train", {"batch": 1}, (), (1.0,), "succeeded"),  # a reward, no call
    Plan("d", "val", {"step": 1}, (4, 4, 4), (0.0,), "succeeded"),
    Plan("e", "val", {"step": 2}, (2,), (), "failed"),  # no reward
    Plan("f", "train", {"batch": 1}, (9,), ("high",), "succeeded"),  # not a number
    Plan("g", "train", {"step": True}, (1,), (0.25, 0.75), "succeeded"),  # no step; the last
    Plan("h", "train", {}, (6,), (0.5,), "running"),  # no duration yet
    Plan("i", "train", {"batch": 2}, (), (), "queuing"),  # no summary
    Plan("j", "val", {"step": 2}, (2, 2), (-1.0,), "failed"),
    Plan("k", "train", {"batch": 0}, (3,), (0.5,), "retry"),  # attempt 2: no summary
    Plan("l", "train", {"batch": "0"}, (1, 1), (1.0,), "succeeded"),  # a string: no step
)
REWARD_BOUNDS = (-1.0, 0.0, 0.25, 0.5, 0.75, 1.0, 2.0)


@dataclass(frozen=True)
class Expected:
    """What the store should say of a planted rollout."""

    rollout_id: str
    index: int  # creation order
    status: Status
    mode: str
    step: int | None
    attempt: int
    calls: int | None  # None: no summary (no event in the current attempt)
    tokens: int | None
    reward: float | None
    duration: float | None

    def value(self, key: SortKey) -> float | None:
        return {
            SortKey.CREATED: float(self.index),
            SortKey.REWARD: self.reward,
            SortKey.TURNS: None if self.calls is None else float(self.calls),
            SortKey.TOKENS: None if self.tokens is None else float(self.tokens),
            SortKey.DURATION: self.duration,
        }[key]


def step_rule(metadata: dict[str, Any]) -> int | None:
    """The trainer's metadata as a step, written out apart from the store's SQL."""
    for key, add in (("step", 0), ("batch", 1)):
        value = metadata.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value + add
    return None


def last_number(rewards: tuple[Any, ...]) -> float | None:
    value = rewards[-1] if rewards else None
    return float(value) if isinstance(value, int | float) else None


@dataclass(frozen=True)
class Planted:
    group: str
    expected: list[Expected]


@pytest.fixture(scope="module")
def planted(gateway: GatewayProcess) -> Planted:
    group = f"sum-{uuid.uuid4().hex[:6]}"
    with GatewayClient(gateway.url, gateway.token) as admin:
        admin.create_rollouts(
            [
                {
                    "rollout_id": f"{group}-{p.name}",
                    "group_id": group,
                    "mode": p.mode,
                    "metadata": p.metadata,
                    "max_attempts": 2,
                }
                for p in PLANS
            ]
        )
        # Another group, so that the group filter has something to leave out.
        admin.create_rollouts([{"rollout_id": f"{group}-other", "group_id": f"{group}-x"}])
        expected = []
        for index, p in enumerate(PLANS):
            rollout_id = f"{group}-{p.name}"
            if p.end != "queuing":
                admin.patch_rollout(rollout_id, "running")
                events = [call(n) for n in p.calls]
                events += [EventIn(type="reward", data={"value": v}) for v in p.rewards]
                if events:
                    admin.post_events(rollout_id, 1, events)
            if p.end in ("succeeded", "failed", "retry"):
                admin.patch_rollout(rollout_id, "failed" if p.end == "retry" else p.end)
            if p.end == "retry":
                admin.patch_rollout(rollout_id, "queuing", attempt=1)
            r = admin.get_rollout(rollout_id)
            summarised = p.end not in ("queuing", "retry")
            expected.append(
                Expected(
                    rollout_id=rollout_id,
                    index=index,
                    status=r.status,
                    mode=p.mode,
                    step=step_rule(p.metadata),
                    attempt=r.attempt,
                    calls=len(p.calls) if summarised else None,
                    tokens=sum(p.calls) if summarised else None,
                    reward=last_number(p.rewards) if summarised else None,
                    duration=None
                    if r.started_at is None or r.ended_at is None
                    else r.ended_at - r.started_at,
                )
            )
    return Planted(group, expected)


def model(planted: Planted, q: SummaryQuery) -> tuple[list[str], int]:
    """The page and the total ``q`` should get: filtered, rows without the sort value
    last, ties in creation order whichever the direction."""
    low = -float("inf") if q.min_reward is None else q.min_reward
    high = float("inf") if q.max_reward is None else q.max_reward
    rows = [
        e
        for e in planted.expected
        if (not q.statuses or e.status in q.statuses)
        and (q.mode is None or e.mode == q.mode)
        and (q.step is None or e.step == q.step)
        and (
            (q.min_reward is None and q.max_reward is None)
            or (e.reward is not None and low <= e.reward <= high)
        )
    ]
    present = [e for e in rows if e.value(q.sort) is not None]
    missing = [e for e in rows if e.value(q.sort) is None]
    present.sort(key=lambda e: e.value(q.sort) or 0.0, reverse=q.descending)  # stable
    ids = [e.rollout_id for e in present + missing]
    return ids[q.offset : q.offset + q.limit], len(ids)


queries = st.builds(
    SummaryQuery,
    statuses=st.frozensets(st.sampled_from(list(Status))),
    mode=st.none() | st.sampled_from(["train", "val"]),
    step=st.none() | st.integers(0, 3),
    min_reward=st.none() | st.sampled_from(REWARD_BOUNDS),
    max_reward=st.none() | st.sampled_from(REWARD_BOUNDS),
    sort=st.sampled_from(list(SortKey)),
    descending=st.booleans(),
    offset=st.integers(0, 14),
    limit=st.integers(0, 14),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(q=queries)
def test_filters_sorts_and_pages_match_a_model(
    planted: Planted, admin: GatewayClient, q: SummaryQuery
) -> None:
    q = replace(q, group_id=planted.group)
    rows, total = admin.summaries(q)
    assert ([r.rollout.rollout_id for r in rows], total) == model(planted, q)


def test_each_item_is_the_rollout_as_an_admin_reads_it_with_its_summary(
    planted: Planted, admin: GatewayClient
) -> None:
    rows, total = admin.summaries(SummaryQuery(group_id=planted.group, limit=100))
    assert total == len(PLANS) and all(isinstance(r, RolloutRow) for r in rows)
    for row, e in zip(rows, planted.expected, strict=True):
        assert row.rollout == admin.get_rollout(e.rollout_id)  # the attempt key too
        assert row.rollout.attempt_key is not None
        if e.calls is None:
            assert row.summary is None
            continue
        assert isinstance(row.summary, Summary)
        assert (row.summary.attempt, row.summary.calls, row.summary.tokens) == (
            e.attempt,
            e.calls,
            e.tokens,
        )
        assert row.summary.reward == e.reward
    by_name = {row.rollout.rollout_id.rsplit("-", 1)[1]: row for row in rows}
    summary = by_name["f"].summary
    assert summary is not None and (summary.rewards, summary.reward) == (1, None)
    summary = by_name["d"].summary
    assert summary is not None and (summary.events, summary.context) == (4, 2 + 4)


def test_pages_with_offset_cover_every_row_once(planted: Planted, admin: GatewayClient) -> None:
    whole = SummaryQuery(group_id=planted.group, sort=SortKey.TOKENS, descending=True, limit=100)
    everything, total = admin.summaries(whole)
    paged: list[str] = []
    while len(paged) < total:
        rows, _ = admin.summaries(replace(whole, offset=len(paged), limit=5))
        paged += [r.rollout.rollout_id for r in rows]
    assert paged == [r.rollout.rollout_id for r in everything]
    rows, counted = admin.summaries(replace(whole, limit=0))
    assert (rows, counted) == ([], total)
    rows, _ = admin.summaries(replace(whole, offset=total))
    assert rows == []


def test_the_async_client_reads_the_same(planted: Planted, gateway: GatewayProcess) -> None:
    async def read() -> tuple[tuple[list[RolloutRow], int], Any]:
        async with AsyncGatewayClient(gateway.url, gateway.token) as client:
            q = SummaryQuery(group_id=planted.group, sort=SortKey.REWARD, limit=100)
            return await client.summaries(q), await client.transitions(f"{planted.group}-k")

    (rows, total), (transitions, complete) = asyncio.run(read())
    with GatewayClient(gateway.url, gateway.token) as admin:
        q = SummaryQuery(group_id=planted.group, sort=SortKey.REWARD, limit=100)
        assert (rows, total) == admin.summaries(q)
        assert (transitions, complete) == admin.transitions(f"{planted.group}-k")


def test_no_query_is_the_first_rows_in_creation_order(
    planted: Planted, admin: GatewayClient
) -> None:
    rows, total = admin.summaries()
    everything, _ = admin.summaries(SummaryQuery(limit=1000))
    assert total >= len(PLANS) + 1 and rows == everything[:50]


# -- bad parameters and keys ------------------------------------------------------------


def get(gateway: GatewayProcess, path: str, token: str | None, **params: Any) -> httpx.Response:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.get(f"{gateway.url}{path}", params=params, headers=headers, timeout=30)


def refused(answer: httpx.Response, status: int) -> str:
    assert answer.status_code == status, answer.text
    return ErrorResponse.model_validate_json(answer.content).error.message


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"status": "done"}, "done"),
        ({"status": "failed,nope"}, "nope"),
        ({"mode": "test"}, "mode"),
        ({"step": "two"}, "step"),
        ({"step": "1.5"}, "step"),
        ({"step": str(2**63)}, "step"),
        ({"min_reward": "nan"}, "min_reward"),
        ({"max_reward": "1e999"}, "max_reward"),
        ({"min_reward": "high"}, "min_reward"),
        ({"sort": "colour"}, "sort"),
        ({"desc": "sometimes"}, "desc"),
        ({"offset": "-1"}, "offset"),
        ({"offset": str(2**63)}, "offset"),
        ({"limit": "1001"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "many"}, "limit"),
    ],
)
def test_a_bad_parameter_is_a_400_that_names_it(
    gateway: GatewayProcess, params: dict[str, str], named: str
) -> None:
    assert named in refused(get(gateway, "/api/summaries", gateway.token, **params), 400)


def test_the_client_raises_the_400(admin: GatewayClient) -> None:
    with pytest.raises(GatewayError) as error:
        admin.summaries(SummaryQuery(limit=5000))
    assert error.value.status == 400 and "limit" in error.value.message


def test_only_the_admin_token_reads_them(
    gateway: GatewayProcess, running: Any, planted: Planted
) -> None:
    r: Rollout = running()
    assert r.attempt_key is not None
    own = f"/api/rollouts/{r.rollout_id}/transitions"
    for path in ("/api/summaries", own):
        assert "admin token" in refused(get(gateway, path, r.attempt_key), 403)
        refused(get(gateway, path, None), 401)
        refused(get(gateway, path, "not-a-key"), 401)
    # Refused before its parameters are read: a key learns nothing from a 400.
    refused(get(gateway, "/api/summaries", r.attempt_key, limit="many"), 403)


def test_the_openapi_document_declares_both_routes(gateway: GatewayProcess) -> None:
    document = httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()
    summaries = document["paths"]["/api/summaries"]["get"]
    names = [p["name"] for p in summaries["parameters"] if p["in"] == "query"]
    assert names == [
        "status",
        "mode",
        "group_id",
        "step",
        "min_reward",
        "max_reward",
        "sort",
        "desc",
        "offset",
        "limit",
    ]
    limit = next(p for p in summaries["parameters"] if p["name"] == "limit")["schema"]
    assert (limit["minimum"], limit["maximum"]) == (0, 1000)
    answer = summaries["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer["required"] == ["total", "items"]
    history = document["paths"]["/api/rollouts/{rollout_id}/transitions"]["get"]
    assert [p["name"] for p in history["parameters"]] == ["rollout_id"]
    for name in ("RolloutRow", "Summary", "Transition", "SortKey"):
        assert name in document["components"]["schemas"]


# -- status history ---------------------------------------------------------------------


def test_transitions_are_every_status_change_in_order(
    planted: Planted, admin: GatewayClient, gateway: GatewayProcess
) -> None:
    transitions, complete = admin.transitions(f"{planted.group}-k")
    assert complete
    assert [(t.attempt, t.status, t.error) for t in transitions] == [
        (1, Status.RUNNING, None),
        (1, Status.FAILED, None),
        (2, Status.QUEUING, None),
    ]
    assert [t.time for t in transitions] == sorted(t.time for t in transitions)
    assert admin.transitions(f"{planted.group}-i") == ([], True)  # created, never moved
    answer = get(gateway, f"/api/rollouts/{planted.group}-k/transitions", gateway.token)
    assert answer.json()["items"][0] == {
        "attempt": 1,
        "status": "running",
        "time": transitions[0].time,
        "error": None,
    }
    assert "does not exist" in refused(
        get(gateway, "/api/rollouts/no-such-rollout/transitions", gateway.token), 404
    )


def test_an_error_is_kept_with_its_change(running: Any, admin: GatewayClient) -> None:
    r: Rollout = running()
    admin.patch_rollout(r.rollout_id, "failed", error="worker died")
    transitions, _ = admin.transitions(r.rollout_id)
    assert [(t.status, t.error) for t in transitions] == [
        (Status.RUNNING, None),
        (Status.FAILED, "worker died"),
    ]


def test_a_store_older_than_its_history_says_so(tmp_path: Path) -> None:
    """A rollout made before the store recorded status changes: its history is not
    complete; one made after is."""
    run_dir = tmp_path / "old"
    with gateway_process(run_dir) as gw, GatewayClient(gw.url, gw.token) as admin:
        admin.create_rollouts([{"rollout_id": "before", "group_id": "g"}])
        admin.patch_rollout("before", "running")
    with sqlite3.connect(run_dir / "gateway.db") as db:  # back to the schema before history
        db.execute("DROP TABLE transitions")
        db.execute("DELETE FROM meta WHERE key = 'history_since'")
    with gateway_process(run_dir) as gw, GatewayClient(gw.url, gw.token) as admin:
        assert admin.transitions("before") == ([], False)
        admin.patch_rollout("before", "succeeded")
        transitions, complete = admin.transitions("before")
        assert [t.status for t in transitions] == [Status.SUCCEEDED] and not complete
        admin.create_rollouts([{"rollout_id": "after", "group_id": "g"}])
        assert admin.transitions("after") == ([], True)
