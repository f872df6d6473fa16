"""The store contract on every store kind (``any_store``: SQLite and a real PostgreSQL
server), and what only a store shared by several processes must do: concurrent status
changes and sweeps, race-free first writes, the replica registry, answers held by a
live replica, one rate-limit bucket per attempt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg
import pytest

from agl.core.contracts.queries import EventQuery, RolloutQuery, SortKey, SummaryQuery
from agl.core.contracts.records import EventIn, ModelEndpoint, RolloutSpec, Status, StatusPatch
from agl.core.gateway.admission import AdmissionGate
from agl.core.gateway.proxy import RecordingProxy
from agl.core.gateway.replicas import ReplicaGroup
from agl.core.gateway.store import open_store
from agl.core.gateway.store.base import PendingAnswer, Replica, SharedStore, Store
from agl.core.gateway.store.lifecycle import IllegalTransition
from agl.core.gateway.store.postgresql import PostgresStore, connection_options
from agl.core.gateway.upstream import RetryPolicy, Upstream
from agl.testing.postgres import PASSWORD, PostgresServer
from tests.core.gateway.conftest import OpenStore

HASH = b"h" * 32


async def running(store: Store, rollout_id: str = "r", **spec: object) -> None:
    await store.create_rollouts([RolloutSpec(rollout_id=rollout_id, **spec)], now=0.0)  # type: ignore[arg-type]
    await store.patch_rollout(rollout_id, StatusPatch(status=Status.RUNNING), now=1.0)


async def record(store: Store, answer_id: str, boot: str, request_hash: bytes = HASH) -> None:
    pending = PendingAnswer(answer_id, request_hash, boot, f"body {answer_id}".encode(), False)
    events = [EventIn(event_id=answer_id, type="model_request", data={"response": answer_id})]
    await store.append_events("r", 1, events, 1.0, pending=pending)


def test_rollouts_go_through_their_states_with_history_and_summaries(any_store: OpenStore) -> None:
    async def scenario() -> None:
        async with any_store() as store:
            specs = [
                RolloutSpec(rollout_id=f"r{i}", group_id="g", metadata={"step": i % 2})
                for i in range(5)
            ]
            first = await store.create_rollouts(specs, now=1.0)
            again = await store.create_rollouts([specs[0], RolloutSpec(rollout_id="new")], 2.0)
            assert [r.rollout_id for r in first] == [f"r{i}" for i in range(5)]
            assert again[0] == first[0] and again[1].created_at == 2.0
            page, cursor = await store.list_rollouts(RolloutQuery(limit=4))
            rest, end = await store.list_rollouts(RolloutQuery(after=cursor or 0, limit=4))
            assert [r.rollout_id for r in page + rest] == [*(s.rollout_id for s in specs), "new"]
            assert end is None

            await store.patch_rollout("r1", StatusPatch(status=Status.RUNNING), 3.0)
            with pytest.raises(IllegalTransition):
                await store.patch_rollout("r1", StatusPatch(status=Status.QUEUING), 4.0)
            await store.append_events(
                "r1",
                1,
                [
                    EventIn(type="model_request", data={"prompt_ids": [1, 2], "response_ids": [3]}),
                    EventIn(type="model_request_failed", data={"status": 502}),
                    EventIn(type="reward", data={"value": 0.25}),
                    EventIn(type="reward", data={"value": 0.75}),
                ],
                5.0,
            )
            done = await store.patch_rollout("r1", StatusPatch(status=Status.SUCCEEDED), 6.0)
            assert (done.status, done.version, done.ended_at) == (Status.SUCCEEDED, 3, 6.0)
            assert [(t.status, t.time) for t in await store.transitions("r1")] == [
                (Status.RUNNING, 3.0),
                (Status.SUCCEEDED, 6.0),
            ]
            (summary,) = await store.summaries("r1")
            assert (summary.events, summary.calls, summary.failed_calls) == (4, 1, 1)
            assert (summary.tokens, summary.context, summary.rewards) == (1, 3, 2)
            assert (summary.reward, summary.last_event_at) == (0.75, 5.0)

            rows, total = await store.query_rollouts(
                SummaryQuery(step=1, sort=SortKey.REWARD, descending=True)
            )
            assert total == 2 and [row.rollout.rollout_id for row in rows] == ["r1", "r3"]
            assert rows[0].summary == summary and rows[1].summary is None

    asyncio.run(scenario())


def test_events_are_stored_once_by_id(any_store: OpenStore) -> None:
    async def scenario() -> None:
        async with any_store() as store:
            await running(store)
            step = EventIn(event_id="s", type="step", data={"n": 1})
            (first,) = await store.append_events("r", 1, [step], 1.0)
            twice = await store.append_events(
                "r", 1, [EventIn(event_id="s", type="other", data=2), step], 2.0
            )
            assert twice == [first, first]
            assert [e.event_id for e in await store.list_events("r", EventQuery())] == ["s"]
            (summary,) = await store.summaries("r")
            assert summary.events == 1

    asyncio.run(scenario())


def test_models_and_meta(any_store: OpenStore) -> None:
    async def scenario() -> None:
        async with any_store() as store:
            m = "http://e{}/v1"
            await store.put_models([ModelEndpoint(model="p", endpoint=m.format(1))])
            await store.put_models(
                [
                    ModelEndpoint(model="p", endpoint=m.format(1), policy_version=2),
                    ModelEndpoint(model="q", endpoint=m.format(2)),
                ]
            )
            assert [(e.model, e.policy_version) for e in await store.list_models()] == [
                ("p", 2),
                ("q", 0),
            ]
            assert await store.delete_models("q") == 1 and await store.delete_models(None) == 1
            assert await store.list_models() == []
            await store.set_meta("k", "1")
            await store.set_meta("k", "2")
            assert await store.get_meta("k") == "2" and await store.get_meta("none") is None
            assert await store.set_meta_once("once", "a") == "a"
            assert await store.set_meta_once("once", "b") == "a"

    asyncio.run(scenario())


# -- what a store shared by several processes must do --------------------------------


@pytest.fixture
def postgresql(postgres: PostgresServer, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AGL_STORE_PASSWORD", PASSWORD)
    return postgres.create_database()


@asynccontextmanager
async def shared(url: str, lease_s: float = 5.0) -> AsyncIterator[SharedStore]:
    store = open_store(url, lease_s=lease_s)
    assert isinstance(store, SharedStore)
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


def test_two_processes_changing_one_rollout_take_turns(postgresql: str) -> None:
    async def scenario() -> None:
        async with shared(postgresql) as one, shared(postgresql) as two:
            ids = [f"r{i}" for i in range(20)]
            await one.create_rollouts([RolloutSpec(rollout_id=i) for i in ids], 0.0)
            for i in ids:
                await one.patch_rollout(i, StatusPatch(status=Status.RUNNING), 1.0)
            ends = (Status.SUCCEEDED, Status.FAILED)
            outcomes = await asyncio.gather(
                *(
                    store.patch_rollout(i, StatusPatch(status=end), 2.0)
                    for i in ids
                    for store, end in zip((one, two), ends, strict=True)
                ),
                return_exceptions=True,
            )
            for i, pair in zip(ids, zip(outcomes[::2], outcomes[1::2], strict=True), strict=True):
                lost = [o for o in pair if isinstance(o, IllegalTransition)]
                won = [o for o in pair if not isinstance(o, BaseException)]
                assert len(lost) == 1 and len(won) == 1, (i, pair)
                assert won[0].version == 3
                assert len(await one.transitions(i)) == 2

    asyncio.run(scenario())


def test_processes_making_the_secret_at_once_agree_on_one(postgresql: str) -> None:
    async def scenario() -> None:
        async with shared(postgresql) as one, shared(postgresql) as two:
            made = await asyncio.gather(
                *(s.set_meta_once("secret", str(i)) for i, s in enumerate([one, two] * 4))
            )
            assert len(set(made)) == 1

    asyncio.run(scenario())


def test_timeout_sweeps_of_two_processes_fail_each_rollout_once(postgresql: str) -> None:
    async def scenario() -> None:
        async with shared(postgresql) as one, shared(postgresql) as two:
            ids = [f"r{i}" for i in range(30)]
            await one.create_rollouts([RolloutSpec(rollout_id=i, timeout_s=1.0) for i in ids], 0)
            for i in ids:
                await one.patch_rollout(i, StatusPatch(status=Status.RUNNING), 1.0)
            swept = await asyncio.gather(
                *(s.expire_running(5.0, "timed out") for s in (one, two, one, two))
            )
            expired = [r.rollout_id for batch in swept for r in batch]
            assert sorted(expired) == sorted(ids)
            for i in ids:
                assert [t.status for t in await two.transitions(i)] == [
                    Status.RUNNING,
                    Status.FAILED,
                ]

    asyncio.run(scenario())


def test_an_answer_a_live_process_holds_is_waited_for(postgresql: str) -> None:
    async def scenario() -> None:
        async with shared(postgresql, lease_s=1.0) as a, shared(postgresql, lease_s=1.0) as b:
            await running(a)
            await a.heartbeat(Replica("A", 1, 0, 0))
            await record(a, "sent", boot="A")
            # A delivers while B waits: B's request is then a new call.
            waiting = asyncio.create_task(b.claim_answer("r", 1, HASH, "B"))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await a.answer_delivered("r", 1, "sent")
            assert await waiting is None
            # A records again and goes silent: once its lease is over, B claims the answer.
            await a.heartbeat(Replica("A", 1, 0, 0))
            await record(a, "lost", boot="A")
            claimed = await b.claim_answer("r", 1, HASH, "B")
            assert claimed is not None and claimed.answer_id == "lost"
            assert [r.boot for r in await b.live_replicas()] == []
            # A process that left holds nothing either.
            await b.heartbeat(Replica("B", 0, 0, 0))
            await b.leave("B")
            assert await a.claim_answer("r", 1, HASH, "A2") is not None

    asyncio.run(scenario())


def test_the_admission_state_and_registry_are_shared(postgresql: str) -> None:
    async def scenario() -> None:
        async with shared(postgresql) as a, shared(postgresql) as b:
            woken = asyncio.Event()
            await b.watch(woken.set)
            state = await a.heartbeat(Replica("A", 2, 1, 0))
            assert (state.admission, state.generation) == ("running", 0)
            paused = await a.set_admission("paused")
            await asyncio.wait_for(woken.wait(), 10)  # NOTIFY reached the other process
            assert (paused.admission, paused.generation) == ("paused", 1)
            assert await b.shared_state() == paused
            woken.clear()
            await b.put_models([ModelEndpoint(model="p", endpoint="http://e/v1")])
            await asyncio.wait_for(woken.wait(), 10)
            assert (await a.shared_state()).models == paused.models + 1
            await b.heartbeat(Replica("B", 0, 3, 1))
            assert await a.live_replicas() == [Replica("A", 2, 1, 0), Replica("B", 0, 3, 1)]

    asyncio.run(scenario())


def test_one_bucket_per_attempt_across_processes(postgresql: str) -> None:
    async def scenario() -> None:
        async with shared(postgresql) as a, shared(postgresql) as b:
            key, rate, burst = ("r", 1), 0.001, 4.0
            waits = [await s.take_token(key, rate, burst) for s in (a, b, a, b, a, b)]
            assert waits[:4] == [0.0] * 4 and all(w > 900 for w in waits[4:])
            assert await a.take_token(("r", 2), rate, burst) == 0.0  # another attempt
            await b.charge_tokens(("r", 2), rate, burst, 10)  # an event batch, into debt
            assert await a.take_token(("r", 2), rate, burst) > (10 - 3) / rate

    asyncio.run(scenario())


def test_the_password_never_comes_in_the_url(postgres: PostgresServer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="password"):
        connection_options(f"postgresql://agl:{PASSWORD}@127.0.0.1:5432/db")
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")  # as a mounted Secret may end

    url = postgres.create_database()

    async def scenario() -> None:
        store = PostgresStore(url, password_file=str(secret))
        await store.connect()
        assert await store.get_meta("none") is None
        await store.close()

    asyncio.run(scenario())


def test_a_gate_past_its_renewal_holds_calls_until_renewed() -> None:
    async def scenario() -> None:
        gate = AdmissionGate()
        loop = asyncio.get_running_loop()
        gate.renew(loop.time() - 1)  # a replica whose last beat is older than its lease
        held = asyncio.create_task(gate.enter())
        await asyncio.sleep(0.05)
        assert not held.done() and gate.waiting == 1 and gate.in_flight == 0
        gate.renew(loop.time() + 3600)
        (await asyncio.wait_for(held, 10)).release()
        assert gate.waiting == 0 and gate.in_flight == 0

    asyncio.run(scenario())


def test_a_replica_admits_only_within_its_lease_since_its_last_beat(postgresql: str) -> None:
    """A replica that stalled long enough for the others to count it dead (and a pause
    to drain without it) must not admit a call before it has beaten again."""

    async def scenario() -> None:
        async with shared(postgresql) as store:
            proxy = RecordingProxy(
                store, Upstream(RetryPolicy(0, 0.1), 10.0, None), AdmissionGate()
            )
            group = ReplicaGroup(store, proxy, heartbeat_s=1.0, lease_s=5.0)
            loop = asyncio.get_running_loop()
            before = loop.time()
            await group.beat()
            after = loop.time()
            until = proxy.gate.valid_until
            assert until is not None and before + 4.0 <= until <= after + 4.0
            (await asyncio.wait_for(proxy.gate.enter(), 10)).release()

    asyncio.run(scenario())


def test_a_heartbeat_deletes_the_buckets_that_refilled(postgresql: str) -> None:
    """A bucket back at its burst is the same as none: the table keeps only the
    attempts still paying for their calls, not one row for every attempt ever."""

    async def scenario() -> None:
        async with shared(postgresql) as store:
            await store.take_token(("refills at once", 1), 1e9, 4.0)
            await store.take_token(("still owing", 1), 0.001, 4.0)
            await store.charge_tokens(("in debt", 1), 1e-6, 4.0, 10)
            await asyncio.sleep(0.01)  # the first is full again after a nanosecond
            await store.heartbeat(Replica("A", 0, 0, 0))
            connection = await asyncpg.connect(postgresql, password=PASSWORD)
            try:
                rows = await connection.fetch("SELECT rollout_id FROM rate_buckets")
            finally:
                await connection.close()
            assert sorted(r["rollout_id"] for r in rows) == ["in debt", "still owing"]
            assert await store.take_token(("refills at once", 1), 1e9, 4.0) == 0.0

    asyncio.run(scenario())
