"""Gateway benchmark: proxied chat calls and event POSTs, agl vs the reference gateway.

One run, one machine, one fake vLLM-shaped upstream shared by every target, so the
numbers to read are the ratios side by side:

- direct: agents call the upstream themselves (the floor);
- agl: through ``python -m agl.gateway`` (SQLite store, every call committed before
  its answer is sent);
- reference: through Agent Lightning 1.0.2's ``agl-server`` (in-memory store), in its own
  Python 3.12 venv (made on first use).

    python -m bench.gateway                       # 1, 16, 64 agents, 5 s each
    python -m bench.gateway --seconds 3 --no-reference
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from agl.core.client import GatewayClient, proxy_base_url
from agl.testing.processes import free_port, gateway_process, wait_healthy
from bench.reference_gateway import ensure_reference_venv, start_reference_gateway
from bench.tables import table

REFERENCE_VENV = Path(
    os.environ.get("AGL_REFERENCE_VENV", Path(tempfile.gettempdir()) / "agl-ref-venv")
)


@dataclass(frozen=True)
class Target:
    """One way to make a call: a URL per agent, headers per agent, a body."""

    name: str
    urls: list[str]
    headers: list[dict[str, str]]
    body: Callable[[int], bytes]
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
    async with aiohttp.ClientSession(connector=connector) as session:

        async def agent(i: int, stop_at: float) -> None:
            nonlocal errors
            url, headers = target.urls[i], {**target.headers[i], "Content-Type": "application/json"}
            n = 0
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                async with session.post(url, data=target.body(n), headers=headers) as response:
                    await response.read()
                    ok = response.status < 300
                if measuring:
                    if ok:
                        latencies.append(time.perf_counter() - started)
                    else:
                        errors += 1
                n += 1

        await asyncio.gather(*(agent(i, time.perf_counter() + warmup_s) for i in range(agents)))
        measuring = True
        cpu_before = cpu_seconds(target.pid)
        started = time.perf_counter()
        await asyncio.gather(*(agent(i, started + seconds) for i in range(agents)))
        elapsed = time.perf_counter() - started
        cpu_after = cpu_seconds(target.pid)
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return Result(len(latencies), elapsed, latencies, errors, cpu)


def chat_body(agent_text: str) -> Callable[[int], bytes]:
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

    return body


@contextlib.contextmanager
def fake_upstream() -> Iterator[tuple[str, int]]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "agl.testing.fake_vllm", f"port={port}"])
    try:
        wait_healthy(f"http://127.0.0.1:{port}/v1/models", process)
        yield f"http://127.0.0.1:{port}/v1", process.pid
    finally:
        process.terminate()
        process.wait(timeout=10)


def agl_targets(
    gw_url: str, token: str, upstream: str, pid: int, agents: int
) -> tuple[Target, Target]:
    with GatewayClient(gw_url, token) as admin:
        admin.register_models([{"model": "policy", "endpoint": upstream, "policy_version": 1}])
        run = f"bench-{time.time_ns()}"
        rollouts = admin.create_rollouts([{"rollout_id": f"{run}-{i}"} for i in range(agents)])
        rollouts = [admin.patch_rollout(r.rollout_id, "running") for r in rollouts]
    keys = [{"Authorization": f"Bearer {r.attempt_key}"} for r in rollouts]
    chat = Target(
        "agl",
        [proxy_base_url(gw_url, r.rollout_id, 1) + "/chat/completions" for r in rollouts],
        keys,
        chat_body("agl"),
        pid,
    )
    event_urls = [f"{gw_url}/api/rollouts/{r.rollout_id}/attempt/1/events" for r in rollouts]
    events = Target(
        "agl",
        event_urls,
        [{"Authorization": f"Bearer {r.report_key}"} for r in rollouts],
        lambda n: orjson.dumps({"type": "reward", "data": {"value": 1.0, "n": n}}),
        pid,
    )
    return chat, events


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
                lambda n: orjson.dumps(ref.event_body(float(n))),
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
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    run(args.seconds, concurrency, not args.no_reference)


if __name__ == "__main__":
    main()
