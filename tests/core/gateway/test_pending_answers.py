"""Pending answers in the store: what a gateway that died before sending leaves for the
next one (see agl.core.gateway.proxy); the claiming order on every store kind."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agl.core.contracts.queries import EventQuery
from agl.core.contracts.records import EventIn, RolloutSpec, Status, StatusPatch
from agl.core.gateway.store.base import PendingAnswer, Store
from agl.core.gateway.store.sqlite import SqliteStore
from tests.core.gateway.conftest import OpenStore

HASH = b"h" * 32


def call(answer_id: str) -> list[EventIn]:
    return [EventIn(event_id=answer_id, type="model_request", data={"response": answer_id})]


async def running(store: Store, rollout_id: str = "r") -> None:
    await store.create_rollouts([RolloutSpec(rollout_id=rollout_id)], now=0.0)
    await store.patch_rollout(rollout_id, StatusPatch(status=Status.RUNNING), now=0.0)


async def record(store: Store, answer_id: str, boot: str, request_hash: bytes = HASH) -> None:
    pending = PendingAnswer(answer_id, request_hash, boot, f"body {answer_id}".encode(), False)
    await store.append_events("r", 1, call(answer_id), 1.0, pending=pending)


def test_only_another_process_claims_and_the_oldest_first(any_store: OpenStore) -> None:
    async def scenario() -> None:
        async with any_store() as store:
            await claims(store)

    async def claims(store: Store) -> None:
        await running(store)
        await record(store, "a1", boot="A")
        await record(store, "a2", boot="A")
        await record(store, "other", boot="A", request_hash=b"o" * 32)
        assert await store.claim_answer("r", 1, HASH, "A") is None  # its own: a new call
        first = await store.claim_answer("r", 1, HASH, "B")
        assert first == PendingAnswer("a1", HASH, "B", b"body a1", False)
        second = await store.claim_answer("r", 1, HASH, "B")
        assert second is not None and second.answer_id == "a2"
        assert await store.claim_answer("r", 1, HASH, "B") is None
        # B died before sending a1 again: C gets it; once delivered, nobody does.
        again = await store.claim_answer("r", 1, HASH, "C")
        assert again is not None and again.answer_id == "a1"
        await store.answer_delivered("r", 1, "a1")
        assert await store.claim_answer("r", 1, HASH, "D") is not None  # a2, still pending
        assert await store.claim_answer("r", 1, HASH, "E") is not None
        await store.answer_delivered("r", 1, "a2")
        assert await store.claim_answer("r", 1, HASH, "F") is None
        assert await store.claim_answer("r", 2, b"o" * 32, "F") is None  # another attempt
        events = await store.list_events("r", EventQuery())
        assert [e.event_id for e in events] == ["a1", "a2", "other"]  # claims append nothing

    asyncio.run(scenario())


def test_a_pending_answer_survives_a_reopen_and_goes_when_the_rollout_stops(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        store = SqliteStore(tmp_path / "g.db")
        await running(store)
        await record(store, "a1", boot="A")
        await store.close()  # what a kill -9 after the commit leaves: the file

        store = SqliteStore(tmp_path / "g.db")
        claimed = await store.claim_answer("r", 1, HASH, "B")
        assert claimed is not None and claimed.body == b"body a1"
        await store.patch_rollout("r", StatusPatch(status=Status.SUCCEEDED), now=2.0)
        assert await store.claim_answer("r", 1, HASH, "C") is None
        rows = store._db.execute("SELECT count(*) FROM pending_answers").fetchone()
        assert rows == (0,)
        await store.close()

    asyncio.run(scenario())
