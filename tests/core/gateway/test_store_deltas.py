"""Prompts stored by what they add, through the store: any history appended with the
reference rule's bases reads back exactly as sent, page by page, with the summaries of
the same history stored whole; a bad base stores nothing; acknowledged calls survive
kill -9; an extending rollout costs at most 20 bytes per distinct token; stores made
before bases read as they did."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl.core.contracts.queries import EventQuery
from agl.core.contracts.records import Event, EventIn, RolloutSpec
from agl.core.gateway.store import Store
from agl.core.gateway.store.base import PendingAnswer
from agl.core.gateway.store.prompt_delta import PromptBase
from agl.core.gateway.store.sqlite import SqliteStore
from tests.core.gateway.conftest import OpenStore
from tests.helpers.call_histories import (
    ATTEMPTS,
    Batch,
    Step,
    coding_calls,
    coding_rollout,
    histories,
    reference_base,
)

ROOT = Path(__file__).resolve().parents[3]


def _exactly(a: Any, b: Any) -> bool:
    return bool(a == b) and orjson.dumps(a) == orjson.dumps(b)


async def _replay(store: Store, rollout_id: str, steps: list[Step], bases: bool) -> list[Event]:
    """Append ``steps`` as the proxy would (``bases``: with the reference rule's);
    check each answer; return the events as sent, in order, with their sequences."""
    await store.create_rollouts([RolloutSpec(rollout_id=rollout_id)], now=0.0)
    calls: dict[int, list[tuple[int, dict[str, Any]]]] = {a: [] for a in ATTEMPTS}
    answers: dict[tuple[int, str], Event] = {}
    wholes: dict[tuple[int, str], Any] = {}  # each known id's data as sent (whole)
    sent: list[Event] = []
    for now, step in enumerate(steps):
        batch = step if isinstance(step, Batch) else step.batch
        earlier = list(calls[batch.attempt])  # a call's choices: not each other's bases
        given_events, given_bases = [], []
        for e in batch.events:
            encoded = None
            if bases and e.type == "model_request":
                encoded = reference_base(e.data, earlier)
            data, base = encoded if encoded else (e.data, None)
            given_events.append(EventIn(event_id=e.event_id, type=e.type, data=data))
            given_bases.append(base)
        answered = await store.append_events(
            rollout_id, batch.attempt, given_events, float(now), bases=given_bases
        )
        for e, given_event, answer in zip(batch.events, given_events, answered, strict=True):
            key = (batch.attempt, str(e.event_id))
            if key in answers:  # known: answered as first stored, whole (as a read)
                first = answers[key]
                assert answer.model_copy(update={"data": None}) == first.model_copy(
                    update={"data": None}
                )
                assert _exactly(answer.data, wholes[key])
                continue
            assert answer.event_id == e.event_id and _exactly(answer.data, given_event.data)
            answers[key], wholes[key] = answer, e.data
            sent.append(answer.model_copy(update={"data": e.data}))
            if e.type == "model_request":
                calls[batch.attempt].append((answer.sequence, e.data))
    return sent


async def _pages(store: Store, rollout_id: str, query: EventQuery) -> list[Event]:
    out: list[Event] = []
    while page := await store.list_events(
        rollout_id,
        EventQuery(query.attempt, query.type, out[-1].sequence if out else 0, query.limit),
    ):
        out.extend(page)
    return out


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=histories(), data=st.data())
def test_any_history_reads_back_as_sent(
    any_store: OpenStore, steps: list[Step], data: st.DataObject
) -> None:
    async def scenario() -> None:
        based, whole = f"based-{uuid.uuid4().hex}", f"whole-{uuid.uuid4().hex}"
        async with any_store() as store:
            sent = await _replay(store, based, steps, bases=True)
            await _replay(store, whole, steps, bases=False)
            for attempt, type_ in itertools.product(
                (None, *ATTEMPTS), (None, "model_request", "reward")
            ):
                limit = data.draw(st.integers(1, 4), label=f"limit of {attempt} {type_}")
                read = await _pages(store, based, EventQuery(attempt, type_, 0, limit))
                want = [e for e in sent if attempt in (None, e.attempt) and type_ in (None, e.type)]
                assert [e.sequence for e in read] == [e.sequence for e in want]
                for got, expected in zip(read, want, strict=True):
                    assert got.model_dump(exclude={"data"}) == expected.model_dump(exclude={"data"})
                    assert _exactly(got.data, expected.data)
            assert await store.summaries(based) == await store.summaries(whole)

    asyncio.run(scenario())


def _call(ids: list[int], answer: list[int], **data: Any) -> EventIn:
    return EventIn(
        event_id=uuid.uuid4().hex,
        type="model_request",
        data={"prompt_ids": ids, "response_ids": answer, **data},
    )


@pytest.mark.parametrize(
    "bad",
    [
        "no such event",
        "a reward",
        "another rollout",
        "another attempt",
        "not a call",
        "no prompt ids",
        "input kept, none given",
        "negative",
        "one base short",
    ],
)
def test_a_bad_base_stores_nothing(any_store: OpenStore, bad: str) -> None:
    async def scenario() -> None:
        async with any_store() as store:
            await store.create_rollouts([RolloutSpec(rollout_id=r) for r in ("r", "o")], 0.0)
            (call,) = await store.append_events("r", 1, [_call([1], [2], prompt="p")], 1.0)
            (reward,) = await store.append_events(
                "r", 1, [EventIn(type="reward", data={"value": 1})], 1.0
            )
            (other,) = await store.append_events("o", 1, [_call([1], [2])], 1.0)
            (second,) = await store.append_events("r", 2, [_call([1], [2])], 1.0)
            base = PromptBase(call.sequence, 2, 0)
            event, bases = _call([3], [4]), [base]
            if bad == "no such event":
                bases = [PromptBase(second.sequence + 100, 2, 0)]
            elif bad == "a reward":
                bases = [PromptBase(reward.sequence, 0, 0)]
            elif bad == "another rollout":
                bases = [PromptBase(other.sequence, 2, 0)]
            elif bad == "another attempt":
                bases = [PromptBase(second.sequence, 2, 0)]
            elif bad == "not a call":
                event = EventIn(type="log", data={"prompt_ids": [3]})
            elif bad == "no prompt ids":
                event = EventIn(type="model_request", data={"response_ids": [4]})
            elif bad == "input kept, none given":
                bases = [PromptBase(call.sequence, 2, 1)]
            elif bad == "negative":
                bases = [PromptBase(call.sequence, -1, 0)]
            else:
                bases = []
            events_before = await store.list_events("r", EventQuery())
            summaries_before = await store.summaries("r")
            pending = PendingAnswer(uuid.uuid4().hex, b"h" * 32, "A", b"answer", False)
            good = _call([5], [6])  # a good base beside the bad one: not stored either
            with pytest.raises(ValueError):
                await store.append_events(
                    "r", 1, [good, event], 2.0, pending=pending, bases=[base, *bases]
                )
            assert await store.list_events("r", EventQuery()) == events_before
            assert await store.summaries("r") == summaries_before
            assert await store.claim_answer("r", 1, b"h" * 32, "B") is None
            # The same call with its right base goes in.
            stored = await store.append_events("r", 1, [good], 3.0, bases=[base])
            (read,) = await store.list_events("r", EventQuery(after=stored[0].sequence - 1))
            assert read.data == {"prompt_ids": [1, 2, 5], "response_ids": [6]}

    asyncio.run(scenario())


def test_a_store_made_before_bases_reads_as_it_did(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    calls = coding_rollout(calls=3, first=20, last=200, response=5)

    async def before() -> None:
        store = SqliteStore(path)
        await store.create_rollouts([RolloutSpec(rollout_id="r")], 0.0)
        events = [
            EventIn(event_id=f"c{i}", type="model_request", data=c) for i, c in enumerate(calls)
        ]
        await store.append_events("r", 1, events[:2], 1.0)
        await store.close()

    asyncio.run(before())
    with sqlite3.connect(path) as db:  # the events table as it was before the columns
        for column in ("prompt_base", "keep_ids", "keep_input"):
            db.execute(f"ALTER TABLE events DROP COLUMN {column}")
    db.close()

    async def after() -> None:
        store = SqliteStore(path)
        old = await store.list_events("r", EventQuery())
        assert [e.data for e in old] == calls[:2]
        encoded = reference_base(calls[2], [(e.sequence, e.data) for e in old])
        assert encoded is not None
        tails, base = encoded
        await store.append_events(
            "r", 1, [EventIn(event_id="c2", type="model_request", data=tails)], 2.0, bases=[base]
        )
        assert [e.data for e in await store.list_events("r", EventQuery())] == calls
        (summary,) = await store.summaries("r")
        assert summary.context == len(calls[2]["prompt_ids"]) + len(calls[2]["response_ids"])
        await store.close()

    asyncio.run(after())


# The child: appends an extending rollout with the reference rule's bases and prints each
# call's id once the store has acknowledged it; after CALLS calls it waits to be killed,
# so the kill always finds it alive, and all but always mid-way.
CALLS = 500
_CHILD = f"""
import asyncio, signal, sys
from itertools import islice
from pathlib import Path
from agl.core.contracts.records import EventIn, RolloutSpec
from agl.core.gateway.store.sqlite import SqliteStore
from tests.helpers.call_histories import coding_calls, reference_base

async def main(path):
    store = SqliteStore(Path(path))
    await store.create_rollouts([RolloutSpec(rollout_id="r")], 0.0)
    earlier = []
    for i, data in enumerate(islice(coding_calls(first=100, added=40, response=10), {CALLS})):
        tails, base = reference_base(data, earlier) or (data, None)
        event = EventIn(event_id=f"c{{i}}", type="model_request", data=tails)
        (stored,) = await store.append_events("r", 1, [event], 1.0, bases=[base])
        earlier = [(stored.sequence, data)]
        print(stored.event_id, flush=True)

asyncio.run(main(sys.argv[1]))
signal.pause()
"""


def test_acknowledged_calls_survive_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "g.db"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    try:
        acked = [child.stdout.readline() for _ in range(30)]
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    acked += [line + "\n" for line in child.stdout.read().split("\n")[:-1]]  # whole lines
    assert all(line.endswith("\n") for line in acked), "the child died before 30 calls"
    acked_ids = [line.strip() for line in acked]

    async def reopened() -> None:
        store = SqliteStore(path)
        events = await store.list_events("r", EventQuery())
        ids = [e.event_id for e in events]
        assert ids[: len(acked_ids)] == acked_ids == [f"c{i}" for i in range(len(acked_ids))]
        sent = itertools.islice(coding_calls(first=100, added=40, response=10), len(events))
        for event, data in zip(events, sent, strict=True):
            assert _exactly(event.data, data)
        (summary,) = await store.summaries("r")
        assert summary.calls == len(events)
        last = events[-1].data
        assert summary.context == len(last["prompt_ids"]) + len(last["response_ids"])
        await store.close()

    asyncio.run(reopened())


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(f"{path.name}*"))


def test_an_extending_rollout_costs_at_most_20_bytes_per_distinct_token(tmp_path: Path) -> None:
    """30 calls of a coding agent, prompts from 1k to ~30k tokens, answers of 200 with
    logprobs: the file grows by what the rollout adds, not by its calls times its
    context (stored whole, this rollout costs ~170 bytes per distinct token)."""
    path = tmp_path / "g.db"
    calls = coding_rollout(calls=30, first=1_000, last=30_000, response=200)
    distinct = len(calls[-1]["prompt_ids"]) + len(calls[-1]["response_ids"])

    async def scenario() -> int:
        store = SqliteStore(path)
        await store.create_rollouts([RolloutSpec(rollout_id="r")], 0.0)
        await store.close()  # the file of an empty store, checkpointed
        empty = _size(path)
        store = SqliteStore(path)
        earlier: list[tuple[int, dict[str, Any]]] = []
        for i, data in enumerate(calls):
            encoded = reference_base(data, earlier)
            assert (encoded is None) == (i == 0)  # every call after the first extends
            tails, base = encoded if encoded else (data, None)
            event = EventIn(event_id=f"c{i}", type="model_request", data=tails)
            (stored,) = await store.append_events("r", 1, [event], 1.0, bases=[base])
            earlier.append((stored.sequence, data))
        await store.close()
        grown = _size(path) - empty
        store = SqliteStore(path)
        assert [e.data for e in await store.list_events("r", EventQuery())] == calls
        await store.close()
        return grown

    grown = asyncio.run(scenario())
    print(f"{grown / distinct:.1f} bytes per distinct token ({grown} for {distinct})")
    assert grown <= 20 * distinct
