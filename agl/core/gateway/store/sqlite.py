"""The embedded store: one SQLite file in WAL mode, written with group commit.

Every statement runs on the event loop's thread, so a read-check-write sequence with no
``await`` between its steps is atomic without locks. Writes of concurrent requests share
one transaction that commits once per loop iteration; each writer awaits that commit
before its request is acknowledged. WAL with ``synchronous=NORMAL`` makes a commit
survive the death of the process (``kill -9``); ``fsync=True`` (``synchronous=FULL``)
also survives the loss of the machine, at the price of an fsync per group.

A ``model_request`` appended with a base (:mod:`~agl.core.gateway.store.prompt_delta`)
keeps only its tails in ``data`` and names its base in three columns; a read fetches the
chain of bases its page needs in one recursive query and answers every call whole.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import astuple
from pathlib import Path
from typing import Any

import orjson

from agl.core.contracts.queries import (
    HISTORY_SINCE,
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
from agl.core.gateway.private_files import DIR_MODE, private_sqlite
from agl.core.gateway.store.base import NotFound, PendingAnswer, Store
from agl.core.gateway.store.lifecycle import IllegalTransition, apply_patch
from agl.core.gateway.store.prompt_delta import PromptBase, StoredCall, check_tails, resolve
from agl.core.gateway.store.rows import (
    ROLLOUT_COLUMNS,
    SORT_KEYS,
    SUMMARY_COLUMNS,
    event_from_row,
    figures,
    rollout_from_row,
)

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY,
    rollout_id TEXT NOT NULL UNIQUE,
    group_id TEXT NOT NULL,
    mode TEXT NOT NULL,
    status TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    version INTEGER NOT NULL,
    max_attempts INTEGER NOT NULL,
    timeout_s REAL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    error TEXT,
    input BLOB NOT NULL,
    metadata BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_by_status ON rollouts (status, seq);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    event_id TEXT NOT NULL,
    type TEXT NOT NULL,
    data BLOB NOT NULL,
    time REAL NOT NULL,
    prompt_base INTEGER,
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
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    answer_id TEXT NOT NULL,
    request_hash BLOB NOT NULL,
    boot TEXT NOT NULL,
    body BLOB NOT NULL,
    stream INTEGER NOT NULL,
    PRIMARY KEY (rollout_id, attempt, answer_id)
);
CREATE INDEX IF NOT EXISTS pending_by_request
    ON pending_answers (rollout_id, attempt, request_hash);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS rollouts_by_group ON rollouts (group_id, seq);
CREATE TABLE IF NOT EXISTS attempt_summaries (
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    events INTEGER NOT NULL,
    calls INTEGER NOT NULL,
    failed_calls INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    context INTEGER NOT NULL,
    rewards INTEGER NOT NULL,
    reward REAL,
    last_event_at REAL,
    PRIMARY KEY (rollout_id, attempt)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS transitions (
    seq INTEGER PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    status TEXT NOT NULL,
    time REAL NOT NULL,
    error TEXT
);
CREATE INDEX IF NOT EXISTS transitions_by_rollout ON transitions (rollout_id, seq);
"""

_ADD_TO_SUMMARY = f"""
INSERT INTO attempt_summaries (rollout_id, {SUMMARY_COLUMNS})
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (rollout_id, attempt) DO UPDATE SET
    events = events + excluded.events,
    calls = calls + excluded.calls,
    failed_calls = failed_calls + excluded.failed_calls,
    tokens = tokens + excluded.tokens,
    context = MAX(context, excluded.context),
    rewards = rewards + excluded.rewards,
    reward = CASE WHEN excluded.rewards > 0 THEN excluded.reward ELSE reward END,
    last_event_at = excluded.last_event_at
"""

