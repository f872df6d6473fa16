"""The shared store: PostgreSQL, for several gateway processes (replicas) serving the
same rollouts. The schema is SQLite's (``agl.core.gateway.store.sqlite``) in PostgreSQL's
types, plus the replica registry and the per-attempt rate-limit buckets.

Invariants, beside the :class:`~agl.core.gateway.store.base.Store` contract:
- every write is one transaction committed with ``synchronous_commit=on`` before the
  coroutine returns: a replica killed after acknowledging loses nothing;
- the hot writes are one statement each (one round trip): appending a call's events
  with its pending answer and its summary, delivering it, a rate-limit token;
- events of one rollout are appended under a transaction-scoped advisory lock of the
  rollout, and rollouts are created under one lock, so sequence order is commit order:
  a reader paging by sequence (``after``, a cursor) never skips a row that commits
  later with a smaller sequence;
- status changes read the row ``FOR UPDATE`` in their transaction; the timeout sweep
  skips rows another replica's sweep holds (``SKIP LOCKED``), so sweeps may overlap;
- inserts by caller-chosen ids are ``ON CONFLICT DO NOTHING``: the same rollout or event
  sent to two replicas at once is stored once;
- liveness, rate-limit refills and timeouts of the registry use the database's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import asyncpg
import orjson

from agl.core.contracts.queries import (
    EventQuery,
    RolloutQuery,
    RolloutRow,
    Summary,
    SummaryQuery,
    Transition,
)
from agl.core.contracts.records import (
    Event,
    EventIn,
    ModelEndpoint,
    Rollout,
    RolloutSpec,
    Status,
    StatusPatch,
)
from agl.core.gateway.store.base import (
    ADMISSION_GENERATION,
    ADMISSION_META,
    MODELS_GENERATION,
    NotFound,
    PendingAnswer,
    Replica,
    SharedState,
    SharedStore,
)
from agl.core.gateway.store.lifecycle import IllegalTransition, apply_patch
from agl.core.gateway.store.prompt_delta import PromptBase, StoredCall, check_tails, resolve
from agl.core.gateway.store.rows import (
    ROLLOUT_COLUMNS,
    SORT_KEYS,
    SUMMARY_COLUMNS,
    Figures,
    event_from_row,
    figures,
    rollout_from_row,
)

# The channel a change of the shared state is announced on.
CHANNEL = "agl_shared"
# Advisory locks: the schema's creation, rollouts' creation, a rollout's event appends.
_SCHEMA_LOCK, _EVENTS_LOCK, _ROLLOUTS_LOCK = 4601, 4602, 4603
# How often claim_answer looks again while a live replica holds the answer.
_CLAIM_POLL_S = 0.05

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    rollout_id TEXT NOT NULL UNIQUE,
    group_id TEXT NOT NULL,
    mode TEXT NOT NULL,
    status TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    version INTEGER NOT NULL,
    max_attempts INTEGER NOT NULL,
    timeout_s DOUBLE PRECISION,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    ended_at DOUBLE PRECISION,
    error TEXT,
    input BYTEA NOT NULL,
    metadata BYTEA NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_by_status ON rollouts (status, seq);
CREATE INDEX IF NOT EXISTS rollouts_by_group ON rollouts (group_id, seq);
CREATE TABLE IF NOT EXISTS events (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    event_id TEXT NOT NULL,
    type TEXT NOT NULL,
    data BYTEA NOT NULL,
    time DOUBLE PRECISION NOT NULL,
    prompt_base BIGINT,
    keep_ids INTEGER,
    keep_input INTEGER,
    UNIQUE (rollout_id, attempt, event_id)
);
CREATE INDEX IF NOT EXISTS events_by_rollout ON events (rollout_id, seq);
CREATE TABLE IF NOT EXISTS models (
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    PRIMARY KEY (model, endpoint)
);
CREATE TABLE IF NOT EXISTS pending_answers (
    seq BIGINT GENERATED ALWAYS AS IDENTITY,
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    answer_id TEXT NOT NULL,
    request_hash BYTEA NOT NULL,
    boot TEXT NOT NULL,
    body BYTEA NOT NULL,
    stream BOOLEAN NOT NULL,
    PRIMARY KEY (rollout_id, attempt, answer_id)
);
CREATE INDEX IF NOT EXISTS pending_by_request
    ON pending_answers (rollout_id, attempt, request_hash);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS attempt_summaries (
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    events INTEGER NOT NULL,
    calls INTEGER NOT NULL,
    failed_calls INTEGER NOT NULL,
    tokens BIGINT NOT NULL,
    context BIGINT NOT NULL,
    rewards INTEGER NOT NULL,
    reward DOUBLE PRECISION,
    last_event_at DOUBLE PRECISION,
    PRIMARY KEY (rollout_id, attempt)
);
CREATE TABLE IF NOT EXISTS transitions (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    status TEXT NOT NULL,
    time DOUBLE PRECISION NOT NULL,
    error TEXT
);
CREATE INDEX IF NOT EXISTS transitions_by_rollout ON transitions (rollout_id, seq);
CREATE OR REPLACE FUNCTION agl_refuse(message TEXT) RETURNS BOOLEAN LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%', message;
END $$;
CREATE TABLE IF NOT EXISTS replicas (
    boot TEXT PRIMARY KEY,
    heard_at TIMESTAMPTZ NOT NULL,
    in_flight INTEGER NOT NULL,
    waiting INTEGER NOT NULL,
    applied BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS rate_buckets (
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    tokens DOUBLE PRECISION NOT NULL,
    at DOUBLE PRECISION NOT NULL,
    admitted BOOLEAN NOT NULL,
    -- When the bucket holds its whole burst again: from then on it is the same as no
    -- bucket, and the heartbeats delete it, so the table follows the active attempts.
    full_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (rollout_id, attempt)
);
CREATE INDEX IF NOT EXISTS rate_buckets_by_full_at ON rate_buckets (full_at);
"""

