"""Soak: many agents through the recording proxy, upstream failures, and a gateway killed
(-9) and restarted on its store half-way (``python -m bench.soak``).

``--rollouts`` agents run at once, each making ``--calls`` chat calls through its
attempt's proxy to a fast fake model server that fails ``--fail-rate`` of the calls (500:
the proxy retries them), then posting its reward and finishing. When half the calls are
answered, the gateway is killed with SIGKILL and started again on the same port and
store; agents retry what failed meanwhile (as harnesses do: connection errors and 5xx,
with backoff). Each call carries a unique id in its last message, so the store can be
audited afterwards:

- calls answered vs calls recorded (``model_request`` events): a recorded call is one an
  agent got an answer for, or one recorded just before the kill whose answer was lost;
- duplicates: a call id recorded more than once (a retry of a call whose first try was
  recorded but not answered, unless the restarted gateway replayed that answer: counted
  from its log);
- events lost: rewards the gateway acknowledged that are not in the store;
- p50 / p99 latency of a call as the agent saw it (retries included), peak RSS of the
  gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from agl.core.client import GatewayClient, fast_http_client, proxy_base_url
from agl.core.services import free_port
from agl.testing.processes import wait_healthy

TOKEN = "soak-admin-token-0123456789"


def start_gateway(run_dir: Path, port: int) -> subprocess.Popen[bytes]:
    with (run_dir / "gateway.log").open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "agl.gateway", f"port={port}", f"run_dir={run_dir}"],
            env={**os.environ, "AGL_ADMIN_TOKEN": TOKEN},
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    wait_healthy(f"http://127.0.0.1:{port}/healthz", process)
    return process


class Audit:
    def __init__(self) -> None:
        self.answered: set[str] = set()
        self.rewards_acked: set[str] = set()
        self.latencies: list[float] = []
        self.retries = 0
        self.given_up = 0


async def request(http: httpx.AsyncClient, audit: Audit, method: str, url: str, **kw: Any) -> Any:
    """``method url`` until it is answered 2xx (or a 4xx: the agent's own fault), retrying
    dropped connections and 5xx with backoff, as a harness's client does."""
    wait = 0.05
    for _ in range(40):
        try:
            response = await http.request(method, url, **kw)
            if response.status_code < 500:
                return response
        except httpx.TransportError:
            pass
        audit.retries += 1
        await asyncio.sleep(wait)
        wait = min(wait * 2, 2.0)
    audit.given_up += 1
    return None


async def agent(
    http: httpx.AsyncClient, audit: Audit, url: str, rid: str, key: str, calls: int, total: list
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    base = proxy_base_url(url, rid, 1)
    for i in range(calls):
        call_id = f"{rid}/{i}"
        body = {"model": "policy", "messages": [{"role": "user", "content": f"call {call_id}"}]}
        started = time.monotonic()
        response = await request(
            http, audit, "POST", f"{base}/chat/completions", json=body, headers=headers
        )
        if response is not None and response.is_success:
            audit.latencies.append(time.monotonic() - started)
            audit.answered.add(call_id)
            total[0] += 1
    event = [{"event_id": f"{rid}-reward", "type": "reward", "data": {"value": 1.0}}]
    response = await request(
        http,
        audit,
        "POST",
        f"{url}/api/rollouts/{rid}/attempt/1/events",
        json=event,
        headers=headers,
    )
    if response is not None and response.is_success:
        audit.rewards_acked.add(rid)
    await request(
        http,
        audit,
        "PATCH",
        f"{url}/api/rollouts/{rid}/attempt/1",
        json={"status": "succeeded"},
        headers=headers,
    )


def watch_rss(pids: list[int], peak: list[float], stop: threading.Event) -> None:
    while not stop.wait(0.2):
        for pid in list(pids):
            with contextlib.suppress(psutil.Error):
                peak[0] = max(peak[0], psutil.Process(pid).memory_info().rss / 2**20)


async def soak(args: argparse.Namespace, run_dir: Path, upstream: str) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = start_gateway(run_dir, port)
    pids, peak, stop = [gateway.pid], [0.0], threading.Event()
    threading.Thread(target=watch_rss, args=(pids, peak, stop), daemon=True).start()
    ids = [f"soak-{i}" for i in range(args.rollouts)]
    with GatewayClient(url, TOKEN) as admin:
        admin.register_models([{"model": "policy", "endpoint": upstream}])
        admin.create_rollouts([{"rollout_id": r} for r in ids])
        keys = {r: admin.patch_rollout(r, "running", attempt=1).report_key for r in ids}
    audit, total = Audit(), [0]
    half = args.rollouts * args.calls // 2
    started = time.monotonic()
    async with fast_http_client(args.rollouts, timeout_s=60) as http:
        agents = asyncio.gather(
            *(agent(http, audit, url, r, keys[r], args.calls, total) for r in ids)
        )
        while total[0] < half and not agents.done():
            await asyncio.sleep(0.01)
        gateway.send_signal(signal.SIGKILL)
        gateway.wait()
        killed_at = total[0]
        gateway = await asyncio.to_thread(start_gateway, run_dir, port)
        pids.append(gateway.pid)
        await agents
    wall_s = time.monotonic() - started
    stop.set()
    recorded: collections.Counter[str] = collections.Counter()
    rewards = set()
    with GatewayClient(url, TOKEN) as admin:
        for rid in ids:
            for event in admin.get_events(rid):
                if event.type == "model_request":
                    content = event.data["messages"][-1]["content"]
                    recorded[content.removeprefix("call ")] += 1
                elif event.type == "reward":
                    rewards.add(rid)
    gateway.terminate()
    gateway.wait(30)
    replayed = (run_dir / "gateway.log").read_text().count("replaying answer")
    latencies = sorted(audit.latencies)
    return {
        "made": args.rollouts * args.calls,
        "answered": len(audit.answered),
        "recorded": len(recorded),
        "answered_not_recorded": len(audit.answered - set(recorded)),
        "duplicates": sum(n - 1 for n in recorded.values() if n > 1),
        "replayed": replayed,
        "events_lost": len(audit.rewards_acked - rewards),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1e3,
        "retries": audit.retries,
        "given_up": audit.given_up,
        "killed_at": killed_at,
        "peak_rss_mb": peak[0],
        "wall_s": wall_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--fail-rate", type=float, default=0.01)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    upstream_port = free_port()
    fake = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agl.testing.fake_vllm",
            f"port={upstream_port}",
            f"fail_rate={args.fail_rate}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{upstream_port}/v1/models", fake)
        with tempfile.TemporaryDirectory() as folder:
            r = asyncio.run(soak(args, Path(folder), f"http://127.0.0.1:{upstream_port}/v1"))
    finally:
        fake.terminate()
        fake.wait(10)
    lines = [
        f"# python -m bench.soak --rollouts {args.rollouts} --calls {args.calls} "
        f"--fail-rate {args.fail_rate:g}, {time.strftime('%Y-%m-%d')}, 2 CPU cores, one run",
        f"calls made {r['made']}, answered {r['answered']}, recorded {r['recorded']} "
        f"(answered but not recorded: {r['answered_not_recorded']})",
        f"duplicates {r['duplicates']} (answers lost at the kill and replayed to the retry: "
        f"{r['replayed']}), acknowledged events lost {r['events_lost']}",
        f"latency p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms (as agents saw it, retries "
        f"included); agent retries {r['retries']}, calls given up {r['given_up']}",
        f"gateway killed -9 after {r['killed_at']} answered calls; peak gateway RSS "
        f"{r['peak_rss_mb']:.0f} MiB; wall {r['wall_s']:.1f} s",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