# The summaries of a store made before them, from its events, in one pass of SQLite's
# JSON functions (the data is orjson text in a BLOB: CAST keeps SQLite from reading it
# as its binary JSONB).
_BACKFILL_SUMMARIES = f"""
INSERT OR IGNORE INTO attempt_summaries (rollout_id, {SUMMARY_COLUMNS})
SELECT rollout_id, attempt, COUNT(*),
    SUM(type = 'model_request'),
    SUM(type = 'model_request_failed'),
    SUM(CASE WHEN type = 'model_request'
        THEN COALESCE(json_array_length(CAST(data AS TEXT), '$.response_ids'), 0) ELSE 0 END),
    MAX(CASE WHEN type = 'model_request'
        THEN COALESCE(json_array_length(CAST(data AS TEXT), '$.prompt_ids'), 0)
            + COALESCE(json_array_length(CAST(data AS TEXT), '$.response_ids'), 0)
        ELSE 0 END),
    SUM(type = 'reward'),
    (SELECT CASE json_type(CAST(last.data AS TEXT), '$.value')
            WHEN 'integer' THEN json_extract(CAST(last.data AS TEXT), '$.value')
            WHEN 'real' THEN json_extract(CAST(last.data AS TEXT), '$.value')
            WHEN 'true' THEN 1.0 WHEN 'false' THEN 0.0 END
        FROM events AS last
        WHERE last.rollout_id = events.rollout_id AND last.attempt = events.attempt
            AND last.type = 'reward' AND json_type(CAST(last.data AS TEXT)) = 'object'
            AND last.seq = (SELECT MAX(seq) FROM events AS r WHERE r.rollout_id = last.rollout_id
                AND r.attempt = last.attempt AND r.type = 'reward')),
    MAX(time)
FROM events GROUP BY rollout_id, attempt
"""

_STEP = """CASE
    WHEN json_type(CAST(r.metadata AS TEXT), '$.step') = 'integer'
        THEN json_extract(CAST(r.metadata AS TEXT), '$.step')
    WHEN json_type(CAST(r.metadata AS TEXT), '$.batch') = 'integer'
        THEN json_extract(CAST(r.metadata AS TEXT), '$.batch') + 1
    END"""

_EVENT_COLUMNS = "rollout_id, attempt, event_id, seq, type, data, time"
# A model_request stored by what it adds (prompt_delta.PromptBase): NULL when stored whole,
# and in every row of a store made before them (added by ALTER TABLE on open).
_BASE_COLUMNS = ("prompt_base", "keep_ids", "keep_input")


def _base(row: Sequence[Any]) -> PromptBase | None:
    """The PromptBase in a row's last three columns (``_BASE_COLUMNS``), if it has one."""
    sequence, keep_ids, keep_input = row[-3:]
    return None if sequence is None else PromptBase(sequence, keep_ids, keep_input)


def _summary(row: Sequence[Any]) -> Summary:
    return Summary(*row)


class _Added:
    """What a batch of newly stored events adds to their attempt's summary."""

    __slots__ = ("calls", "context", "events", "failed_calls", "reward", "rewards", "tokens")

    def __init__(self) -> None:
        self.events = self.calls = self.failed_calls = self.tokens = self.context = 0
        self.rewards = 0
        self.reward: float | None = None

    def count(self, type_: str, data: Any, base: PromptBase | None = None) -> None:
        """Count one event; ``base``: its data holds the tails (the base's tokens count)."""
        f = figures(type_, data, base)
        self.events += 1
        self.calls += f.calls
        self.failed_calls += f.failed
        self.tokens += f.tokens
        self.context = max(self.context, f.context)
        if f.rewards:
            self.rewards += 1
            self.reward = f.reward

    def row(self) -> tuple[Any, ...]:
        return (
            self.events,
            self.calls,
            self.failed_calls,
            self.tokens,
            self.context,
            self.rewards,
            self.reward,
        )


