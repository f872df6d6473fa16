"""``python -m agl.rollouts``: look into a gateway's rollouts — list, show, export, scan.

    python -m agl.rollouts ls --status succeeded --sort reward -r --limit 20
    python -m agl.rollouts show t3.1.4 --run runs/2026-11-30/10-00-00
    python -m agl.rollouts export --mode train -o rollouts.jsonl
    python -m agl.rollouts scan --pattern 'git log' --rules mypkg.rules:RULES

The gateway is ``--gateway URL`` (default ``$AGL_GATEWAY_URL``, else
http://127.0.0.1:8000), the admin token ``$AGL_ADMIN_TOKEN`` or ``--token-file``.
``--run DIR`` (a run folder) lets ``show`` say how the calls became samples under the
run's merge strategy, in its tokenizer's words, and ``scan`` flag where that merge broke.
A problem is one line on stderr, exit 2.

What a rollout's numbers mean (``ls``, ``--sort``, ``--min-reward``): those of its
current attempt, the one the trainer reads: ``reward`` its last reward event, ``turns``
its model calls, ``tokens`` the response tokens they sampled, ``duration`` from its start
to its end (shown to now while it runs; sorted last until it ends). ``step`` is the
training step whose metrics the rollout is in: ``metadata.step`` (validation), else
``metadata.batch`` + 1 (sync training trains batch ``b`` at step ``b + 1``; async may
train it later). ``ls`` reads them from the gateway's store (``/api/summaries``), which
keeps them as events arrive and filters and sorts there; ``export`` and ``scan`` read
every event anyway and select with the same rules.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx

from agl.core.client import AsyncGatewayClient, GatewayError
from agl.core.contracts.queries import RolloutRow, SortKey, SummaryQuery, Transition
from agl.core.contracts.records import Event, Rollout, Status
from agl.core.contracts.samples import BreakReason, ModelCall
from agl.core.run.errors import UserError
from agl.core.trainer.calls import dedup, read_calls, shown_messages
from agl.core.trainer.explain import BreakDetail, Explanation, explain

T = TypeVar("T")
Rule = Callable[[Rollout, list[Event]], list[str]]

DEFAULT_GATEWAY = "http://127.0.0.1:8000"
DEFAULT_PATTERNS = (r"\bgit\s+log\b", r"\bcurl\b", r"\bwget\b")
PAGE = 200  # rollouts per page: what export and scan hold at a time, with their events
LS_PAGE = 1000  # rows per /api/summaries call: the gateway's most
CONCURRENCY = 16  # event reads in flight
TEXT_LIMIT = 240  # characters of a message shown by show without --full
SORT_KEYS = tuple(k.value for k in SortKey if k is not SortKey.CREATED)  # the default order


# ---------------------------------------------------------------------- selecting rollouts


@dataclass(frozen=True)
class Filters:
    statuses: tuple[Status, ...] = ()
    mode: str | None = None
    group: str | None = None
    step: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None

    def keeps_record(self, rollout: Rollout) -> bool:
        """What the record alone decides (the gateway filters status, mode and group)."""
        return self.step is None or step_of(rollout) == self.step

    def keeps_reward(self, reward: float | None) -> bool:
        if self.min_reward is None and self.max_reward is None:
            return True
        if reward is None:
            return False
        low = -math.inf if self.min_reward is None else self.min_reward
        high = math.inf if self.max_reward is None else self.max_reward
        return low <= reward <= high


def step_of(rollout: Rollout) -> int | None:
    """The training step whose metrics the rollout is in (module docstring), from the
    metadata the trainer gives it; None for rollouts made otherwise. The store's rule
    (``SummaryQuery.step``), which ``ls --step`` uses: JSON integers only, not booleans."""
    step, batch = rollout.metadata.get("step"), rollout.metadata.get("batch")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    if isinstance(batch, int) and not isinstance(batch, bool):
        return batch + 1
    return None


def of_attempt(events: Iterable[Event], attempt: int) -> list[Event]:
    return sorted((e for e in events if e.attempt == attempt), key=lambda e: e.sequence)


def fields(event: Event) -> dict[str, Any]:
    """An event's data as a mapping: agents write events too, not always well formed."""
    return event.data if isinstance(event.data, dict) else {}


