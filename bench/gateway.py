"""Gateway benchmark: proxied chat calls and event POSTs, agl vs the reference gateway.

One run, one machine, one fake vLLM-shaped upstream shared by every target, so the
numbers to read are the ratios side by side:

- direct: agents call the upstream themselves (the floor);
- agl: through ``python -m agl.gateway`` (SQLite store, every call committed before
  its answer is sent);
- reference: through Agent Lightning 1.0.2's ``agl-server`` (in-memory store), in its own
  Python 3.12 venv (made on first use).

The prompt-length rows (``--prompt-tokens``) run coding agents through agl alone: each
agent's conversation starts near N tokens and every call's prompt is the last prompt,
its answer and a tool's output of N/100 tokens (30 calls, then a new conversation), from
a fake upstream whose tokens are 4 bytes of text and whose prompt ids really extend. They
print the gateway's CPU per call and its ratio to the first row's. The storage row runs
extending 30-call rollouts (2k tokens, then 300-token tool outputs) and prints the bytes
the store grew per distinct token, stored by what each call adds and, with the gateway's
prompt cache off (``prompt_cache_mb=0``), whole.

    python -m bench.gateway                       # 1, 16, 64 agents, 5 s each
    python -m bench.gateway --seconds 3 --no-reference
    python -m bench.gateway --concurrency 64 --prompt-tokens 1000,32000 --no-reference
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp
import orjson

from agl.core.client import GatewayClient, proxy_base_url
from agl.testing.processes import free_port, gateway_process, wait_healthy
from bench.reference_gateway import ensure_reference_venv, start_reference_gateway
from bench.tables import table

REFERENCE_VENV = Path(
    os.environ.get("AGL_REFERENCE_VENV", Path(tempfile.gettempdir()) / "agl-ref-venv")
)


class Caller(Protocol):
    """One agent's calls: the body of its n-th call, told each answer it gets."""

    def body(self, n: int) -> bytes: ...

    def answered(self, payload: bytes) -> None:
        """An answer (status < 300) to the last body."""


@dataclass(frozen=True)
class Stateless:
    """An agent whose calls do not depend on the answers."""

    make: Callable[[int], bytes]

    def body(self, n: int) -> bytes:
        return self.make(n)

    def answered(self, payload: bytes) -> None:
        pass


@dataclass(frozen=True)
class Target:
    """One way to make a call: a URL per agent, headers per agent, a caller per agent."""

    name: str
    urls: list[str]
    headers: list[dict[str, str]]
    caller: Callable[[int], Caller]
    pid: int | None  # the process whose CPU time is charged to the target


@dataclass(frozen=True)
class Result:
    calls: int
    seconds: float
    latencies: list[float]
    errors: int
    cpu_s: float | None

    @property
    def rate(self) -> float:
        return self.calls / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0

    @property
    def cpu_ms_per_call(self) -> float | None:
        return None if self.cpu_s is None or not self.calls else self.cpu_s / self.calls * 1000


def cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(target: Target, agents: int, seconds: float, warmup_s: float = 0.5) -> Result:
    """``agents`` concurrent loops, each sending its next call when the last one answered."""
    connector = aiohttp.TCPConnector(limit=0)
    latencies: list[float] = []
    errors = 0
    measuring = False
    callers = [target.caller(i) for i in range(agents)]
    sent = [0] * agents
    async with aiohttp.ClientSession(connector=connector) as session:

        async def agent(i: int, stop_at: float) -> None:
            nonlocal errors
            url, headers = target.urls[i], {**target.headers[i], "Content-Type": "application/json"}
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                body = callers[i].body(sent[i])
                async with session.post(url, data=body, headers=headers) as response:
                    payload = await response.read()
                    ok = response.status < 300
                if ok:
                    callers[i].answered(payload)
                if measuring:
                    if ok:
                        latencies.append(time.perf_counter() - started)
                    else:
                        errors += 1
                sent[i] += 1

        await asyncio.gather(*(agent(i, time.perf_counter() + warmup_s) for i in range(agents)))
        measuring = True
        cpu_before = cpu_seconds(target.pid)
        started = time.perf_counter()
        await asyncio.gather(*(agent(i, started + seconds) for i in range(agents)))
        elapsed = time.perf_counter() - started
        cpu_after = cpu_seconds(target.pid)
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return Result(len(latencies), elapsed, latencies, errors, cpu)


def chat_body(agent_text: str) -> Callable[[int], Caller]:
    def body(n: int) -> bytes:
        return orjson.dumps(
            {
                "model": "policy",
                "max_tokens": 32,
                "messages": [
                    {"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": f"{agent_text} question {n}"},
                ],
            }
        )

    return lambda i: Stateless(body)


