"""What the pages show, made from store records: pure functions, no HTTP, no HTML.

Everything here comes from rollouts, that is from agents and models: it is data to show,
never markup. The templates escape it (Jinja2 autoescape); nothing here marks text safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from agl.core.contracts.queries import Summary, Transition
from agl.core.contracts.records import MODEL_REQUEST, MODEL_REQUEST_FAILED, Event, Rollout, Status
from agl.core.contracts.samples import ModelCall
from agl.core.trainer.calls import read_calls, shown_messages
from agl.strategies.dedup import dedup

REWARD = "reward"


def step_of(metadata: dict[str, Any]) -> str:
    """The training step whose metrics a rollout is in, as ``SummaryQuery.step`` reads
    it: ``metadata.step`` (validation), else ``metadata.batch`` + 1 (training)."""
    step, batch = metadata.get("step"), metadata.get("batch")
    if isinstance(step, int) and not isinstance(step, bool):
        return str(step)
    if isinstance(batch, int) and not isinstance(batch, bool):
        return str(batch + 1)
    return "—"


def pretty(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()


def compact(value: Any, limit: int = 120) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def clock(t: float | None) -> str:
    if t is None:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def seconds(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def number(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def duration(rollout: Rollout) -> float | None:
    if rollout.started_at is None or rollout.ended_at is None:
        return None
    return rollout.ended_at - rollout.started_at


def message_text(message: Any) -> str:
    """A chat message's content as text: a string as is, content parts joined (text
    parts as text, others as JSON)."""
    if not isinstance(message, dict):
        return compact(message, 10_000)
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            p["text"]
            if isinstance(p, dict) and isinstance(p.get("text"), str)
            else compact(p, 10_000)
            for p in content
        ]
        return "\n".join(parts)
    return compact(content, 10_000)


@dataclass(frozen=True)
class MessageView:
    role: str
    text: str
    extra: str  # tool calls, tool_call_id, name: JSON, or ""


def message_view(message: Any) -> MessageView:
    if not isinstance(message, dict):
        return MessageView("?", message_text(message), "")
    extra = {k: v for k, v in message.items() if k not in ("role", "content")}
    return MessageView(
        str(message.get("role", "?")), message_text(message), pretty(extra) if extra else ""
    )


@dataclass
class Item:
    """One event of an attempt, as the timeline shows it."""

    kind: str  # "call" | "failed_call" | "reward" | "event"
    sequence: int
    time: float
    offset_s: float  # since the attempt's first event
    type: str
    # A call's index among the calls the trainer keeps (the samples' call numbers), or
    # why it has none (see ``_calls``).
    call: int | None = None
    dropped: str = ""
    earlier: int = 0  # leading messages equal to the previous call's, not shown again
    messages: list[MessageView] = field(default_factory=list)
    response: str | None = None
    tool_calls: str = ""
    fields: dict[str, str] = field(default_factory=dict)
    data: str = ""  # the raw data of a reward or custom event, pretty JSON


_CALL_FIELDS = (
    ("policy_version", "policy version", str),
    ("finish_reason", "finish reason", str),
    ("latency_s", "latency", seconds),
    ("model", "model", str),
    ("endpoint", "endpoint", str),
)


def timeline(
    events: Sequence[Event], decode: Callable[[list[int]], str] | None = None
) -> list[Item]:
    """One attempt's events in order. A call shows only the messages that were not in
    the previous call's prompt: a harness resends the whole history on every turn, and
    showing it each time makes a long rollout's page quadratic in its length."""
    items: list[Item] = []
    previous: list[Any] = []
    ordered = sorted(events, key=lambda e: e.sequence)
    kept, left_out = _calls(ordered, decode)
    start = min((e.time for e in events), default=0.0)
    for e in ordered:
        data = e.data if isinstance(e.data, dict) else {}
        item = Item(
            kind="event", sequence=e.sequence, time=e.time, offset_s=e.time - start, type=e.type
        )
        if e.type in (MODEL_REQUEST, MODEL_REQUEST_FAILED):
            messages = shown_messages(data)
            item.earlier = _shared_head(previous, messages)
            item.messages = [message_view(m) for m in messages[item.earlier :]]
            previous = messages
            shown = {
                label: show(data[key])
                for key, label, show in _CALL_FIELDS
                if data.get(key) is not None
            }
            if e.type == MODEL_REQUEST:
                item.kind = "call"
                item.call = kept.get(e.sequence)
                item.dropped = left_out.get(e.sequence, "")
                item.response = (
                    data.get("response") if isinstance(data.get("response"), str) else None
                )
                if data.get("tool_calls"):
                    item.tool_calls = pretty(data["tool_calls"])
                shown["tokens"] = f"{_length(data.get('prompt_ids'))} prompt + " + (
                    f"{_length(data.get('response_ids'))} sampled"
                )
            else:
                item.kind = "failed_call"
                shown["status"] = str(data.get("status", "—"))
                shown["error"] = str(data.get("error", "—"))
            item.fields = shown
        else:
            item.kind = "reward" if e.type == REWARD else "event"
            item.data = pretty(e.data)
        items.append(item)
    return items