def count(value: Any) -> int:
    return len(value) if isinstance(value, list) else 0


def reward_of(events: Sequence[Event], attempt: int) -> float | None:
    """The attempt's last reward, as the trainer counts it."""
    rewards = [fields(e) for e in of_attempt(events, attempt) if e.type == "reward"]
    value = rewards[-1].get("value") if rewards else None
    return float(value) if isinstance(value, int | float) else None


async def bounded(calls: Iterable[Awaitable[T]], limit: int = CONCURRENCY) -> list[T]:
    """``asyncio.gather`` with at most ``limit`` awaitables running at once."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Awaitable[T]) -> T:
        async with gate:
            return await call

    return await asyncio.gather(*(one(c) for c in calls))


async def matching(
    client: AsyncGatewayClient, filters: Filters
) -> AsyncIterator[tuple[Rollout, list[Event]]]:
    """The rollouts that pass ``filters``, with all their events, a page at a time: at
    most ``PAGE`` rollouts' events are held at once, however many rollouts there are."""
    cursor: str | None = None
    while True:
        page, cursor = await client.list_rollouts_page(
            filters.statuses or None, filters.mode, filters.group, cursor, PAGE
        )
        page = [r for r in page if filters.keeps_record(r)]
        events = await bounded(client.get_events(r.rollout_id) for r in page)
        for rollout, evs in zip(page, events, strict=True):
            if filters.keeps_reward(reward_of(evs, rollout.attempt)):
                yield rollout, evs
        if cursor is None:
            return


# ------------------------------------------------------------------------------------ ls


HEADER = ["id", "group", "mode", "step", "status", "attempt", "reward", "turns", "tokens", "time"]


def row(item: RolloutRow, now: float) -> list[str]:
    """A table row: the store's numbers of the current attempt (none yet: no reward, no
    calls, no tokens) and the time from its start to its end, or to ``now``."""
    r, summary = item.rollout, item.summary
    step = step_of(r)
    reward = None if summary is None else summary.reward
    ended = r.ended_at or now
    return [
        r.rollout_id,
        r.group_id,
        r.mode,
        "-" if step is None else str(step),
        r.status.value,
        f"{r.attempt}/{r.max_attempts}",
        "-" if reward is None else f"{reward:g}",
        "0" if summary is None else str(summary.calls),
        "0" if summary is None else str(summary.tokens),
        "-" if r.started_at is None else f"{ended - r.started_at:.1f}s",
    ]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def summary_query(args: argparse.Namespace) -> SummaryQuery:
    """What ``ls`` asks the store for: the filters, and the sort (creation order without
    ``--sort``; rollouts without the value last either way, ties in creation order)."""
    f = filters(args)
    return SummaryQuery(
        statuses=frozenset(f.statuses),
        mode=f.mode,
        group_id=f.group,
        step=f.step,
        min_reward=f.min_reward,
        max_reward=f.max_reward,
        sort=SortKey(args.sort or SortKey.CREATED),
        descending=args.reverse,
    )


async def listed(
    client: AsyncGatewayClient, query: SummaryQuery, limit: int | None
) -> tuple[list[RolloutRow], int]:
    """The first ``limit`` rows (all of them without one), a page at a time, and how many
    match in all."""
    rows: list[RolloutRow] = []
    while True:
        size = LS_PAGE if limit is None else min(LS_PAGE, limit - len(rows))
        page, total = await client.summaries(replace(query, offset=len(rows), limit=size))
        rows += page
        if len(page) < size or len(rows) >= (total if limit is None else min(total, limit)):
            return rows, total


async def cmd_ls(client: AsyncGatewayClient, args: argparse.Namespace, out: IO[str]) -> None:
    rows, total = await listed(client, summary_query(args), args.limit)
    now = time.time()
    print(table([HEADER, *(row(r, now) for r in rows)]), file=out)
    if args.limit is not None and total > args.limit:
        print(f"({args.limit} of {total} shown)", file=out)


# ---------------------------------------------------------------------------------- show