# The prompt-length rows' upstream: a token is this many bytes of text (a real
# tokenizer's ~4), so a prompt's messages are as large as a real one's.
TOKEN_BYTES = 4
CONVERSATION_CALLS = 30
# The text of the first message all of a run's conversations share (a coding agent's
# system prompt and repository map) and of tool outputs: 450 KB, over 100k tokens.
_FILLER = "".join(
    f"line {i:06d} of the repository map: src/module_{i % 97}.py\n" for i in range(8192)
)


@dataclass
class Conversation:
    """A coding agent: a conversation starts with a first message of ``start_tokens``
    (the system prompt all agents share) and the agent's task; each answer is followed by
    a tool's output of ``tool_tokens``; after ``calls`` calls a new conversation starts
    (a prompt that extends nothing earlier: parsed, checked and stored whole)."""

    agent: int
    start_tokens: int
    tool_tokens: int
    calls: int = CONVERSATION_CALLS
    messages: list[dict[str, str]] = field(default_factory=list)
    made: int = 0  # calls made in this conversation
    conversations: int = 0
    distinct_tokens: int = 0  # of every conversation's last prompt and answer, in total

    def body(self, n: int) -> bytes:
        if not self.messages or self.made >= self.calls:
            self.messages = [
                {"role": "system", "content": _text(self.start_tokens)},
                {"role": "user", "content": f"agent {self.agent} task {self.conversations}"},
            ]
            self.made = 0
            self.conversations += 1
        self.made += 1
        return orjson.dumps({"model": "policy", "max_tokens": 32, "messages": self.messages})

    def answered(self, payload: bytes) -> None:
        answer = orjson.loads(payload)
        content = answer["choices"][0]["message"]["content"]
        usage = answer["usage"]
        if self.made == self.calls:
            self.distinct_tokens += usage["prompt_tokens"] + usage["completion_tokens"]
        output = f"tool output {self.agent}.{self.conversations}.{self.made}: "
        self.messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": output + _text(self.tool_tokens)[len(output) :]},
        ]