_EVENT_COLUMNS = (
    "rollout_id, attempt, event_id, seq, type, data, time, prompt_base, keep_ids, keep_input"
)
# One statement: the rollout's append lock, the pending answer, the new events (in the
# given order, known ids skipped) and what they add to the attempt's summary. $9..$15
# are each distinct id's summary figures, computed by the caller from what it sends.
_APPEND = f"""
WITH lock AS (SELECT pg_advisory_xact_lock({_EVENTS_LOCK}, hashtext($1)) AS held),
bad AS (
    SELECT min(b.base) AS base FROM lock, unnest($6::BIGINT[]) AS b(base)
    WHERE b.base IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM events AS e WHERE e.seq = b.base AND e.rollout_id = $1
            AND e.attempt = $2 AND e.type = 'model_request')
),
checked AS (
    SELECT CASE WHEN bad.base IS NULL THEN TRUE ELSE agl_refuse(
        'prompt base ' || bad.base || ' is not a model_request of rollout '
        || quote_literal($1) || ' attempt ' || $2) END AS ok
    FROM bad
),
pending AS (
    INSERT INTO pending_answers
        (rollout_id, attempt, answer_id, request_hash, boot, body, stream)
    SELECT $1, $2, $16, $17, $18, $19, $20 FROM checked WHERE $16::TEXT IS NOT NULL
    ON CONFLICT DO NOTHING
),
added AS (
    INSERT INTO events
        (rollout_id, attempt, event_id, type, data, time, prompt_base, keep_ids, keep_input)
    SELECT $1, $2, e.event_id, e.type, e.data, $21, e.base, e.keep_ids, e.keep_input
    FROM checked, unnest($3::TEXT[], $4::TEXT[], $5::BYTEA[], $6::BIGINT[], $7::INT[], $8::INT[])
        WITH ORDINALITY AS e(event_id, type, data, base, keep_ids, keep_input, n)
    ORDER BY e.n
    ON CONFLICT (rollout_id, attempt, event_id) DO NOTHING
    RETURNING event_id, seq
),
counted AS (
    SELECT a.seq, c.* FROM added AS a JOIN unnest(
        $9::TEXT[], $10::INT[], $11::INT[], $12::BIGINT[], $13::BIGINT[], $14::INT[],
        $15::FLOAT8[]
    ) AS c(event_id, calls, failed, tokens, context, rewards, reward) USING (event_id)
),
summary AS (
    INSERT INTO attempt_summaries AS s (rollout_id, {SUMMARY_COLUMNS})
    SELECT $1, $2, count(*), sum(calls), sum(failed), sum(tokens), max(context), sum(rewards),
        (SELECT reward FROM counted WHERE rewards = 1 ORDER BY seq DESC LIMIT 1), $21
    FROM counted HAVING count(*) > 0
    ON CONFLICT (rollout_id, attempt) DO UPDATE SET
        events = s.events + excluded.events,
        calls = s.calls + excluded.calls,
        failed_calls = s.failed_calls + excluded.failed_calls,
        tokens = s.tokens + excluded.tokens,
        context = GREATEST(s.context, excluded.context),
        rewards = s.rewards + excluded.rewards,
        reward = CASE WHEN excluded.rewards > 0 THEN excluded.reward ELSE s.reward END,
        last_event_at = excluded.last_event_at
)
SELECT event_id, seq FROM added
"""