def short(text: str, full: bool) -> str:
    text = text.replace("\n", "\\n")
    return text if full or len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + "…"


def message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return json.dumps(message)
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = "" if content is None else str(content)
    for call in message.get("tool_calls") or ():
        text += " " + tool_call_text(call)
    return text.strip()


def tool_call_text(call: Any) -> str:
    function = call.get("function", call) if isinstance(call, dict) else {}
    if not isinstance(function, dict):
        return json.dumps(call)
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return f"{function.get('name', '?')}({arguments})"


def when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="milliseconds")


@dataclass(frozen=True)
class Requests:
    """An attempt's ``model_request`` events in order, numbered as they were made (``call
    i`` everywhere in this tool), and the calls the trainer reads from them."""

    events: list[Event]
    calls: list[ModelCall]  # the valid ones, before dedup
    number: dict[int, int]  # id(call) -> its call number (dedup keeps the very objects)
    left_out: dict[int, str]  # call number -> why the trainer leaves it out

    @classmethod
    def of(
        cls,
        events: Sequence[Event],
        attempt: int,
        decode: Callable[[list[int]], str] | None = None,
    ) -> Requests:
        """``decode``: the run's tokenizer, which the trainer checks ids against too."""
        requests = [e for e in of_attempt(events, attempt) if e.type == "model_request"]
        calls: list[ModelCall] = []
        number: dict[int, int] = {}
        left_out: dict[int, str] = {}
        for i, event in enumerate(requests):
            if not isinstance(event.data, dict):
                left_out[i] = "not an object"
                continue
            read = read_calls([event], decode)
            for call in read.calls:
                calls.append(call)
                number[id(call)] = i
            for reason in read.invalid:
                left_out[i] = reason
        return cls(requests, calls, number, left_out)

    def labels(self) -> dict[int, str]:
        """``call i`` per event sequence, and why it is not trained on, if it is not."""
        trained = {self.number[id(c)] for c in dedup(self.calls)}
        labels = {}
        for i, e in enumerate(self.events):
            why = f" (left out: {self.left_out[i]})" if i in self.left_out else ""
            if not why and i not in trained:
                why = " (retried: not trained)"
            labels[e.sequence] = f"call {i}{why}"
        return labels

    def explain(self, run: Any) -> Explained | str:
        """How the run's merge made samples of these calls, or why it could not."""
        try:
            x = explain(self.calls, run.merge(), run.decode_token())
        except ValueError as error:  # stitch without a tokenizer
            return f"cannot merge these calls: {error}"
        return Explained(x, [self.number[id(c)] for c in x.calls])


@dataclass(frozen=True)
class Explained:
    """An explanation and the call number of each deduplicated call it names."""

    explanation: Explanation
    numbers: list[int]


def explained(events: Sequence[Event], attempt: int, run: Any) -> Explained | str:
    return Requests.of(events, attempt, run.merge().decode).explain(run)


def seconds(value: Any) -> str:
    return f"{value:.2f} s" if isinstance(value, int | float) else "? s"


def show_event(event: Event, label: str, args: argparse.Namespace, out: IO[str]) -> None:
    data = fields(event)
    if event.type == "model_request":
        print(
            f"  {label}: policy v{data.get('policy_version', '?')}, "
            f"{data.get('finish_reason')}, {seconds(data.get('latency_s'))}, "
            f"{count(data.get('prompt_ids'))} prompt + "
            f"{count(data.get('response_ids'))} response tokens",
            file=out,
        )
        messages = shown_messages(data)
        tail = messages[-args.messages :] if args.messages else []
        if len(messages) > len(tail):
            print(f"      … {len(messages) - len(tail)} earlier messages", file=out)
        for m in tail:
            role = m.get("role", "?") if isinstance(m, dict) else "?"
            print(f"      {role}: {short(message_text(m), args.full)}", file=out)
        response = data.get("response")
        print(f"      → {short('' if response is None else str(response), args.full)}", file=out)
        for call in data.get("tool_calls") or ():
            print(f"      → tool call {short(tool_call_text(call), args.full)}", file=out)
    elif event.type == "model_request_failed":
        print(
            f"  failed call: {data.get('status')} after {seconds(data.get('latency_s'))}: "
            f"{short(str(data.get('error')), args.full)}",
            file=out,
        )
    elif event.type == "reward":
        print(f"  reward {data.get('value')}", file=out)
    else:
        print(f"  event {event.type}: {short(json.dumps(event.data), args.full)}", file=out)


