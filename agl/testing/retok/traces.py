"""Recorded calls of a simulated harness, with real retokenization drift and its ground truth.

``generate_rollout`` plays both sides of a harnessed rollout. The harness keeps a message
history and sends ``encode(render(history))`` as each prompt; the "model" samples an
output text and a segmentation of it (its ``response_ids``); the harness parses the
output as a serving stack would, appends it and an observation, and renders again. With
no mechanism on, every prompt continues the previous prompt and response token for token
(the paper's eq. 9). Each mechanism breaks that in its own way, through the real
tokenizer and template, and every transition is labelled with the mechanisms that acted
on it, so tests can check a merge strategy against the truth instead of re-deriving it.

Mechanisms:

- ``noncanonical``: the model samples a valid but non-canonical segmentation; the text
  is unchanged (eq. 8 holds) but re-encoding it gives other ids (eq. 11).
- ``think``: outputs carry ``<think>`` reasoning, which the template drops from the
  history once a user message follows (eq. 10).
- ``toolcall``: the model writes tool-call JSON with its own key order and spacing; the
  parser re-serializes it, so the history's text differs (output transformation).
- ``subagent``: a subagent with a fresh history (same system prompt, own task) makes
  calls interleaved with the main agent's.
- ``summary``: the harness replaces the main history by a summary message.
- ``retry``: the harness sends the same prompt again and keeps the second response (the
  merge layer's dedup keeps the last).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.core.contracts.samples import ModelCall
from agl.testing.retok import RetokTokenizer, load_tokenizer
from agl.testing.retok.make_tokenizer import (
    FUNCTIONS,
    IDENTIFIERS,
    PROSE_WORDS,
    TOOL_NAMES,
    code,
    json_text,
    prose,
)
from agl.testing.retok.template import (
    IM_START,
    Message,
    parse_assistant_output,
    render,
    render_assistant_output,
    tool_call_json,
)

MECHANISMS: frozenset[str] = frozenset(
    {"noncanonical", "think", "toolcall", "subagent", "summary", "retry"}
)

SYSTEM_PROMPT = "You are a coding agent. Use the tools to inspect and change the repository."

_TOOL_SPECS: dict[str, tuple[str, dict[str, str]]] = {
    "read_file": ("Read a file of the repository.", {"path": "string"}),
    "run_command": ("Run a shell command.", {"command": "string", "timeout": "integer"}),
    "search": ("Search the code.", {"query": "string", "max_results": "integer"}),
    "write_file": ("Write a file.", {"path": "string", "content": "string"}),
    "list_dir": ("List a directory.", {"path": "string"}),
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": _TOOL_SPECS[name][0],
            "parameters": {
                "type": "object",
                "properties": {p: {"type": t} for p, t in _TOOL_SPECS[name][1].items()},
                "required": list(_TOOL_SPECS[name][1]),
            },
        },
    }
    for name in TOOL_NAMES
]

# Words outside the tokenizer's corpus, so some text falls apart into short (byte) tokens.
_RARE_WORDS = ("naïve", "café", "façade", "→", "Zürich", "日本語", "λx", "résumé", "😀")


@dataclass(frozen=True)
class Rates:
    """Probabilities of the harness's and model's choices (mechanism ones apply when on)."""

    tool_call: float = 0.7  # an output calls tools (else the next observation is a user turn)
    noncanonical: float = 0.2  # an output is sampled with a non-canonical segmentation
    toolcall: float = 0.3  # a tool call's JSON is written non-canonically
    subagent: float = 0.1  # a main turn spawns a subagent (one is always spawned)
    summary: float = 0.05  # the harness summarizes before a main turn (at least once)
    retry: float = 0.1  # a call is sent again
    version_bump: float = 0.0  # the policy version advances before a call (async training)


@dataclass
class Trace:
    """One rollout as the proxy records it, plus the ground truth of how its calls relate.

    ``labels[i]`` names the mechanisms that acted on the transition from call ``i`` to
    call ``i + 1``; it is empty exactly when ``calls[i].prompt_ids + calls[i].response_ids``
    is a token prefix of ``calls[i + 1].prompt_ids``. ``prev[j]`` is the call whose
    conversation call ``j`` continues (-1 when it starts one), and ``drift[j]`` the
    mechanisms that acted between them, which matters once subagent calls interleave.
    """

    calls: list[ModelCall]
    messages: list[list[Message]]
    prompt_texts: list[str]
    response_texts: list[str]
    agents: list[str]
    prev: list[int]
    drift: list[frozenset[str]]
    labels: list[frozenset[str]]
    mechanisms: frozenset[str]
    tools: list[dict[str, Any]] = field(default_factory=lambda: TOOLS)
    rollout_id: str = "rollout-0"
    group_id: str = "group-0"

    def token_prefix_holds(self, i: int) -> bool:
        """Eq. 9 between calls ``i`` and ``i + 1``."""
        a, b = self.calls[i], self.calls[i + 1]
        return is_prefix(a.prompt_ids + a.response_ids, b.prompt_ids)

    def text_prefix_holds(self, i: int) -> bool:
        """Eq. 8 between calls ``i`` and ``i + 1``."""
        return self.prompt_texts[i + 1].startswith(self.prompt_texts[i] + self.response_texts[i])


def is_prefix(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) <= len(b) and list(b[: len(a)]) == list(a)


@dataclass
class _Conversation:
    """One agent's history as the harness holds it."""

    agent: str
    messages: list[Message]
    remaining: int
    last_call: int = -1
    pending: set[str] = field(default_factory=set)  # mechanisms acting on its next transition


