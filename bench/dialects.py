"""Translation overhead: proxied Responses, Anthropic Messages and text completions calls
vs chat completions.

One gateway, one fake vLLM-shaped upstream, one run. Each chat-shaped API's request asks
the same thing (a system prompt, a user turn, 32 tokens), so the upstream is asked the
same chat request and answers the same tokens; what differs is the gateway's work:
translating the request, the answer (or each chunk of its stream) and the error shapes.
A text completion has no translation but its own answer shape (ids on each choice,
``token_logprobs``); its prompt is the same text and its answer capped at the chat
answer's length (one token fewer: no eos). Agents loop,
each sending its next call when the last one answered, unary and streamed. The cells of
one concurrency and mode run in two halves, A B C then C B A, so that neither the order
nor the store growing under the run favours an API.

    python -m bench.dialects                       # 1, 16, 64 agents, 4 s per cell
    python -m bench.dialects --seconds 2 --concurrency 16

Prints the tables and writes them to bench/results/dialects.txt (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from agl.core.client import GatewayClient, proxy_base_url
from agl.testing.processes import gateway_process
from bench.gateway import Result, Target, fake_upstream, load, titled

APIS = ("chat", "responses", "anthropic", "completions")
SYSTEM = "You are a terse assistant."
OUT = Path(__file__).parent / "results" / "dialects.txt"


def body(api: str, stream: bool) -> Callable[[int], bytes]:
    """The same question in each API's own request shape."""

    def make(n: int) -> bytes:
        question = f"question {n}"
        if api == "chat":
            request = {
                "model": "policy",
                "max_tokens": 32,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                ],
            }
        elif api == "completions":
            # As many tokens (bytes, in fake vLLM) as the chat answer, "turn 2: question n".
            request = {
                "model": "policy",
                "max_tokens": len(f"turn 2: {question}"),
                "prompt": f"{SYSTEM}\n{question}",
            }
        elif api == "responses":
            request = {
                "model": "policy",
                "max_output_tokens": 32,
                "instructions": SYSTEM,
                "input": question,
            }
        else:
            request = {
                "model": "policy",
                "max_tokens": 32,
                "system": SYSTEM,
                "messages": [{"role": "user", "content": question}],
            }
        return orjson.dumps({**request, "stream": True} if stream else request)

    return make


def targets(gw_url: str, token: str, upstream: str, pid: int, agents: int) -> list[Target]:
    """Per API, a unary and a streamed target, each agent on a rollout of its own."""
    with GatewayClient(gw_url, token) as admin:
        admin.register_models([{"model": "policy", "endpoint": upstream, "policy_version": 1}])
        run = f"dialects-{time.time_ns()}"
        specs = [{"rollout_id": f"{run}-{api}-{i}"} for api in APIS for i in range(agents)]
        rollouts = [
            admin.patch_rollout(r.rollout_id, "running") for r in admin.create_rollouts(specs)
        ]
    made = []
    for k, api in enumerate(APIS):
        mine = rollouts[k * agents : (k + 1) * agents]
        bases = [proxy_base_url(gw_url, r.rollout_id, r.attempt) for r in mine]
        if api == "anthropic":
            # Anthropic's clients send the key as x-api-key.
            urls = [b.removesuffix("/openai/v1") + "/anthropic/v1/messages" for b in bases]
            headers = [{"x-api-key": r.attempt_key or ""} for r in mine]
        else:
            tail = {"chat": "/chat/completions", "completions": "/completions"}.get(
                api, "/responses"
            )
            urls = [b + tail for b in bases]
            headers = [{"Authorization": f"Bearer {r.attempt_key}"} for r in mine]
        for stream in (False, True):
            made.append(Target(f"{api}/{stream}", urls, headers, body(api, stream), pid))
    return made


def merged(a: Result, b: Result) -> Result:
    cpu = None if a.cpu_s is None or b.cpu_s is None else a.cpu_s + b.cpu_s
    return Result(
        a.calls + b.calls,
        a.seconds + b.seconds,
        a.latencies + b.latencies,
        a.errors + b.errors,
        cpu,
    )


def run(seconds: float, concurrency: list[int]) -> str:
    with (
        tempfile.TemporaryDirectory() as tmp,
        fake_upstream() as (upstream, _),
        # Each load loop drives one attempt key flat out: the per-attempt limit off.
        gateway_process(Path(tmp) / "agl", attempt_rps=0) as gw,
    ):
        by_name = {
            t.name: t for t in targets(gw.url, gw.token, upstream, gw.process.pid, max(concurrency))
        }
        results: dict[tuple[str, bool, int], Result] = {}
        for c in concurrency:
            for stream in (False, True):
                halves = [APIS, APIS[::-1]]
                for order in halves:
                    for api in order:
                        target = by_name[f"{api}/{stream}"]
                        got = asyncio.run(load(target, c, seconds / len(halves)))
                        key = (api, stream, c)
                        results[key] = merged(results[key], got) if key in results else got
    return report(results, concurrency, seconds)


def report(results: dict[tuple[str, bool, int], Result], concurrency: list[int], s: float) -> str:
    rows = []
    for c in concurrency:
        for stream in (False, True):
            for api in APIS:
                r = results[api, stream, c]
                rows.append(
                    [
                        str(c),
                        "stream" if stream else "unary",
                        api,
                        f"{r.rate:.0f}",
                        f"{r.pct(0.5):.2f}",
                        f"{r.pct(0.99):.2f}",
                        f"{r.cpu_ms_per_call or 0:.2f}",
                        str(r.errors),
                    ]
                )
    calls = titled(
        f"Proxied calls by API ({s:g} s per cell; CPU = gateway process only)",
        ["agents", "mode", "api", "calls/s", "p50 ms", "p99 ms", "CPU ms/call", "errors"],
        rows,
    )
    rows = []
    for c in concurrency:
        for stream in (False, True):
            chat = results["chat", stream, c]
            row = [str(c), "stream" if stream else "unary"]
            for api in APIS[1:]:
                r = results[api, stream, c]
                row.append(f"{r.rate / chat.rate:.2f}x")
                row.append(f"{(r.cpu_ms_per_call or 0) / (chat.cpu_ms_per_call or 1):.2f}x")
            rows.append(row)
    ratios = titled(
        "Dialects vs chat completions (calls/s, and gateway CPU per call)",
        [
            "agents",
            "mode",
            "responses calls/s",
            "responses CPU",
            "anthropic calls/s",
            "anthropic CPU",
            "completions calls/s",
            "completions CPU",
        ],
        rows,
    )
    return calls + "\n" + ratios + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    text = run(args.seconds, [int(c) for c in args.concurrency.split(",")])
    print(text)
    args.out.write_text(text.lstrip("\n"))


if __name__ == "__main__":
    main()