def show_history(
    r: Rollout, transitions: Sequence[Transition], complete: bool, out: IO[str]
) -> None:
    """Every status change, as the store recorded it with the change."""
    print("history:", file=out)
    print(f"  {when(r.created_at)}  attempt 1  queuing (created)", file=out)
    if not complete:
        print("  (changes before this store kept them are not recorded)", file=out)
    for t in transitions:
        error = f": {t.error}" if t.error else ""
        print(f"  {when(t.time)}  attempt {t.attempt}  {t.status.value}{error}", file=out)


def show_record(r: Rollout, out: IO[str]) -> None:
    step = step_of(r)
    print(
        f"rollout {r.rollout_id}  group {r.group_id}  mode {r.mode}"
        + ("" if step is None else f"  step {step}"),
        file=out,
    )
    print(f"status {r.status.value}, attempt {r.attempt} of at most {r.max_attempts}", file=out)
    print(
        f"created {when(r.created_at)}, current attempt started {when(r.started_at)}, "
        f"ended {when(r.ended_at)}",
        file=out,
    )
    if r.error:
        print(f"error: {r.error}", file=out)
    print(f"input: {json.dumps(r.input)}", file=out)
    if r.metadata:
        print(f"metadata: {json.dumps(r.metadata)}", file=out)


CAUSES = {
    BreakReason.INDEPENDENT: "the strategy never merges",
    BreakReason.HISTORY_REWRITTEN: "earlier history changed (template, summary, a subagent)",
}


def cause(b: BreakDetail) -> str:
    if b.reason is not BreakReason.RESPONSE_RETOKENIZED:
        return CAUSES[b.reason]
    if b.same_text:
        return "the response came back as the same text, tokenized differently"
    return "the response came back changed (reserialized, trimmed, its <think> dropped)"


def spell(pieces: Sequence[str]) -> str:
    """Tokens as ``␣h|aving``: pieces joined by ``|``, whitespace made visible."""
    visible = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥"})
    return "|".join(p.translate(visible) for p in pieces)


def side_by_side(a: list[str], b: list[str], a_ids: list[int], b_ids: list[int]) -> list[str]:
    """Two token windows as ``shared|context [diff|ering]``."""
    k = 0
    while k < min(len(a_ids), len(b_ids)) and a_ids[k] == b_ids[k]:
        k += 1
    return [f"{spell(x[:k])} [{spell(x[k:])}]" for x in (a, b)]


def show_explanation(e: Explained, merge_name: str, attempt: int, out: IO[str]) -> None:
    x, number = e.explanation, e.numbers
    dropped = f", {x.duplicates_dropped} retried dropped" if x.duplicates_dropped else ""
    print(
        f"\nsamples (merge {merge_name}, attempt {attempt}): {len(x.samples)} from "
        f"{len(x.calls)} calls{dropped}",
        file=out,
    )
    for s in x.samples:
        calls = ",".join(str(number[c]) for c in s.calls)
        reason = "" if s.break_reason is None else f"  after a break: {s.break_reason.value}"
        print(
            f"  sample {s.index}: calls {calls}, {s.tokens} tokens, {s.actions} actions{reason}",
            file=out,
        )
    for b in x.breaks:
        print(
            f"  break before sample {b.sample}: call {number[b.call]}'s prompt left the "
            f"previous sequence at token {b.at} ({b.reason.value})\n      {cause(b)}",
            file=out,
        )
        previous, prompt = side_by_side(b.before, b.after, b.before_ids, b.after_ids)
        print(f"      previous: {previous}\n      prompt:   {prompt}", file=out)
    for st in x.stitches:
        print(
            f"  stitched: call {number[st.call]} is trained under another prompt than it was "
            f"sampled under, from token {st.at}",
            file=out,
        )
        print(
            f"      recorded: {spell(st.recorded)}\n      trained:  {spell(st.trained)}", file=out
        )