@dataclass
class _Recorder:
    """The calls so far, in the order the proxy saw them; prompts are encoded at the end."""

    prompt_texts: list[str] = field(default_factory=list)
    response_texts: list[str] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[list[Message]] = field(default_factory=list)
    agents: list[str] = field(default_factory=list)
    prev: list[int] = field(default_factory=list)
    drift: list[frozenset[str]] = field(default_factory=list)
    retry_of_previous: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class _Output:
    text: str
    ids: list[int]
    flags: frozenset[str]  # mechanisms this output itself triggered (noncanonical, toolcall)


def _words(rng: random.Random, n: int) -> str:
    pool = PROSE_WORDS if rng.random() < 0.9 else _RARE_WORDS
    return " ".join(rng.choice(pool) for _ in range(n))


def _content(rng: random.Random) -> str:
    """Assistant prose, code or JSON.

    Never starting with whitespace: BPE would merge a leading newline with the one after
    ``assistant``, breaking eq. 9 with no mechanism to blame (test_retok shows it).
    """
    kind = rng.random()
    if kind < 0.5:
        text = prose(rng, rng.randint(1, 3))
        if rng.random() < 0.3:
            text += f" ({_words(rng, 2)})"
        return text
    if kind < 0.8:
        return f"{prose(rng, 1)}\n\n```python\n{code(rng, rng.randint(2, 6))}\n```"
    return json_text(rng)


def _tool_arguments(rng: random.Random, name: str) -> dict[str, Any]:
    path = f"src/{rng.choice(IDENTIFIERS)}/{rng.choice(FUNCTIONS)}.py"
    if name == "read_file" or name == "list_dir":
        return {"path": path}
    if name == "run_command":
        return {"command": f"pytest -q tests/test_{rng.choice(IDENTIFIERS)}.py", "timeout": 60}
    if name == "search":
        return {"query": _words(rng, rng.randint(1, 3)), "max_results": rng.randint(1, 20)}
    return {"path": path, "content": code(rng, rng.randint(1, 4))}


def _messy_json(rng: random.Random, name: str, arguments: dict[str, Any]) -> str:
    """Tool-call JSON as a model may write it: reordered keys, odd spacing, indentation."""
    canonical = tool_call_json(name, arguments)
    while True:
        obj: dict[str, Any] = {"name": name, "arguments": arguments}
        if rng.random() < 0.5:
            obj = {"arguments": arguments, "name": name}
        style = rng.randrange(3)
        if style == 0:
            text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        elif style == 1:
            text = json.dumps(obj, ensure_ascii=False, separators=(" , ", " : "))
        else:
            text = json.dumps(obj, ensure_ascii=False, indent=rng.choice([1, 2]))
        if text != canonical:
            return text


def _sample_output(
    rng: random.Random, tok: RetokTokenizer, mechanisms: frozenset[str], rates: Rates
) -> _Output:
    """The model's turn: an output text and the token ids it was sampled as."""
    reasoning = prose(rng, rng.randint(1, 3)) if "think" in mechanisms else None
    calls_tools = rng.random() < rates.tool_call
    content = _content(rng) if not calls_tools or rng.random() < 0.5 else ""
    flags: set[str] = set()
    tool_calls: list[str] = []
    if calls_tools:
        messy = "toolcall" in mechanisms and rng.random() < rates.toolcall
        for _ in range(2 if rng.random() < 0.2 else 1):
            name = rng.choice(TOOL_NAMES)
            arguments = _tool_arguments(rng, name)
            raw = _messy_json(rng, name, arguments) if messy else tool_call_json(name, arguments)
            tool_calls.append(raw)
        if messy:
            flags.add("toolcall")
    text = render_assistant_output(content, reasoning, tool_calls)
    ids = tok.encode(text)
    resample = "noncanonical" in mechanisms and rng.random() < rates.noncanonical
    if resample and tok.splittable(ids):
        ids = tok.resegment(ids, rng, splits=rng.randint(1, 3))
        flags.add("noncanonical")
    return _Output(text, ids, frozenset(flags))


