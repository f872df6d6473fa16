"""The events a finished run's gateway stored, read through its store as the API reads
them: a call stored by what it adds to an earlier one (agl/core/gateway/store/
prompt_delta.py) comes back whole, which a raw read of the file would not give."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agl.core.contracts.queries import EventQuery
from agl.core.contracts.records import Event
from agl.core.gateway.store import SqliteStore


def stored_events(db: Path, type: str | None = None) -> list[Event]:
    """Every event in ``db`` (of ``type``, if given), rollout by rollout in the order
    the rollouts first recorded one, each rollout's in sequence order."""

    async def read() -> list[Event]:
        store = SqliteStore(db)
        try:
            rows = store._db.execute(
                "SELECT rollout_id FROM events GROUP BY rollout_id ORDER BY MIN(seq)"
            ).fetchall()
            found: list[Event] = []
            for (rollout_id,) in rows:
                after = 0
                while page := await store.list_events(
                    rollout_id, EventQuery(after=after, type=type)
                ):
                    found += page
                    after = page[-1].sequence
            return found
        finally:
            await store.close()

    return asyncio.run(read())