async def cmd_show(client: AsyncGatewayClient, args: argparse.Namespace, out: IO[str]) -> None:
    run = None if args.run is None else load_run_folder(args.run)
    rollout = await client.get_rollout(args.rollout_id)
    transitions, complete = await client.transitions(args.rollout_id)
    events = await client.get_events(args.rollout_id)
    show_record(rollout, out)
    show_history(rollout, transitions, complete, out)
    for attempt in sorted({e.attempt for e in events} | {rollout.attempt}):
        evs = of_attempt(events, attempt)
        note = "" if attempt == rollout.attempt else " (not trained: a later attempt replaced it)"
        print(f"\nattempt {attempt}: {len(evs)} events{note}", file=out)
        decode = None if run is None else run.merge().decode
        labels = Requests.of(events, attempt, decode).labels()
        for e in evs:
            show_event(e, labels.get(e.sequence, ""), args, out)
    if run is None:
        print("\n(--run DIR: how these calls became samples under the run's merge)", file=out)
        return
    account = explained(events, rollout.attempt, run)
    if isinstance(account, str):
        print(f"\nsamples: {account}", file=out)
        return
    show_explanation(account, run.choices["merge"], rollout.attempt, out)


def load_run_folder(folder: str) -> Any:
    """The run (``agl.core.run.folder`` loads torch and the tokenizer: only when asked)."""
    from agl.core.run.folder import RunFolderError, load_run

    try:
        return load_run(folder)
    except RunFolderError as error:
        raise UserError(str(error)) from None


# -------------------------------------------------------------------------------- export


def export_line(rollout: Rollout, events: list[Event]) -> str:
    # The attempt key is a credential of the agent: it stays out of files.
    record = rollout.model_dump(mode="json", exclude={"attempt_key", "report_key"})
    return json.dumps({"rollout": record, "events": [e.model_dump(mode="json") for e in events]})


async def cmd_export(client: AsyncGatewayClient, args: argparse.Namespace, out: IO[str]) -> None:
    try:
        target = sys.stdout if args.output == "-" else open(args.output, "w")  # noqa: SIM115
    except OSError as error:
        raise UserError(f"cannot write {args.output}: {error.strerror}") from None
    written = 0
    try:
        async for rollout, events in matching(client, filters(args)):
            target.write(export_line(rollout, events) + "\n")
            written += 1
    finally:
        if target is not sys.stdout:
            target.close()
    print(f"exported {written} rollouts to {args.output}", file=sys.stderr)


# ---------------------------------------------------------------------------------- scan


def model_calls(events: Sequence[Event]) -> Iterable[tuple[str, Event]]:
    """``model_request`` events with a name like ``attempt 1 call 2`` (in call order)."""
    for attempt in sorted({e.attempt for e in events}):
        requests = [e for e in of_attempt(events, attempt) if e.type == "model_request"]
        for i, e in enumerate(requests):
            yield f"attempt {attempt} call {i}", e


def command_rule(patterns: Sequence[str]) -> Rule:
    """Flags a response or tool call that matches one of ``patterns`` (regular
    expressions): an agent reaching for the answer (``git log``) or the network."""
    compiled = [re.compile(p) for p in patterns]

    def commands(rollout: Rollout, events: list[Event]) -> list[str]:
        reasons = []
        for name, e in model_calls(events):
            data = fields(e)
            texts = [("response", str(data.get("response") or ""))]
            texts += [("tool call", tool_call_text(c)) for c in data.get("tool_calls") or ()]
            for where, text in texts:
                for pattern in compiled:
                    found = pattern.search(text)
                    if found:
                        reasons.append(f"{name}: {found.group(0)!r} in its {where}")
        return reasons

    return commands


def repeated_call(rollout: Rollout, events: list[Event]) -> list[str]:
    """The same messages sent twice in a row: an agent that does not take in the answer."""
    reasons = []
    previous: Event | None = None
    for name, e in model_calls(events):
        if (
            previous is not None
            and previous.attempt == e.attempt
            and fields(previous).get("messages") == fields(e).get("messages")
        ):
            reasons.append(f"{name}: the same messages as the call before")
        previous = e
    return reasons