def _observe(rng: random.Random, conv: _Conversation, message: Message) -> None:
    """Append the parsed output and what comes back: tool results, or a user turn."""
    history = conv.messages
    history.append(message)
    if message.get("tool_calls"):
        for _ in message["tool_calls"]:
            result = rng.choice((prose(rng, 2), code(rng, 4), json_text(rng)))
            history.append({"role": "tool", "content": result})
        return
    # A user turn is what makes the template drop the reasoning shown since the last one.
    last_user = max(i for i, m in enumerate(history) if m["role"] == "user")
    if any(m.get("reasoning_content") for m in history[last_user + 1 :]):
        conv.pending.add("think")
    history.append({"role": "user", "content": f"Thanks. Now {_words(rng, 6)}."})


def _new_conversation(agent: str, task: str, remaining: int) -> _Conversation:
    system = {"role": "system", "content": SYSTEM_PROMPT}
    return _Conversation(agent, [system, {"role": "user", "content": task}], remaining)


def _summarize(rng: random.Random, conv: _Conversation, task: str) -> None:
    summary = f"Summary of the work so far: {prose(rng, 2)}\n\nContinue with the task: {task}"
    conv.messages = [conv.messages[0], {"role": "user", "content": summary}]
    conv.pending = {"summary"}  # the old history is gone, so nothing else acts on this step


def _record_call(
    rec: _Recorder,
    rng: random.Random,
    conv: _Conversation,
    prompt_text: str,
    output: _Output,
    version: int,
    retry: bool,
) -> None:
    rec.prompt_texts.append(prompt_text)
    rec.response_texts.append(output.text)
    rec.response_ids.append(output.ids)
    rec.logprobs.append([-rng.expovariate(2.0) - 1e-4 for _ in output.ids])
    rec.versions.append(version)
    rec.messages.append(list(conv.messages))
    rec.agents.append(conv.agent)
    rec.prev.append(conv.last_call)
    rec.drift.append(frozenset(conv.pending) if conv.last_call >= 0 else frozenset())
    rec.retry_of_previous.append(retry)


_BLOCK_START = re.compile(r"(?=" + re.escape(IM_START) + ")")


def _encode_prompts(tok: RetokTokenizer, texts: Sequence[str]) -> list[list[int]]:
    """``[tok.encode(t) for t in texts]``, encoding each message block once per rollout.

    Exact, not an approximation: the tokenizer cuts special tokens out before it
    pre-tokenizes, so text split just before an ``<|im_start|>`` encodes to the
    concatenation of its parts' encodings. Re-encoding whole prompts instead would make
    trace generation quadratic in the number of turns (tests compare against full encodes).
    """
    blocks = [[b for b in _BLOCK_START.split(t) if b] for t in texts]
    unique = list(dict.fromkeys(b for bs in blocks for b in bs))
    ids = dict(zip(unique, tok.encode_batch(unique), strict=True))
    return [[i for b in bs for i in ids[b]] for bs in blocks]


def _transition_labels(rec: _Recorder) -> list[frozenset[str]]:
    labels = []
    for j in range(1, len(rec.prompt_texts)):
        if rec.retry_of_previous[j]:
            labels.append(frozenset({"retry"}))
        elif rec.prev[j] == j - 1:
            labels.append(rec.drift[j])
        else:
            labels.append(frozenset({"subagent"}))
    return labels