def _calls(
    events: Sequence[Event], decode: Callable[[list[int]], str] | None
) -> tuple[dict[int, int], dict[int, str]]:
    """For each ``model_request`` event (by sequence), its index among the calls the
    trainer keeps, or why it is left out: the reason ``agl.core.trainer.calls.read_calls`` gives
    (with ``decode``, the run's tokenizer, as the trainer has it), or "retried" (a later
    call has the same prompt: ``dedup``)."""
    why: dict[int, str] = {}
    valid: dict[int, ModelCall] = {}
    for e in events:
        if e.type != MODEL_REQUEST:
            continue
        if not isinstance(e.data, dict):
            why[e.sequence] = "no data"
            continue
        read = read_calls([e], decode)
        if read.calls:
            valid[e.sequence] = read.calls[0]
        else:
            why[e.sequence] = next(iter(read.invalid))
    kept = {id(c) for c in dedup(list(valid.values()))}
    index: dict[int, int] = {}
    for sequence, call in valid.items():
        if id(call) in kept:
            index[sequence] = len(index)
        else:
            why[sequence] = "retried"
    return index, why


def _shared_head(a: list[Any], b: list[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _length(ids: Any) -> str:
    return str(len(ids)) if isinstance(ids, list) else "—"


@dataclass(frozen=True)
class HistoryEntry:
    time: float
    attempt: int
    status: str
    error: str | None


def history(
    rollout: Rollout, transitions: Sequence[Transition], complete: bool = True
) -> list[HistoryEntry]:
    """Creation (as ``queuing``, attempt 1) and then every recorded status change. For a
    rollout older than the store's record of changes (``complete`` False), what its
    record still says: when its current attempt started and ended."""
    entries = [HistoryEntry(rollout.created_at, 1, Status.QUEUING.value, None)]
    if not complete and not transitions:
        if rollout.started_at is not None:
            entries.append(
                HistoryEntry(rollout.started_at, rollout.attempt, Status.RUNNING.value, None)
            )
        if rollout.ended_at is not None:
            entries.append(
                HistoryEntry(rollout.ended_at, rollout.attempt, rollout.status.value, rollout.error)
            )
    entries += [HistoryEntry(t.time, t.attempt, t.status.value, t.error) for t in transitions]
    return entries


@dataclass(frozen=True)
class AttemptView:
    attempt: int
    summary: Summary | None
    items: list[Item]


def attempts(
    rollout: Rollout,
    events: Sequence[Event],
    summaries: Sequence[Summary],
    decode: Callable[[list[int]], str] | None = None,
) -> list[AttemptView]:
    """Each attempt, latest first (the one the trainer reads)."""
    by_attempt: dict[int, list[Event]] = {}
    for e in events:
        by_attempt.setdefault(e.attempt, []).append(e)
    summary = {s.attempt: s for s in summaries}
    return [
        AttemptView(a, summary.get(a), timeline(by_attempt.get(a, []), decode))
        for a in range(rollout.attempt, 0, -1)
    ]