def cut_at_max_tokens(rollout: Rollout, events: list[Event]) -> list[str]:
    return [
        f"{name}: cut at max tokens"
        for name, e in model_calls(events)
        if fields(e).get("finish_reason") == "length"
    ]


def reward_without_calls(rollout: Rollout, events: list[Event]) -> list[str]:
    """A reward in an attempt that made no model call: nothing the model did earned it."""
    reasons = []
    for attempt in sorted({e.attempt for e in events}):
        evs = of_attempt(events, attempt)
        if any(e.type == "reward" for e in evs) and not any(e.type == "model_request" for e in evs):
            reasons.append(
                f"attempt {attempt}: reward {reward_of(evs, attempt)} with no model call"
            )
    return reasons


def failed_call(rollout: Rollout, events: list[Event]) -> list[str]:
    failed = [
        e for e in sorted(events, key=lambda e: e.sequence) if e.type == "model_request_failed"
    ]
    return [
        f"attempt {e.attempt}: a call failed ({fields(e).get('status')}: "
        f"{short(str(fields(e).get('error')), False)})"
        for e in failed
    ]


def merge_breaks(run: Any) -> Rule:
    """With ``--run``: where the run's merge strategy split the trained attempt, and the
    calls it trained under another prompt than they were sampled under (stitch)."""
    name = run.choices["merge"]

    def breaks(rollout: Rollout, events: list[Event]) -> list[str]:
        e = explained(events, rollout.attempt, run)
        if isinstance(e, str):
            return [f"{name}: {e}"]
        reasons = [
            f"{name} breaks before call {e.numbers[b.call]} ({b.reason.value}"
            + (", same text)" if b.same_text else ")")
            for b in e.explanation.breaks
            if b.reason is not BreakReason.INDEPENDENT
        ]
        stitched = e.explanation.stitches
        return reasons + [f"{name} stitched call {e.numbers[s.call]}" for s in stitched]

    return breaks