# metadata.step, else metadata.batch + 1, where they are integers (SQLite's json_type
# 'integer': 1.0 is not one); the metadata is orjson text in a BYTEA.
_META = "convert_from(r.metadata, 'UTF8')::JSONB"
_STEP = f"""CASE
    WHEN ({_META} ->> 'step') ~ '^-?[0-9]{{1,18}}$' AND jsonb_typeof({_META} -> 'step') = 'number'
        THEN ({_META} ->> 'step')::BIGINT
    WHEN ({_META} ->> 'batch') ~ '^-?[0-9]{{1,18}}$'
        AND jsonb_typeof({_META} -> 'batch') = 'number'
        THEN ({_META} ->> 'batch')::BIGINT + 1
    END"""

_LIVE = "heard_at > clock_timestamp() - make_interval(secs => $1)"


def _stored(row: Sequence[Any], offset: int) -> StoredCall:
    """A row's data and base, from its columns ``seq`` at ``offset - 2`` ... (see the
    event columns: seq, type, data, time, prompt_base, keep_ids, keep_input)."""
    seq, data, base = row[offset], row[offset + 2], row[offset + 4]
    return StoredCall(
        seq,
        orjson.loads(data),
        None if base is None else PromptBase(base, row[offset + 5], row[offset + 6]),
    )


def _check_bases(events: Sequence[EventIn], bases: Sequence[PromptBase | None]) -> None:
    """What can be checked of the bases without the store: one per event, each on a
    model_request with prompt ids and an input where it keeps some (the base itself is
    checked in the append's statement; its length where it is decoded)."""
    if len(bases) != len(events):
        raise ValueError(f"{len(bases)} prompt bases for {len(events)} events")
    for e, base in zip(events, bases, strict=True):
        if base is not None:
            check_tails(e.type, e.data, base)


async def _reset(connection: asyncpg.Connection) -> None:
    """What a pooled connection needs between two uses. asyncpg's default (RESET ALL,
    UNLISTEN, unlocking, CLOSE ALL) is one more round trip and transaction at every
    release: twice the store's transactions per call. This store leaves no session
    state (its locks are transaction-scoped, LISTEN has a connection of its own), so only
    a transaction left open by a cancelled request is ended, and that costs nothing to
    check (the client knows the connection's transaction state)."""
    if connection.is_in_transaction():
        await connection.execute("ROLLBACK")


def password(password_file: str = "") -> str | None:
    """The store's password: ``password_file``'s content (a mounted Secret), else
    ``$AGL_STORE_PASSWORD``, else None (trust, peer or a .pgpass file)."""
    if password_file:
        return Path(password_file).read_text().strip()
    return os.environ.get("AGL_STORE_PASSWORD") or None