class SqliteStore(Store):
    def __init__(self, path: Path, fsync: bool = False) -> None:
        # A folder made here is private; one that exists may be shared (/tmp), so it is
        # left as it is: the files themselves are 0600.
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        private_sqlite(path)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        self._db.execute("PRAGMA busy_timeout=5000")
        before = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master")}
        self._db.executescript(_SCHEMA)
        self._migrate(before)
        self._in_transaction = False
        self._commit: asyncio.Future[None] | None = None

    def _migrate(self, before: set[str]) -> None:
        """Bring a store made before summaries, transitions and prompt bases up to date
        (once). Its rows then have no base (NULL columns): they read as stored."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(events)")}
        for column in _BASE_COLUMNS:
            if column not in columns:  # a nullable column: SQLite rewrites no row
                self._db.execute(f"ALTER TABLE events ADD COLUMN {column} INTEGER")
        if "events" in before and "attempt_summaries" not in before:
            log.info("building attempt summaries of %s from its events (once)", self.path)
            with self._db:
                self._db.execute(_BACKFILL_SUMMARIES)
        if "rollouts" in before and "transitions" not in before:
            self._db.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)",
                (HISTORY_SINCE, repr(time.time())),
            )

    # -- group commit --------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One operation inside the shared transaction, undone alone if it fails."""
        if not self._in_transaction:
            self._db.execute("BEGIN IMMEDIATE")
            self._in_transaction = True
        self._db.execute("SAVEPOINT op")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK TO op")
            self._db.execute("RELEASE op")
            raise
        self._db.execute("RELEASE op")

    async def _durable(self) -> None:
        """Return once the shared transaction holding this caller's writes has committed."""
        if self._commit is None:
            loop = asyncio.get_running_loop()
            self._commit = loop.create_future()
            loop.call_soon(self._flush)
        await asyncio.shield(self._commit)

    def _flush(self) -> None:
        waiter, self._commit = self._commit, None
        assert waiter is not None
        try:
            if self._in_transaction:
                self._in_transaction = False
                self._db.execute("COMMIT")
        except sqlite3.Error as error:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            waiter.set_exception(error)
        else:
            waiter.set_result(None)

    # -- rollouts ------------------------------------------------------------------

    async def create_rollouts(self, specs: Sequence[RolloutSpec], now: float) -> list[Rollout]:
        with self._write() as db:
            db.executemany(
                f"INSERT OR IGNORE INTO rollouts ({ROLLOUT_COLUMNS}) "
                "VALUES (?, ?, ?, 'queuing', 1, 1, ?, ?, ?, ?, NULL, NULL, NULL, ?, ?)",
                [
                    (
                        s.rollout_id,
                        s.group_id,
                        s.mode,
                        s.max_attempts,
                        s.timeout_s,
                        now,
                        now,
                        orjson.dumps(s.input),
                        orjson.dumps(s.metadata),
                    )
                    for s in specs
                ],
            )
        await self._durable()
        found = {r.rollout_id: r for r in self._select_rollouts([s.rollout_id for s in specs])}
        return [found[s.rollout_id] for s in specs]

    def _select_rollouts(self, ids: list[str]) -> list[Rollout]:
        out: list[Rollout] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            rows = self._db.execute(
                f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id IN ({marks})", chunk
            )
            out.extend(rollout_from_row(row) for row in rows)
        return out

    async def get_rollout(self, rollout_id: str) -> Rollout | None:
        row = self._db.execute(
            f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = ?", (rollout_id,)
        ).fetchone()
        return None if row is None else rollout_from_row(row)

    async def list_rollouts(self, query: RolloutQuery) -> tuple[list[Rollout], int | None]:
        where: list[str] = ["seq > ?"]
        args: list[int | str] = [query.after]
        if query.statuses:
            where.append(f"status IN ({','.join('?' * len(query.statuses))})")
            args.extend(sorted(query.statuses))
        if query.mode is not None:
            where.append("mode = ?")
            args.append(query.mode)
        if query.group_id is not None:
            where.append("group_id = ?")
            args.append(query.group_id)
        rows = self._db.execute(
            f"SELECT {ROLLOUT_COLUMNS}, seq FROM rollouts WHERE {' AND '.join(where)} "
            "ORDER BY seq LIMIT ?",
            [*args, query.limit + 1],
        ).fetchall()
        more = len(rows) > query.limit
        rows = rows[: query.limit]
        return [rollout_from_row(row) for row in rows], (rows[-1][-1] if more else None)

    async def patch_rollout(self, rollout_id: str, patch: StatusPatch, now: float) -> Rollout:
        current = await self.get_rollout(rollout_id)
        if current is None:
            raise NotFound(f"rollout {rollout_id!r} does not exist")
        updated = apply_patch(current, patch, now)
        if updated is None:
            return current
        self._save_status(updated)
        await self._durable()
        return updated

    def _save_status(self, r: Rollout) -> None:
        with self._write() as db:
            db.execute(
                "INSERT INTO transitions (rollout_id, attempt, status, time, error) "
                "VALUES (?, ?, ?, ?, ?)",
                (r.rollout_id, r.attempt, r.status.value, r.updated_at, r.error),
            )
            db.execute(
                "UPDATE rollouts SET status = ?, attempt = ?, version = ?, updated_at = ?, "
                "started_at = ?, ended_at = ?, error = ? WHERE rollout_id = ?",
                (
                    r.status.value,
                    r.attempt,
                    r.version,
                    r.updated_at,
                    r.started_at,
                    r.ended_at,
                    r.error,
                    r.rollout_id,
                ),
            )
            if r.status is not Status.RUNNING:
                # Only a running attempt's calls are answered, so nothing will claim these.
                db.execute("DELETE FROM pending_answers WHERE rollout_id = ?", (r.rollout_id,))

    async def expire_running(self, now: float, error: str) -> list[Rollout]:
        rows = self._db.execute(
            f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE status = 'running' "
            "AND timeout_s IS NOT NULL AND started_at + timeout_s <= ?",
            (now,),
        ).fetchall()
        expired = []
        for row in rows:
            current = rollout_from_row(row)
            try:
                updated = apply_patch(current, StatusPatch(status=Status.FAILED, error=error), now)
            except IllegalTransition:
                continue
            if updated is not None:
                self._save_status(updated)
                expired.append(updated)
        if expired:
            await self._durable()
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
        """See :meth:`Store.append_events`. An event whose id is known answers as a read
        does: whole, if it was stored with a base. A base that breaks
        :mod:`~agl.core.gateway.store.prompt_delta`'s invariants is the caller's bug:
        ValueError, and nothing of the call is stored."""
        if bases is None:
            bases = [None] * len(events)
        elif len(bases) != len(events):
            raise ValueError(f"{len(bases)} prompt bases for {len(events)} events")
        self._check_bases(rollout_id, attempt, events, bases)
        stored: list[Event] = []
        known: list[tuple[int, StoredCall]] = []  # repeats stored with a base: (index, row)
        with self._write() as db:
            if pending is not None:
                db.execute(
                    "INSERT OR IGNORE INTO pending_answers (rollout_id, attempt, answer_id, "
                    "request_hash, boot, body, stream) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        rollout_id,
                        attempt,
                        pending.answer_id,
                        pending.request_hash,
                        pending.boot,
                        zlib.compress(pending.body, 1),
                        pending.stream,
                    ),
                )
            added = _Added()
            for e, base in zip(events, bases, strict=True):
                event_id = e.event_id or uuid.uuid4().hex
                data = orjson.dumps(e.data)
                columns = (None, None, None) if base is None else astuple(base)
                cursor = db.execute(
                    "INSERT OR IGNORE INTO events (rollout_id, attempt, event_id, type, data, "
                    "time, prompt_base, keep_ids, keep_input) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (rollout_id, attempt, event_id, e.type, data, now, *columns),
                )
                if cursor.rowcount:
                    added.count(e.type, e.data, base)
                    stored.append(
                        Event.model_construct(
                            rollout_id=rollout_id,
                            attempt=attempt,
                            event_id=event_id,
                            sequence=cursor.lastrowid,
                            type=e.type,
                            data=e.data,
                            time=now,
                        )
                    )
                else:
                    row = db.execute(
                        f"SELECT {_EVENT_COLUMNS}, {', '.join(_BASE_COLUMNS)} FROM events "
                        "WHERE rollout_id = ? AND attempt = ? AND event_id = ?",
                        (rollout_id, attempt, event_id),
                    ).fetchone()
                    data = orjson.loads(row[5])
                    stored.append(event_from_row(row, data))
                    if (base_of_row := _base(row)) is not None:
                        known.append((len(stored) - 1, StoredCall(row[3], data, base_of_row)))
            if added.events:
                db.execute(_ADD_TO_SUMMARY, (rollout_id, attempt, *added.row(), now))
        await self._durable()
        if known:  # the API answers a repeat as it reads it (an id repeated is rare)
            whole = await resolve(
                [call for _, call in known], lambda missing: self._chains(rollout_id, missing)
            )
            for i, call in known:
                stored[i] = stored[i].model_copy(update={"data": whole[call.sequence]})
        return stored

    def _check_bases(
        self,
        rollout_id: str,
        attempt: int,
        events: Sequence[EventIn],
        bases: Sequence[PromptBase | None],
    ) -> None:
        """Raise ValueError unless every base is a model_request of this attempt stored
        already (so an earlier one: a new row's seq is above every row's) and its event
        can be stored on it (prompt_delta.check_tails)."""
        wanted = {b.sequence for b in bases if b is not None}
        if not wanted:
            return
        marks = ",".join("?" * len(wanted))
        found = {
            seq: (rid, att, type_)
            for seq, rid, att, type_ in self._db.execute(
                f"SELECT seq, rollout_id, attempt, type FROM events WHERE seq IN ({marks})",
                sorted(wanted),
            )
        }
        for e, base in zip(events, bases, strict=True):
            if base is None:
                continue
            if found.get(base.sequence) != (rollout_id, attempt, "model_request"):
                raise ValueError(
                    f"prompt base {base.sequence} is not a model_request of rollout "
                    f"{rollout_id!r} attempt {attempt}"
                )
            check_tails(e.type, e.data, base)

    async def claim_answer(
        self, rollout_id: str, attempt: int, request_hash: bytes, boot: str
    ) -> PendingAnswer | None:
        row = self._db.execute(
            "SELECT answer_id, body, stream FROM pending_answers WHERE rollout_id = ? "
            "AND attempt = ? AND request_hash = ? AND boot != ? ORDER BY rowid LIMIT 1",
            (rollout_id, attempt, request_hash, boot),
        ).fetchone()
        if row is None:
            return None
        with self._write() as db:
            db.execute(
                "UPDATE pending_answers SET boot = ? "
                "WHERE rollout_id = ? AND attempt = ? AND answer_id = ?",
                (boot, rollout_id, attempt, row[0]),
            )
        await self._durable()
        return PendingAnswer(row[0], request_hash, boot, zlib.decompress(row[1]), bool(row[2]))

    async def answer_delivered(self, rollout_id: str, attempt: int, answer_id: str) -> None:
        with self._write() as db:
            db.execute(
                "DELETE FROM pending_answers "
                "WHERE rollout_id = ? AND attempt = ? AND answer_id = ?",
                (rollout_id, attempt, answer_id),
            )
        await self._durable()

    async def list_events(self, rollout_id: str, query: EventQuery) -> list[Event]:
        where, args = ["rollout_id = ?", "seq > ?"], [rollout_id, query.after]
        if query.attempt is not None:
            where.append("attempt = ?")
            args.append(query.attempt)
        if query.type is not None:
            where.append("type = ?")
            args.append(query.type)
        rows = self._db.execute(
            f"SELECT {_EVENT_COLUMNS}, {', '.join(_BASE_COLUMNS)} FROM events "
            f"WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?",
            [*args, query.limit],
        ).fetchall()
        calls = [StoredCall(row[3], orjson.loads(row[5]), _base(row)) for row in rows]
        if any(call.base is not None for call in calls):
            decoded = await resolve(calls, lambda missing: self._chains(rollout_id, missing))
            return [event_from_row(row, decoded[row[3]]) for row in rows]
        return [event_from_row(row, call.data) for row, call in zip(rows, calls, strict=True)]

    async def _chains(self, rollout_id: str, sequences: set[int]) -> list[StoredCall]:
        """The rows at ``sequences`` and every base they are stored on, down to calls
        stored whole: what decoding a page needs of the rows before it, in one query."""
        marks = ",".join("?" * len(sequences))
        rows = self._db.execute(
            "WITH RECURSIVE chain (seq) AS ("
            f"SELECT seq FROM events WHERE seq IN ({marks}) UNION "
            "SELECT e.prompt_base FROM events AS e JOIN chain ON e.seq = chain.seq "
            "WHERE e.prompt_base IS NOT NULL) "
            f"SELECT seq, data, {', '.join(_BASE_COLUMNS)} FROM events "
            "WHERE seq IN (SELECT seq FROM chain) AND rollout_id = ?",
            [*sorted(sequences), rollout_id],
        )
        return [StoredCall(row[0], orjson.loads(row[1]), _base(row)) for row in rows]

    # -- what the viewer reads -----------------------------------------------------

    async def query_rollouts(self, query: SummaryQuery) -> tuple[list[RolloutRow], int]:
        where: list[str] = []
        args: list[Any] = []
        if query.statuses:
            where.append(f"r.status IN ({','.join('?' * len(query.statuses))})")
            args.extend(sorted(query.statuses))
        for column, value in (("r.mode", query.mode), ("r.group_id", query.group_id)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if query.step is not None:
            where.append(f"{_STEP} = ?")
            args.append(query.step)
        if query.min_reward is not None:
            where.append("s.reward >= ?")
            args.append(query.min_reward)
        if query.max_reward is not None:
            where.append("s.reward <= ?")
            args.append(query.max_reward)
        joined = (
            "FROM rollouts AS r LEFT JOIN attempt_summaries AS s "
            "ON s.rollout_id = r.rollout_id AND s.attempt = r.attempt"
        )
        condition = f"WHERE {' AND '.join(where)}" if where else ""
        (total,) = self._db.execute(f"SELECT COUNT(*) {joined} {condition}", args).fetchone()
        key = SORT_KEYS[query.sort]
        direction = "DESC" if query.descending else "ASC"
        columns = ", ".join(f"r.{c.strip()}" for c in ROLLOUT_COLUMNS.split(","))
        summary = ", ".join(f"s.{c.strip()}" for c in SUMMARY_COLUMNS.split(","))
        rows = self._db.execute(
            f"SELECT {columns}, {summary} {joined} {condition} "
            f"ORDER BY {key} IS NULL, {key} {direction}, r.seq LIMIT ? OFFSET ?",
            [*args, query.limit, query.offset],
        ).fetchall()
        split = ROLLOUT_COLUMNS.count(",") + 1
        return [
            RolloutRow(rollout_from_row(row), None if row[split] is None else _summary(row[split:]))
            for row in rows
        ], total

    async def summaries(self, rollout_id: str) -> list[Summary]:
        rows = self._db.execute(
            f"SELECT {SUMMARY_COLUMNS} FROM attempt_summaries WHERE rollout_id = ? "
            "ORDER BY attempt",
            (rollout_id,),
        )
        return [_summary(row) for row in rows]

    async def transitions(self, rollout_id: str) -> list[Transition]:
        rows = self._db.execute(
            "SELECT attempt, status, time, error FROM transitions WHERE rollout_id = ? "
            "ORDER BY seq",
            (rollout_id,),
        )
        return [Transition(a, Status(s), t, e) for a, s, t, e in rows]

    # -- models and meta -----------------------------------------------------------

    async def put_models(self, models: Sequence[ModelEndpoint]) -> None:
        with self._write() as db:
            db.executemany(
                "INSERT INTO models (model, endpoint, policy_version) VALUES (?, ?, ?) "
                "ON CONFLICT (model, endpoint) "
                "DO UPDATE SET policy_version = excluded.policy_version",
                [(m.model, m.endpoint, m.policy_version) for m in models],
            )
        await self._durable()

    async def delete_models(self, model: str | None) -> int:
        with self._write() as db:
            if model is None:
                count = db.execute("DELETE FROM models").rowcount
            else:
                count = db.execute("DELETE FROM models WHERE model = ?", (model,)).rowcount
        await self._durable()
        return count

    async def list_models(self) -> list[ModelEndpoint]:
        rows = self._db.execute(
            "SELECT model, endpoint, policy_version FROM models ORDER BY model, endpoint"
        )
        return [ModelEndpoint(model=m, endpoint=e, policy_version=v) for m, e, v in rows]

    async def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    async def set_meta(self, key: str, value: str) -> None:
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
        await self._durable()

    async def set_meta_once(self, key: str, value: str) -> str:
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (key, value))
        await self._durable()
        stored = await self.get_meta(key)
        assert stored is not None
        return stored

    async def close(self) -> None:
        if self._commit is not None:
            await asyncio.shield(self._commit)
        self._db.close()