def load_rules(spec: str) -> list[Rule]:
    """``module:attr``: a rule, or a list of rules."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"--rules {spec!r}: expected module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UserError(f"--rules {spec!r}: cannot import {module_name!r}: {error}") from None
    found = getattr(module, attr, None)
    if found is None:
        raise UserError(f"--rules {spec!r}: {module_name!r} has no {attr!r}")
    rules = [found] if callable(found) else list(found)
    if not all(callable(r) for r in rules):
        raise UserError(f"--rules {spec!r}: not a rule or a list of rules")
    return rules


def apply(rule: Rule, rollout: Rollout, events: list[Event]) -> list[str]:
    try:
        return [str(reason) for reason in rule(rollout, events)]
    except Exception as error:  # a user's rule: say which and where, in one line
        name = getattr(rule, "__name__", repr(rule))
        raise UserError(f"rule {name} failed on {rollout.rollout_id}: {error!r}") from None


async def cmd_scan(client: AsyncGatewayClient, args: argparse.Namespace, out: IO[str]) -> None:
    try:
        commands = command_rule(args.pattern or DEFAULT_PATTERNS)
    except re.error as error:
        raise UserError(f"--pattern: not a regular expression: {error}") from None
    rules = [commands, repeated_call, cut_at_max_tokens, reward_without_calls, failed_call]
    if args.run is not None:
        rules.append(merge_breaks(load_run_folder(args.run)))
    for spec in args.rules:
        rules += load_rules(spec)
    scanned = flagged = 0
    async for rollout, events in matching(client, filters(args)):
        scanned += 1
        reasons = [reason for rule in rules for reason in apply(rule, rollout, events)]
        if reasons:
            flagged += 1
            print(f"{rollout.rollout_id}  {'; '.join(reasons)}", file=out)
    print(f"scanned {scanned} rollouts, flagged {flagged}", file=sys.stderr)


# ---------------------------------------------------------------------------------- main


def filters(args: argparse.Namespace) -> Filters:
    try:
        statuses = tuple(Status(s) for arg in args.status for s in arg.split(",") if s)
    except ValueError:
        known = ", ".join(s.value for s in Status)
        raise UserError(f"--status {','.join(args.status)}: choose from {known}") from None
    return Filters(
        statuses=statuses,
        mode=args.mode,
        group=args.group,
        step=args.step,
        min_reward=args.min_reward,
        max_reward=args.max_reward,
    )


def count_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--gateway", default=os.environ.get("AGL_GATEWAY_URL", DEFAULT_GATEWAY))
    common.add_argument("--token-file", help="admin token file (default: $AGL_ADMIN_TOKEN)")
    select = argparse.ArgumentParser(add_help=False)
    select.add_argument("--status", action="append", default=[], help="e.g. failed,running")
    select.add_argument("--mode", choices=("train", "val"))
    select.add_argument("--group")
    select.add_argument(
        "--step", type=int, help="val rollouts of this step, train rollouts of batch STEP-1"
    )
    select.add_argument("--min-reward", type=float)
    select.add_argument("--max-reward", type=float)
    main = argparse.ArgumentParser(
        prog="python -m agl.rollouts", description=__doc__.split("\n")[0]
    )
    sub = main.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", parents=[common, select], help="a table of rollouts")
    ls.add_argument("--sort", choices=SORT_KEYS, help="rollouts without the value come last")
    ls.add_argument(
        "-r", "--reverse", action="store_true", help="descending (newest first without --sort)"
    )
    ls.add_argument("--limit", type=count_arg, help="show the first N")
    show = sub.add_parser("show", parents=[common], help="one rollout, call by call")
    show.add_argument("rollout_id")
    show.add_argument("--run", help="the run folder: how the calls became samples")
    show.add_argument("--messages", type=int, default=2, help="last messages shown per call")
    show.add_argument("--full", action="store_true", help="do not shorten long texts")
    export = sub.add_parser("export", parents=[common, select], help="rollouts as JSON lines")
    export.add_argument("-o", "--output", required=True, help="FILE.jsonl, or - for stdout")
    scan = sub.add_parser("scan", parents=[common, select], help="flag suspicious rollouts")
    scan.add_argument("--pattern", action="append", default=[], help="regex (repeatable)")
    scan.add_argument("--run", help="the run folder: also flag where its merge breaks")
    scan.add_argument("--rules", action="append", default=[], help="module:RULES (repeatable)")
    return main


COMMANDS = {"ls": cmd_ls, "show": cmd_show, "export": cmd_export, "scan": cmd_scan}


def admin_token(args: argparse.Namespace) -> str:
    if args.token_file:
        try:
            return Path(args.token_file).read_text().strip()
        except OSError as error:
            raise UserError(f"cannot read {args.token_file}: {error.strerror}") from None
    token = os.environ.get("AGL_ADMIN_TOKEN")
    if not token:
        raise UserError("no admin token: set AGL_ADMIN_TOKEN or pass --token-file")
    return token


async def run(args: argparse.Namespace) -> None:
    # Few retries: a CLI should say at once that the gateway is not there.
    async with AsyncGatewayClient(args.gateway, admin_token(args), retries=2) as client:
        await COMMANDS[args.command](client, args, sys.stdout)


def describe(error: GatewayError, args: argparse.Namespace) -> str:
    if error.status == 401:
        return f"the gateway at {args.gateway} refused the admin token ({error.message})"
    return f"gateway {args.gateway}: {error.status}: {error.message}"


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(format="agl.rollouts: %(message)s", level=logging.WARNING)
    # The client's retries are no news: a gateway that stays away is one error line.
    logging.getLogger("agl.core.client").setLevel(logging.ERROR)
    try:
        asyncio.run(run(args))
    except UserError as error:
        fail(str(error))
    except GatewayError as error:
        fail(describe(error, args))
    except httpx.HTTPError as error:
        fail(f"cannot reach the gateway at {args.gateway}: {error or type(error).__name__}")
    except BrokenPipeError:  # ``| head``: the reader has what it wanted
        sys.stderr.close()
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def fail(message: str) -> None:
    sys.stderr.write(f"agl.rollouts: {message}\n")
    raise SystemExit(2)


if __name__ == "__main__":
    main()