def connection_options(url: str) -> dict[str, Any]:
    """asyncpg's connection arguments of ``postgresql://user@host:port/db``; a URL that
    holds a password is refused: a command line is readable by every user."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError(f"not a PostgreSQL URL: {url!r}")
    if parts.password is not None:
        raise ValueError(
            "the store URL holds a password: give it by store_password_file= or "
            "$AGL_STORE_PASSWORD instead (a command line is readable by every user)"
        )
    return {
        "host": parts.hostname or "localhost",
        "port": parts.port or 5432,
        "user": unquote(parts.username) if parts.username else None,
        "database": unquote(parts.path.lstrip("/")) or None,
    }


class PostgresStore(SharedStore):
    def __init__(
        self, url: str, password_file: str = "", lease_s: float = 5.0, pool_size: int = 10
    ) -> None:
        self._options: dict[str, Any] = {
            **connection_options(url),
            "password": password(password_file),
            # Durable before an answer: the commit waits for the WAL flush (the server's
            # default, set here so that a server configured otherwise cannot weaken it).
            "server_settings": {"synchronous_commit": "on", "application_name": "agl-gateway"},
        }
        self._pool_size = pool_size
        self.lease_s = lease_s
        self._listener: asyncpg.Connection | None = None
        self._wake: Callable[[], None] | None = None

    async def connect(self) -> None:
        pool = await asyncpg.create_pool(
            min_size=1, max_size=self._pool_size, reset=_reset, **self._options
        )
        assert pool is not None
        async with pool.acquire() as db, db.transaction():
            # Replicas starting together: CREATE ... IF NOT EXISTS is not safe against a
            # concurrent creation of the same name; the lock makes them take turns.
            await db.execute(f"SELECT pg_advisory_xact_lock({_SCHEMA_LOCK})")
            await db.execute(_SCHEMA)
        self._pool = pool

    # -- rollouts ------------------------------------------------------------------

    async def create_rollouts(self, specs: Sequence[RolloutSpec], now: float) -> list[Rollout]:
        ids = [s.rollout_id for s in specs]
        await self._pool.execute(
            f"WITH lock AS (SELECT pg_advisory_xact_lock({_ROLLOUTS_LOCK})) "
            f"INSERT INTO rollouts ({ROLLOUT_COLUMNS}) "
            "SELECT s.id, s.g, s.m, 'queuing', 1, 1, s.a, s.t, $7, $7, NULL, NULL, NULL, s.i, s.d "
            "FROM lock, unnest($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::INT[], $5::FLOAT8[], "
            "$6::BYTEA[], $8::BYTEA[]) WITH ORDINALITY AS s(id, g, m, a, t, i, d, n) "
            "ORDER BY s.n ON CONFLICT (rollout_id) DO NOTHING",
            ids,
            [s.group_id for s in specs],
            [s.mode for s in specs],
            [s.max_attempts for s in specs],
            [s.timeout_s for s in specs],
            [orjson.dumps(s.input) for s in specs],
            now,
            [orjson.dumps(s.metadata) for s in specs],
        )
        rows = await self._pool.fetch(
            f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = ANY($1::TEXT[])", ids
        )
        found = {row[0]: rollout_from_row(row) for row in rows}
        return [found[i] for i in ids]

    async def get_rollout(self, rollout_id: str) -> Rollout | None:
        row = await self._pool.fetchrow(
            f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = $1", rollout_id
        )
        return None if row is None else rollout_from_row(row)

    async def list_rollouts(self, query: RolloutQuery) -> tuple[list[Rollout], int | None]:
        args: list[Any] = [query.after]
        where = ["seq > $1"]
        if query.statuses:
            args.append(sorted(query.statuses))
            where.append(f"status = ANY(${len(args)}::TEXT[])")
        for column, value in (("mode", query.mode), ("group_id", query.group_id)):
            if value is not None:
                args.append(value)
                where.append(f"{column} = ${len(args)}")
        args.append(query.limit + 1)
        rows = await self._pool.fetch(
            f"SELECT {ROLLOUT_COLUMNS}, seq FROM rollouts WHERE {' AND '.join(where)} "
            f"ORDER BY seq LIMIT ${len(args)}",
            *args,
        )
        more = len(rows) > query.limit
        rows = rows[: query.limit]
        return [rollout_from_row(row) for row in rows], (rows[-1][-1] if more else None)

    async def patch_rollout(self, rollout_id: str, patch: StatusPatch, now: float) -> Rollout:
        async with self._pool.acquire() as db, db.transaction():
            row = await db.fetchrow(
                f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = $1 FOR UPDATE",
                rollout_id,
            )
            if row is None:
                raise NotFound(f"rollout {rollout_id!r} does not exist")
            current = rollout_from_row(row)
            updated = apply_patch(current, patch, now)
            if updated is None:
                return current
            await self._save_status(db, updated)
        return updated

    async def _save_status(self, db: asyncpg.Connection, r: Rollout) -> None:
        """The new status, its transition and (out of running) the end of its pending
        answers, in one statement of the caller's transaction."""
        await db.execute(
            "WITH t AS (INSERT INTO transitions (rollout_id, attempt, status, time, error) "
            "VALUES ($1, $2, $3, $4, $7)), "
            "p AS (DELETE FROM pending_answers WHERE rollout_id = $1 AND $3 <> 'running') "
            "UPDATE rollouts SET status = $3, attempt = $2, version = $8, updated_at = $4, "
            "started_at = $5, ended_at = $6, error = $7 WHERE rollout_id = $1",
            r.rollout_id,
            r.attempt,
            r.status.value,
            r.updated_at,
            r.started_at,
            r.ended_at,
            r.error,
            r.version,
        )

    async def expire_running(self, now: float, error: str) -> list[Rollout]:
        expired = []
        async with self._pool.acquire() as db, db.transaction():
            rows = await db.fetch(
                f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE status = 'running' "
                "AND timeout_s IS NOT NULL AND started_at + timeout_s <= $1 "
                "FOR UPDATE SKIP LOCKED",
                now,
            )
            for row in rows:
                try:
                    updated = apply_patch(
                        rollout_from_row(row), StatusPatch(status=Status.FAILED, error=error), now
                    )
                except IllegalTransition:
                    continue
                if updated is not None:
                    await self._save_status(db, updated)
                    expired.append(updated)
        return expired

    # -- events --------------------------------------------------------------------

    async def append_events(
        self,
        rollout_id: str,
        attempt: int,
        events: Sequence[EventIn],
        now: float,
        pending: PendingAnswer | None = None,
        bases: Sequence[PromptBase | None] | None = None,
    ) -> list[Event]:
        given: list[PromptBase | None] = [None] * len(events) if bases is None else list(bases)
        _check_bases(events, given)
        ids = [e.event_id or uuid.uuid4().hex for e in events]
        first: dict[str, int] = {}  # each id's first event: the one stored if it is new
        for i, event_id in enumerate(ids):
            first.setdefault(event_id, i)
        added = [figures(events[i].type, events[i].data, given[i]) for i in first.values()]
        try:
            rows = await self._append(
                rollout_id, attempt, events, given, ids, list(first), added, pending, now
            )
        except asyncpg.RaiseError as error:  # agl_refuse: a base that is not a call here
            raise ValueError(error.args[0] if error.args else str(error)) from None
        new = {row[0]: row[1] for row in rows}
        old: dict[str, Event] = {}
        if len(new) < len(first):
            old = await self._events_by_id(rollout_id, attempt, [i for i in first if i not in new])
        stored: list[Event] = []
        for e, event_id in zip(events, ids, strict=True):
            if event_id in old:
                stored.append(old[event_id])
            elif len(stored) > first[event_id]:  # a repeat within the batch
                stored.append(stored[first[event_id]])
            else:
                stored.append(
                    Event.model_construct(
                        rollout_id=rollout_id,
                        attempt=attempt,
                        event_id=event_id,
                        sequence=new[event_id],
                        type=e.type,
                        data=e.data,
                        time=now,
                    )
                )
        return stored

    async def _append(
        self,
        rollout_id: str,
        attempt: int,
        events: Sequence[EventIn],
        given: list[PromptBase | None],
        ids: list[str],
        distinct: list[str],
        added: list[Figures],
        p: PendingAnswer | None,
        now: float,
    ) -> list[asyncpg.Record]:
        return await self._pool.fetch(
            _APPEND,
            rollout_id,
            attempt,
            ids,
            [e.type for e in events],
            [orjson.dumps(e.data) for e in events],
            [b.sequence if b else None for b in given],
            [b.keep_ids if b else None for b in given],
            [b.keep_input if b else None for b in given],
            distinct,
            [f.calls for f in added],
            [f.failed for f in added],
            [f.tokens for f in added],
            [f.context for f in added],
            [f.rewards for f in added],
            [f.reward for f in added],
            None if p is None else p.answer_id,
            None if p is None else p.request_hash,
            None if p is None else p.boot,
            None if p is None else zlib.compress(p.body, 1),
            None if p is None else p.stream,
            now,
        )

    async def _events_by_id(
        self, rollout_id: str, attempt: int, ids: list[str]
    ) -> dict[str, Event]:
        """Events stored already (a repeat of their ids), answered as a read answers
        them: a based call whole."""
        rows = await self._pool.fetch(
            f"SELECT {_EVENT_COLUMNS} FROM events WHERE rollout_id = $1 AND attempt = $2 "
            "AND event_id = ANY($3::TEXT[]) ORDER BY seq",
            rollout_id,
            attempt,
            ids,
        )
        return {e.event_id: e for e in await self._decoded(rollout_id, rows)}

    async def _decoded(self, rollout_id: str, rows: Sequence[Any]) -> list[Event]:
        """Events of ``rows`` (event columns) with every based call read back whole."""
        calls = [_stored(row, 3) for row in rows]
        if all(c.base is None for c in calls):
            return [event_from_row(row, c.data) for row, c in zip(rows, calls, strict=True)]

        async def earlier(missing: set[int]) -> Iterable[StoredCall]:
            # The chain of bases of a page runs back to a call stored whole: one query
            # reads the rollout's calls up to the last base wanted, tails as they are.
            found = await self._pool.fetch(
                "SELECT seq, type, data, time, prompt_base, keep_ids, keep_input FROM events "
                "WHERE rollout_id = $1 AND type = 'model_request' AND seq <= $2 ORDER BY seq",
                rollout_id,
                max(missing),
            )
            return [_stored(row, 0) for row in found]

        data = await resolve(calls, earlier)
        return [event_from_row(row, data[row[3]]) for row in rows]

    async def claim_answer(
        self, rollout_id: str, attempt: int, request_hash: bytes, boot: str
    ) -> PendingAnswer | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lease_s
        while True:
            claimed, held = await self._claim_once(rollout_id, attempt, request_hash, boot)
            if claimed is not None or not held or loop.time() >= deadline:
                return claimed
            await asyncio.sleep(_CLAIM_POLL_S)

    async def _claim_once(
        self, rollout_id: str, attempt: int, request_hash: bytes, boot: str
    ) -> tuple[PendingAnswer | None, bool]:
        """One look: the oldest answer to the request that a dead replica held, now
        ``boot``'s; and whether another answer to it is still held by someone alive (or
        was claimed under our feet by a replica that is, which then holds it)."""
        rows = await self._pool.fetch(
            f"""
            WITH live AS (SELECT boot FROM replicas WHERE {_LIVE}),
            candidates AS (
                SELECT answer_id, boot, seq, boot IN (SELECT boot FROM live) AS alive
                FROM pending_answers
                WHERE rollout_id = $2 AND attempt = $3 AND request_hash = $4 AND boot <> $5
            ),
            pick AS (SELECT answer_id, boot FROM candidates WHERE NOT alive ORDER BY seq LIMIT 1),
            claimed AS (
                UPDATE pending_answers AS p SET boot = $5 FROM pick
                WHERE p.rollout_id = $2 AND p.attempt = $3 AND p.answer_id = pick.answer_id
                    AND p.boot = pick.boot
                RETURNING p.answer_id, p.body, p.stream
            )
            SELECT answer_id, body, stream,
                EXISTS (SELECT 1 FROM candidates WHERE alive) OR EXISTS (SELECT 1 FROM pick)
            FROM claimed
            UNION ALL
            SELECT NULL, NULL, NULL,
                EXISTS (SELECT 1 FROM candidates WHERE alive) OR EXISTS (SELECT 1 FROM pick)
            """,
            self.lease_s,
            rollout_id,
            attempt,
            request_hash,
            boot,
        )
        for answer_id, body, stream, _ in rows:
            if answer_id is not None:
                return PendingAnswer(
                    answer_id, request_hash, boot, zlib.decompress(body), stream
                ), True
        # No claim: a dead holder's answer that was there (``pick``) went to another
        # replica, which is alive, so the request is still held.
        return None, rows[-1][3]

    async def answer_delivered(self, rollout_id: str, attempt: int, answer_id: str) -> None:
        await self._pool.execute(
            "DELETE FROM pending_answers WHERE rollout_id = $1 AND attempt = $2 AND answer_id = $3",
            rollout_id,
            attempt,
            answer_id,
        )

    async def list_events(self, rollout_id: str, query: EventQuery) -> list[Event]:
        args: list[Any] = [rollout_id, query.after]
        where = ["rollout_id = $1", "seq > $2"]
        for column, value in (("attempt", query.attempt), ("type", query.type)):
            if value is not None:
                args.append(value)
                where.append(f"{column} = ${len(args)}")
        args.append(query.limit)
        rows = await self._pool.fetch(
            f"SELECT {_EVENT_COLUMNS} FROM events WHERE {' AND '.join(where)} "
            f"ORDER BY seq LIMIT ${len(args)}",
            *args,
        )
        return await self._decoded(rollout_id, rows)

    # -- what the viewer reads -----------------------------------------------------

    async def query_rollouts(self, query: SummaryQuery) -> tuple[list[RolloutRow], int]:
        where: list[str] = []
        args: list[Any] = []

        def bind(value: Any) -> str:
            args.append(value)
            return f"${len(args)}"

        if query.statuses:
            where.append(f"r.status = ANY({bind(sorted(query.statuses))}::TEXT[])")
        for column, value in (("r.mode", query.mode), ("r.group_id", query.group_id)):
            if value is not None:
                where.append(f"{column} = {bind(value)}")
        if query.step is not None:
            where.append(f"{_STEP} = {bind(query.step)}")
        if query.min_reward is not None:
            where.append(f"s.reward >= {bind(query.min_reward)}")
        if query.max_reward is not None:
            where.append(f"s.reward <= {bind(query.max_reward)}")
        joined = (
            "FROM rollouts AS r LEFT JOIN attempt_summaries AS s "
            "ON s.rollout_id = r.rollout_id AND s.attempt = r.attempt"
        )
        condition = f"WHERE {' AND '.join(where)}" if where else ""
        total = await self._pool.fetchval(f"SELECT count(*) {joined} {condition}", *args)
        key = SORT_KEYS[query.sort]
        direction = "DESC" if query.descending else "ASC"
        columns = ", ".join(f"r.{c.strip()}" for c in ROLLOUT_COLUMNS.split(","))
        summary = ", ".join(f"s.{c.strip()}" for c in SUMMARY_COLUMNS.split(","))
        limit, offset = bind(query.limit), bind(query.offset)
        rows = await self._pool.fetch(
            f"SELECT {columns}, {summary} {joined} {condition} "
            f"ORDER BY {key} IS NULL, {key} {direction}, r.seq LIMIT {limit} OFFSET {offset}",
            *args,
        )
        split = ROLLOUT_COLUMNS.count(",") + 1
        return [
            RolloutRow(rollout_from_row(row), None if row[split] is None else Summary(*row[split:]))
            for row in rows
        ], total

    async def summaries(self, rollout_id: str) -> list[Summary]:
        rows = await self._pool.fetch(
            f"SELECT {SUMMARY_COLUMNS} FROM attempt_summaries WHERE rollout_id = $1 "
            "ORDER BY attempt",
            rollout_id,
        )
        return [Summary(*row) for row in rows]

    async def transitions(self, rollout_id: str) -> list[Transition]:
        rows = await self._pool.fetch(
            "SELECT attempt, status, time, error FROM transitions WHERE rollout_id = $1 "
            "ORDER BY seq",
            rollout_id,
        )
        return [Transition(a, Status(s), t, e) for a, s, t, e in rows]

    # -- models and meta -----------------------------------------------------------

    async def put_models(self, models: Sequence[ModelEndpoint]) -> None:
        async with self._pool.acquire() as db, db.transaction():
            await db.executemany(
                "INSERT INTO models (model, endpoint, policy_version) VALUES ($1, $2, $3) "
                "ON CONFLICT (model, endpoint) "
                "DO UPDATE SET policy_version = excluded.policy_version",
                [(m.model, m.endpoint, m.policy_version) for m in models],
            )
            await self._bump(db, MODELS_GENERATION)

    async def delete_models(self, model: str | None) -> int:
        async with self._pool.acquire() as db, db.transaction():
            if model is None:
                status = await db.execute("DELETE FROM models")
            else:
                status = await db.execute("DELETE FROM models WHERE model = $1", model)
            await self._bump(db, MODELS_GENERATION)
        return int(status.split()[-1])

    async def _bump(self, db: asyncpg.Connection, key: str) -> int:
        """One more on the generation at ``key``, announced to every replica at commit."""
        generation: int = await db.fetchval(
            "WITH g AS (INSERT INTO meta (key, value) VALUES ($1, '1') "
            "ON CONFLICT (key) DO UPDATE SET value = (meta.value::BIGINT + 1)::TEXT "
            "RETURNING value::BIGINT AS value) "
            "SELECT value FROM g, pg_notify($2, $1 || ' ' || g.value)",
            key,
            CHANNEL,
        )
        return generation

    async def list_models(self) -> list[ModelEndpoint]:
        rows = await self._pool.fetch(
            "SELECT model, endpoint, policy_version FROM models ORDER BY model, endpoint"
        )
        return [ModelEndpoint(model=m, endpoint=e, policy_version=v) for m, e, v in rows]

    async def get_meta(self, key: str) -> str | None:
        value: str | None = await self._pool.fetchval("SELECT value FROM meta WHERE key = $1", key)
        return value

    async def set_meta(self, key: str, value: str) -> None:
        await self._pool.execute(
            "INSERT INTO meta (key, value) VALUES ($1, $2) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            key,
            value,
        )

    async def set_meta_once(self, key: str, value: str) -> str:
        while True:
            # One statement; when another replica's insert commits while ours waits on
            # it, neither half sees a value in this snapshot: the next statement does.
            stored: str | None = await self._pool.fetchval(
                "WITH ins AS (INSERT INTO meta (key, value) VALUES ($1, $2) "
                "ON CONFLICT (key) DO NOTHING RETURNING value) "
                "SELECT value FROM ins UNION ALL SELECT value FROM meta WHERE key = $1 LIMIT 1",
                key,
                value,
            )
            if stored is not None:
                return stored

    # -- replicas ------------------------------------------------------------------

    async def heartbeat(self, replica: Replica) -> SharedState:
        if self._wake is not None and (self._listener is None or self._listener.is_closed()):
            await self._listen()
        row = await self._pool.fetchrow(
            f"""
            WITH beat AS (
                INSERT INTO replicas (boot, heard_at, in_flight, waiting, applied)
                VALUES ($2, clock_timestamp(), $3, $4, $5)
                ON CONFLICT (boot) DO UPDATE SET heard_at = excluded.heard_at,
                    in_flight = excluded.in_flight, waiting = excluded.waiting,
                    applied = excluded.applied
            ),
            gone AS (
                -- Long dead: their pending answers count as dead without their row.
                DELETE FROM replicas
                WHERE heard_at < clock_timestamp() - make_interval(secs => $1 * 100)
            ),
            refilled AS (
                DELETE FROM rate_buckets WHERE full_at <= extract(epoch FROM clock_timestamp())
            )
            {_STATE}
            """,
            self.lease_s,
            replica.boot,
            replica.in_flight,
            replica.waiting,
            replica.applied,
        )
        return _shared_state(row)

    async def leave(self, boot: str) -> None:
        await self._pool.execute("DELETE FROM replicas WHERE boot = $1", boot)

    async def live_replicas(self) -> list[Replica]:
        rows = await self._pool.fetch(
            f"SELECT boot, in_flight, waiting, applied FROM replicas WHERE {_LIVE} ORDER BY boot",
            self.lease_s,
        )
        return [Replica(*row) for row in rows]

    async def shared_state(self) -> SharedState:
        return _shared_state(await self._pool.fetchrow(_STATE))

    async def set_admission(self, state: str) -> SharedState:
        async with self._pool.acquire() as db, db.transaction():
            await db.execute(
                "INSERT INTO meta (key, value) VALUES ($1, $2) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                ADMISSION_META,
                state,
            )
            await self._bump(db, ADMISSION_GENERATION)
            row = await db.fetchrow(_STATE)
        return _shared_state(row)

    async def watch(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        await self._listen()

    async def _listen(self) -> None:
        """A connection of its own that LISTENs; a lost one is replaced at the next
        heartbeat, which also reads the state itself, so a lost notice costs a beat."""
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await self._listener.close()
            self._listener = None
        wake = self._wake
        assert wake is not None
        try:
            listener = await asyncpg.connect(**self._options)
            await listener.add_listener(CHANNEL, lambda *_: wake())
        except (OSError, asyncpg.PostgresError):
            return  # the heartbeat tries again
        self._listener = listener

    async def take_token(self, key: tuple[str, int], rate: float, burst: float) -> float:
        row = await self._pool.fetchrow(
            f"""
            WITH now AS (SELECT extract(epoch FROM clock_timestamp())::FLOAT8 AS t)
            INSERT INTO rate_buckets AS b (rollout_id, attempt, tokens, at, admitted, full_at)
            SELECT $1, $2, $4::FLOAT8 - 1, now.t, TRUE, now.t + 1 / $3::FLOAT8 FROM now
            ON CONFLICT (rollout_id, attempt) DO UPDATE SET
                tokens = {_TAKEN},
                at = excluded.at,
                admitted = {_REFILLED} >= 1,
                full_at = excluded.at + ($4::FLOAT8 - ({_TAKEN})) / $3::FLOAT8
            RETURNING tokens, admitted
            """,
            key[0],
            key[1],
            rate,
            burst,
        )
        tokens, admitted = row
        return 0.0 if admitted else (1.0 - tokens) / rate

    async def charge_tokens(
        self, key: tuple[str, int], rate: float, burst: float, cost: float
    ) -> None:
        await self._pool.execute(
            f"""
            WITH now AS (SELECT extract(epoch FROM clock_timestamp())::FLOAT8 AS t)
            INSERT INTO rate_buckets AS b (rollout_id, attempt, tokens, at, admitted, full_at)
            SELECT $1, $2, $4::FLOAT8 - $5::FLOAT8, now.t, TRUE, now.t + $5::FLOAT8 / $3::FLOAT8
            FROM now
            ON CONFLICT (rollout_id, attempt) DO UPDATE SET
                tokens = {_REFILLED} - $5::FLOAT8,
                at = excluded.at,
                full_at = excluded.at + ($4::FLOAT8 - ({_REFILLED} - $5::FLOAT8)) / $3::FLOAT8
            """,
            key[0],
            key[1],
            rate,
            burst,
            cost,
        )

    async def close(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await self._listener.close()
        await self._pool.close()


# A bucket's tokens now (in an upsert of rate_buckets AS b, with the new row's time as
# excluded.at, $3 the rate, $4 the burst).
_REFILLED = "LEAST($4::FLOAT8, b.tokens + (excluded.at - b.at) * $3::FLOAT8)"
# ... after a take: one token fewer, if there was one.
_TAKEN = f"{_REFILLED} - CASE WHEN {_REFILLED} >= 1 THEN 1 ELSE 0 END"

_STATE = f"""
SELECT
    (SELECT value FROM meta WHERE key = '{ADMISSION_META}'),
    (SELECT value::BIGINT FROM meta WHERE key = '{ADMISSION_GENERATION}'),
    (SELECT value::BIGINT FROM meta WHERE key = '{MODELS_GENERATION}')
"""


def _shared_state(row: Sequence[Any] | None) -> SharedState:
    assert row is not None
    admission, generation, models = row
    return SharedState(admission or "running", generation or 0, models or 0)
