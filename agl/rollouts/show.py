"""``show``: one rollout, call by call: its record, every status change, each attempt's
events (the calls numbered, and why the trainer leaves one out), the agent's log (what
the controller recorded of a pod's, and with ``--run`` the run folder's), then, with
``--run``, how the run's merge strategy made samples of the calls and where it broke or
stitched. It prints through ``Visible`` (agl/rollouts/text.py): no control character of
a model's, an agent's or a log's text reaches the terminal raw."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import datetime
from typing import IO, Any

from agl.core.client import AsyncGatewayClient
from agl.core.contracts.execution import AGENT_LOG_EVENT
from agl.core.contracts.queries import Transition
from agl.core.contracts.records import Event, Rollout
from agl.core.contracts.samples import BreakReason
from agl.core.trainer.calls import shown_messages
from agl.core.trainer.explain import BreakDetail
from agl.rollouts.calls import Explained, Requests, explained, load_run_folder
from agl.rollouts.select import fields, of_attempt, step_of
from agl.rollouts.text import Visible, message_text, short, tool_call_text
from agl.ui.agentlog import LogPart, agent_log, recorded_logs


def count(value: Any) -> int:
    return len(value) if isinstance(value, list) else 0


def when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="milliseconds")


def seconds(value: Any) -> str:
    return f"{value:.2f} s" if isinstance(value, int | float) else "? s"


def show_event(event: Event, label: str, args: argparse.Namespace, out: Visible) -> None:
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
    elif event.type == AGENT_LOG_EVENT:
        print("  agent log recorded (below)", file=out)
    else:
        print(f"  event {event.type}: {short(json.dumps(event.data), args.full)}", file=out)


def show_agent_log(parts: Sequence[LogPart], lines: int, out: Visible) -> None:
    """Each part's last ``lines`` lines (0: all), with how it ended."""
    print("\nagent log:" if parts else "\nagent log: none recorded", file=out)
    for part in parts:
        note = f" ({part.note})" if part.note else ""
        print(f"  {part.source}{note}", file=out)
        shown = part.lines[-lines:] if lines else part.lines
        hidden = len(part.lines) - len(shown)
        if hidden:
            print(f"      … {hidden} earlier lines (--full shows them)", file=out)
        if part.truncated:
            print("      (cut when recorded: the log was longer)", file=out)
        for line in shown:
            print(f"      {line}", file=out)


def show_history(
    r: Rollout, transitions: Sequence[Transition], complete: bool, out: Visible
) -> None:
    """Every status change, as the store recorded it with the change."""
    print("history:", file=out)
    print(f"  {when(r.created_at)}  attempt 1  queuing (created)", file=out)
    if not complete:
        print("  (changes before this store kept them are not recorded)", file=out)
    for t in transitions:
        error = f": {t.error}" if t.error else ""
        print(f"  {when(t.time)}  attempt {t.attempt}  {t.status.value}{error}", file=out)


def show_record(r: Rollout, out: Visible) -> None:
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
    BreakReason.OUTPUT_TRANSFORMED: "the engine's text left out part of the response "
    "(a special token skipped, a stop string cut)",
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


def show_explanation(e: Explained, merge_name: str, attempt: int, out: Visible) -> None:
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


async def cmd_show(client: AsyncGatewayClient, args: argparse.Namespace, terminal: IO[str]) -> None:
    run = None if args.run is None else load_run_folder(args.run)
    rollout = await client.get_rollout(args.rollout_id)
    transitions, complete = await client.transitions(args.rollout_id)
    events = await client.get_events(args.rollout_id)
    out = Visible(terminal)
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
    parts = recorded_logs([e for e in events if e.type == AGENT_LOG_EVENT])
    if run is not None:
        parts += agent_log(run.folder, rollout.rollout_id, rollout.attempt)
    show_agent_log(parts, 0 if args.full else args.log_lines, out)
    if run is None:
        print(
            "\n(--run DIR: the run folder's agent log, and how these calls became samples "
            "under the run's merge)",
            file=out,
        )
        return
    account = explained(events, rollout.attempt, run)
    if isinstance(account, str):
        print(f"\nsamples: {account}", file=out)
        return
    show_explanation(account, run.choices["merge"], rollout.attempt, out)