@dataclass
class _Harness:
    """The simulated harness's state across one rollout."""

    rng: random.Random
    tok: RetokTokenizer
    mech: frozenset[str]
    rates: Rates
    task: str
    main: _Conversation
    version: int
    spawn_after: int  # the main turn after which a subagent is surely spawned (-1: none)
    summary_at: int  # the main turn before which the history is surely summarized
    active: list[_Conversation] = field(default_factory=list)
    turn: int = 0  # main-agent turns done (a retried call is one turn)
    subagents: int = 0
    rec: _Recorder = field(default_factory=_Recorder)

    def step(self, conv: _Conversation) -> None:
        """One call of ``conv`` (twice if retried), then the harness's reaction to it."""
        rng = self.rng
        if conv is self.main and self.turn > 0:
            self._maybe_summarize()
        prompt_text = render(conv.messages, TOOLS)
        attempts = 2 if "retry" in self.mech and rng.random() < self.rates.retry else 1
        for attempt in range(attempts):
            if rng.random() < self.rates.version_bump:
                self.version += 1
            output = _sample_output(rng, self.tok, self.mech, self.rates)
            _record_call(self.rec, rng, conv, prompt_text, output, self.version, attempt > 0)
        conv.last_call = len(self.rec.prompt_texts) - 1
        conv.pending = set(output.flags)
        _observe(rng, conv, parse_assistant_output(output.text))
        conv.remaining -= 1
        if conv.remaining == 0:
            self.active.remove(conv)
        if conv is self.main:
            self._maybe_spawn()
            self.turn += 1

    def _maybe_summarize(self) -> None:
        if "summary" not in self.mech:
            return
        if self.turn == self.summary_at or self.rng.random() < self.rates.summary:
            _summarize(self.rng, self.main, self.task)

    def _maybe_spawn(self) -> None:
        if "subagent" not in self.mech or len(self.active) >= 3:
            return
        if self.turn == self.spawn_after or self.rng.random() < self.rates.subagent:
            self.subagents += 1
            task = f"You are subagent {self.subagents}. Find out: {prose(self.rng, 1)}"
            calls = self.rng.randint(1, 3)
            self.active.append(_new_conversation(f"sub{self.subagents}", task, calls))


def generate_rollout(
    rng: random.Random,
    mechanisms: Collection[str],
    turns: int,
    *,
    rates: Rates | None = None,
    tokenizer: RetokTokenizer | None = None,
    policy_version: int = 0,
    rollout_id: str = "rollout-0",
    group_id: str = "group-0",
) -> Trace:
    """Simulate one rollout: ``turns`` main-agent calls, plus subagent calls and retries.

    Everything is drawn from ``rng``, so a seeded generator gives the same trace. Agents
    take turns at random, so a subagent's calls interleave with the main agent's.
    """
    mech = frozenset(mechanisms)
    if mech - MECHANISMS:
        unknown = sorted(mech - MECHANISMS)
        raise ValueError(f"unknown mechanisms {unknown}; known: {sorted(MECHANISMS)}")
    if turns < 1:
        raise ValueError("a rollout needs at least one turn")
    tok = tokenizer or load_tokenizer()
    task = f"Task: {prose(rng, rng.randint(1, 3))}"
    main = _new_conversation("main", task, turns)
    # One subagent and one summary are forced, so a rollout with room always shows them.
    harness = _Harness(
        rng=rng,
        tok=tok,
        mech=mech,
        rates=rates or Rates(),
        task=task,
        main=main,
        version=policy_version,
        spawn_after=rng.randrange(turns) if "subagent" in mech else -1,
        summary_at=rng.randrange(1, turns) if "summary" in mech and turns >= 2 else -1,
        active=[main],
    )
    while harness.active:
        harness.step(rng.choice(harness.active))
    rec = harness.rec
    prompt_ids = _encode_prompts(tok, rec.prompt_texts)
    columns = zip(prompt_ids, rec.response_ids, rec.logprobs, rec.versions, strict=True)
    return Trace(
        calls=[ModelCall(p, r, lp, v) for p, r, lp, v in columns],
        messages=rec.messages,
        prompt_texts=rec.prompt_texts,
        response_texts=rec.response_texts,
        agents=rec.agents,
        prev=rec.prev,
        drift=rec.drift,
        labels=_transition_labels(rec),
        mechanisms=mech,
        rollout_id=rollout_id,
        group_id=group_id,
    )


def generate_traces(
    seed: int,
    n_rollouts: int,
    mechanisms: Collection[str],
    turns_range: tuple[int, int] = (4, 12),
    *,
    rates: Rates | None = None,
    group_size: int = 8,
) -> list[Trace]:
    """Many rollouts for a benchmark; rollout ``k`` is in group ``k // group_size``.

    Each rollout draws from its own generator seeded from ``seed``, so a rollout does not
    change when another one's parameters do.
    """
    master = random.Random(seed)
    traces = []
    for k in range(n_rollouts):
        rng = random.Random(master.getrandbits(64))
        turns = rng.randint(*turns_range)
        traces.append(
            generate_rollout(
                rng,
                mechanisms,
                turns,
                rates=rates,
                rollout_id=f"rollout-{k}",
                group_id=f"group-{k // group_size}",
            )
        )
    return traces