def _text(tokens: int) -> str:
    """About ``tokens`` tokens of text at ``TOKEN_BYTES`` bytes a token."""
    size = tokens * TOKEN_BYTES
    return (_FILLER * (size // len(_FILLER) + 1))[:size]


def conversations(tokens: int) -> Callable[[int], Caller]:
    """Agents whose prompts average about ``tokens`` (see :class:`Conversation`)."""
    tool = max(8, tokens // 100)
    answer = 10  # about what the fake answers, in tokens
    start = max(16, tokens - CONVERSATION_CALLS // 2 * (tool + answer))
    return lambda i: Conversation(i, start, tool)


@contextlib.contextmanager
def fake_upstream(token_bytes: int = 1) -> Iterator[tuple[str, int]]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agl.testing.fake_vllm",
            f"port={port}",
            f"token_bytes={token_bytes}",
        ]
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/v1/models", process)
        yield f"http://127.0.0.1:{port}/v1", process.pid
    finally:
        process.terminate()
        process.wait(timeout=10)


def agl_chat(
    gw_url: str,
    token: str,
    upstream: str,
    pid: int | None,
    agents: int,
    caller: Callable[[int], Caller],
) -> tuple[Target, list[str]]:
    """A target of ``agents`` new running rollouts of one gateway, and their ids."""
    with GatewayClient(gw_url, token) as admin:
        admin.register_models([{"model": "policy", "endpoint": upstream, "policy_version": 1}])
        run = f"bench-{time.time_ns()}"
        rollouts = admin.create_rollouts([{"rollout_id": f"{run}-{i}"} for i in range(agents)])
        rollouts = [admin.patch_rollout(r.rollout_id, "running") for r in rollouts]
    chat = Target(
        "agl",
        [proxy_base_url(gw_url, r.rollout_id, 1) + "/chat/completions" for r in rollouts],
        [{"Authorization": f"Bearer {r.attempt_key}"} for r in rollouts],
        caller,
        pid,
    )
    return chat, [r.rollout_id for r in rollouts]


def agl_targets(
    gw_url: str, token: str, upstream: str, pid: int, agents: int
) -> tuple[Target, Target]:
    chat, ids = agl_chat(gw_url, token, upstream, pid, agents, chat_body("agl"))
    with GatewayClient(gw_url, token) as admin:
        rollouts = [admin.get_rollout(r) for r in ids]
    event_urls = [f"{gw_url}/api/rollouts/{r.rollout_id}/attempt/1/events" for r in rollouts]
    events = Target(
        "agl",
        event_urls,
        [{"Authorization": f"Bearer {r.report_key}"} for r in rollouts],
        lambda i: Stateless(reward_body),
        pid,
    )
    return chat, events


def reward_body(n: int) -> bytes:
    return orjson.dumps({"type": "reward", "data": {"value": 1.0, "n": n}})


def titled(title: str, header: list[str], rows: list[list[str]]) -> str:
    return f"\n{title}\n{table(header, rows)}"


def run(seconds: float, concurrency: list[int], with_reference: bool) -> None:
    if with_reference:
        reference_python = ensure_reference_venv(REFERENCE_VENV)
    agents = max(concurrency)
    with (
        tempfile.TemporaryDirectory() as tmp,
        fake_upstream() as (upstream, upstream_pid),
        # Each load loop drives one attempt key flat out: the per-attempt limit off.
        gateway_process(Path(tmp) / "agl", attempt_rps=0) as gw,
        contextlib.ExitStack() as stack,
    ):
        chat, events = agl_targets(gw.url, gw.token, upstream, gw.process.pid, agents)
        direct = Target(
            "direct",
            [upstream + "/chat/completions"] * agents,
            [{}] * agents,
            chat_body("direct"),
            upstream_pid,
        )
        targets: list[tuple[Target, Target | None]] = [(direct, None), (chat, events)]
        if with_reference:
            ref = stack.enter_context(start_reference_gateway(reference_python, upstream))
            ids = ref.create_running_rollouts(agents)
            ref_chat = Target(
                "reference",
                [ref.proxy_chat_url(r, a) for r, a in ids],
                [ref.headers] * agents,
                chat_body("reference"),
                ref.process.pid,
            )
            ref_events = Target(
                "reference",
                [ref.events_url(r, a) for r, a in ids],
                [ref.headers] * agents,
                lambda i: Stateless(lambda n: orjson.dumps(ref.event_body(float(n)))),
                ref.process.pid,
            )
            targets.append((ref_chat, ref_events))

        results: dict[tuple[str, str, int], Result] = {}
        for c in concurrency:
            for chat_target, event_target in targets:
                results["chat", chat_target.name, c] = asyncio.run(load(chat_target, c, seconds))
                if event_target is not None and c > 1:
                    results["events", event_target.name, c] = asyncio.run(
                        load(event_target, c, seconds)
                    )
        report(results, concurrency, with_reference, seconds)


def prompt_lengths(seconds: float, lengths: list[int], agents: int) -> None:
    """The prompt-length rows: one gateway, coding agents at each length in turn."""
    rows: list[list[str]] = []
    first: float | None = None
    with (
        tempfile.TemporaryDirectory() as tmp,
        fake_upstream(TOKEN_BYTES) as (upstream, _),
        gateway_process(Path(tmp) / "agl", attempt_rps=0) as gw,
    ):
        for tokens in lengths:
            target, _ = agl_chat(
                gw.url, gw.token, upstream, gw.process.pid, agents, conversations(tokens)
            )
            load_before = os.getloadavg()[0]
            r = asyncio.run(load(target, agents, seconds))
            cpu = r.cpu_ms_per_call or 0.0
            first = first or cpu
            rows.append(
                [
                    f"{tokens // 1000}k",
                    f"{r.rate:.0f}",
                    f"{r.pct(0.5):.2f}",
                    f"{cpu:.2f}",
                    f"{cpu / first:.2f}x",
                    str(r.errors),
                    f"{(load_before + os.getloadavg()[0]) / 2:.1f}",
                ]
            )
    print(
        titled(
            f"Prompt length ({agents} coding agents through agl, {seconds:.0f} s per row; "
            f"{os.cpu_count()} cores; CPU = the gateway process)",
            ["prompt", "calls/s", "p50 ms", "CPU ms/call", "vs first", "errors", "load"],
            rows,
        )
    )


STORAGE_ROLLOUTS = 8
STORAGE_START_TOKENS = 2000
STORAGE_TOOL_TOKENS = 300


def storage() -> None:
    """The storage row: extending 30-call rollouts, stored by what each call adds and,
    with the prompt cache off, whole; bytes the store grew per distinct token."""
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory() as tmp, fake_upstream(TOKEN_BYTES) as (upstream, _):
        for name, cache_mb in (("by what it adds", 256), ("whole (prompt_cache_mb=0)", 0)):
            with gateway_process(
                Path(tmp) / f"agl-{cache_mb}", attempt_rps=0, prompt_cache_mb=cache_mb
            ) as gw:
                callers = [
                    Conversation(i, STORAGE_START_TOKENS, STORAGE_TOOL_TOKENS)
                    for i in range(STORAGE_ROLLOUTS)
                ]
                target, _ = agl_chat(
                    gw.url, gw.token, upstream, None, STORAGE_ROLLOUTS, callers.__getitem__
                )
                before = store_bytes(gw.run_dir / "gateway.db")
                asyncio.run(converse(target, callers))
                grown = store_bytes(gw.run_dir / "gateway.db") - before
            distinct = sum(c.distinct_tokens for c in callers)
            rows.append([name, f"{grown / 2**20:.1f}", str(distinct), f"{grown / distinct:.1f}"])
    print(
        titled(
            f"Storage ({STORAGE_ROLLOUTS} rollouts of {CONVERSATION_CALLS} calls, each "
            f"prompt the last one, its answer and {STORAGE_TOOL_TOKENS} tokens; "
            f"{STORAGE_START_TOKENS} to start)",
            ["prompts stored", "store grew MiB", "distinct tokens", "bytes/distinct token"],
            rows,
        )
    )


async def converse(target: Target, callers: list[Conversation]) -> None:
    """Each caller's one conversation, every call answered before the next."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def agent(i: int) -> None:
            headers = {**target.headers[i], "Content-Type": "application/json"}
            for n in range(callers[i].calls):
                body = callers[i].body(n)
                async with session.post(target.urls[i], data=body, headers=headers) as response:
                    payload = await response.read()
                    if response.status >= 300:
                        raise RuntimeError(f"call {n} of agent {i}: {response.status} {payload!r}")
                callers[i].answered(payload)

        await asyncio.gather(*(agent(i) for i in range(len(callers))))


def store_bytes(path: Path) -> int:
    """The bytes a SQLite store's pages in use take (its WAL's committed pages counted)."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        pages, free, size = (
            db.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("page_count", "freelist_count", "page_size")
        )
    return int((pages - free) * size)


def report(
    results: dict[tuple[str, str, int], Result],
    concurrency: list[int],
    with_reference: bool,
    seconds: float,
) -> None:
    names = ["direct", "agl"] + (["reference"] if with_reference else [])
    rows = []
    for c in concurrency:
        base = results["chat", "direct", c]
        for name in names:
            r = results["chat", name, c]
            cpu = r.cpu_ms_per_call
            rows.append(
                [
                    str(c),
                    name,
                    f"{r.rate:.0f}",
                    f"{r.pct(0.5):.2f}",
                    f"{r.pct(0.99):.2f}",
                    "-" if name == "direct" else f"{r.pct(0.5) - base.pct(0.5):+.2f}",
                    "-" if cpu is None else f"{cpu:.2f}",
                    str(r.errors),
                ]
            )
    print(
        titled(
            f"Proxied chat calls ({seconds:.0f} s per cell; CPU = target process only)",
            [
                "agents",
                "target",
                "calls/s",
                "p50 ms",
                "p99 ms",
                "added p50 ms",
                "CPU ms/call",
                "errors",
            ],
            rows,
        )
    )
    rows = []
    for c in concurrency:
        if c == 1:
            continue
        for name in names[1:]:
            r = results["events", name, c]
            rows.append(
                [
                    str(c),
                    name,
                    f"{r.rate:.0f}",
                    f"{r.pct(0.5):.2f}",
                    f"{r.pct(0.99):.2f}",
                    f"{r.cpu_ms_per_call or 0:.2f}",
                    str(r.errors),
                ]
            )
    print(
        titled(
            "Event POSTs",
            ["agents", "target", "events/s", "p50 ms", "p99 ms", "CPU ms/event", "errors"],
            rows,
        )
    )
    if with_reference:
        rows = []
        for c in concurrency:
            ours, theirs = results["chat", "agl", c], results["chat", "reference", c]
            row = [
                str(c),
                f"{ours.rate / theirs.rate:.2f}x",
                f"{theirs.pct(0.5) / max(ours.pct(0.5), 1e-9):.2f}x",
            ]
            if c > 1:
                e_ours, e_theirs = results["events", "agl", c], results["events", "reference", c]
                row.append(f"{e_ours.rate / e_theirs.rate:.2f}x")
            else:
                row.append("-")
            rows.append(row)
        print(
            titled(
                "agl vs reference (durable SQLite vs in-memory store)",
                ["agents", "chat calls/s", "chat p50 speed-up", "events/s"],
                rows,
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument(
        "--prompt-tokens",
        default="1000,8000,32000,64000",
        help="the prompt-length rows ('' for none); the first is the ratios' base",
    )
    parser.add_argument("--prompt-agents", type=int, default=16)
    parser.add_argument("--no-storage", action="store_true")
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if concurrency:
        run(args.seconds, concurrency, not args.no_reference)
    if args.prompt_tokens:
        lengths = [int(t) for t in args.prompt_tokens.split(",")]
        prompt_lengths(args.seconds, lengths, args.prompt_agents)
    if not args.no_storage:
        storage()


if __name__ == "__main__":
    main()
