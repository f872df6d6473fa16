"""Soak: many agents through the recording proxy, upstream failures, and a gateway killed
(-9) and restarted on its store half-way (``python -m bench.soak``); with ``--hostile``,
the same again beside attackers.

``--rollouts`` agents run at once, each making ``--calls`` chat calls through its
attempt's proxy (with its model key, as a harness's ``OPENAI_API_KEY``) to a fast fake
model server that fails ``--fail-rate`` of the calls (500: the proxy retries them), then
posting its reward and finishing (with its report key, as ``agl.agent`` does). When half
the calls are answered, the gateway is killed with SIGKILL and started again on the same
port and store; agents retry what failed meanwhile (as harnesses do: connection errors
and 5xx, with backoff). Each call carries a unique id in its last message, so the store
can be audited afterwards:

- calls answered vs calls recorded (``model_request`` events): a recorded call is one an
  agent got an answer for, or one recorded just before the kill whose answer was lost;
- duplicates: a call id recorded more than once (a retry of a call whose first try was
  recorded but not answered, unless the restarted gateway replayed that answer: counted
  from its log);
- events lost: rewards the gateway acknowledged that are not in the store;
- p50 / p99 latency of a call as the agent saw it (retries included), throughput, peak
  RSS of the gateway.

``--hostile 0.25`` makes that share of the agents attackers (``bench/attacks.py``: each
has its attempt's model key only, and loops over issue 18's attacks for the whole run)
and runs twice, same settings: first the honest agents alone (quiet), then the same
honest agents beside the attackers (hostile). The report sets the two side by side, with
the attacks' outcomes and the forged rewards or statuses that landed (must be 0).
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from agl.core.client import GatewayClient, fast_http_client, proxy_base_url
from agl.core.ports import free_port
from agl.testing.processes import wait_healthy
from bench.attacks import MUST_REFUSE, AttackProcess, Plan, Tally, Target
from bench.tables import table

TOKEN = "soak-admin-token-0123456789"


@dataclass(frozen=True)
class Keys:
    """An honest agent's two keys: the model key for the proxy, the report key for the
    reward and the attempt's end."""

    model: str
    report: str


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
        self.spans: list[tuple[float, float]] = []  # (start, end) of each answered call
        self.retries = 0
        self.given_up = 0
        # Why the honest agents retried: a 5xx status, or the transport error's name.
        self.retried: collections.Counter[str] = collections.Counter()


async def request(http: httpx.AsyncClient, audit: Audit, method: str, url: str, **kw: Any) -> Any:
    """``method url`` until it is answered 2xx (or a 4xx: the agent's own fault), retrying
    dropped connections and 5xx with backoff, as a harness's client does."""
    wait = 0.05
    for _ in range(40):
        try:
            response = await http.request(method, url, **kw)
            if response.status_code < 500:
                return response
            audit.retried[str(response.status_code)] += 1
        except httpx.TransportError as error:
            audit.retried[type(error).__name__] += 1
        audit.retries += 1
        await asyncio.sleep(wait)
        wait = min(wait * 2, 2.0)
    audit.given_up += 1
    return None


async def agent(
    http: httpx.AsyncClient, audit: Audit, url: str, rid: str, keys: Keys, calls: int, total: list
) -> None:
    base = proxy_base_url(url, rid, 1)
    for i in range(calls):
        call_id = f"{rid}/{i}"
        body = {"model": "policy", "messages": [{"role": "user", "content": f"call {call_id}"}]}
        started = time.monotonic()
        response = await request(
            http, audit, "POST", f"{base}/chat/completions", json=body, headers=_bearer(keys.model)
        )
        if response is not None and response.is_success:
            audit.spans.append((started, time.monotonic()))
            audit.answered.add(call_id)
            total[0] += 1
    event = [{"event_id": _reward_id(rid), "type": "reward", "data": {"value": 1.0}}]
    response = await request(
        http,
        audit,
        "POST",
        f"{url}/api/rollouts/{rid}/attempt/1/events",
        json=event,
        headers=_bearer(keys.report),
    )
    if response is not None and response.is_success:
        audit.rewards_acked.add(rid)
    await request(
        http,
        audit,
        "PATCH",
        f"{url}/api/rollouts/{rid}/attempt/1",
        json={"status": "succeeded"},
        headers=_bearer(keys.report),
    )


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _reward_id(rollout_id: str) -> str:
    return f"{rollout_id}-reward"


class GatewayUsage:
    """The gateway processes' peak RSS and CPU seconds (the killed one's as last seen),
    sampled every 0.2 s until ``stop``."""

    def __init__(self, pid: int) -> None:
        self.pids = [pid]
        self.peak_rss_mb = 0.0
        self.cpu_s: dict[int, float] = {}
        self.stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self.stop.wait(0.2):
            for pid in list(self.pids):
                with contextlib.suppress(psutil.Error):
                    process = psutil.Process(pid)
                    self.peak_rss_mb = max(self.peak_rss_mb, process.memory_info().rss / 2**20)
                    times = process.cpu_times()
                    self.cpu_s[pid] = times.user + times.system


@dataclass(frozen=True)
class Settings:
    """One soak run: ``honest`` agents x ``calls`` calls, beside ``attackers`` attackers."""

    honest: int
    calls: int
    attackers: int = 0
    hold_s: float = 5.0  # how long an attacker holds a stalled socket


async def soak(settings: Settings, run_dir: Path, upstream: str) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = start_gateway(run_dir, port)
    usage = GatewayUsage(gateway.pid)
    ids = [f"soak-{i}" for i in range(settings.honest)]
    hostile = [f"attacker-{i}" for i in range(settings.attackers)]
    with GatewayClient(url, TOKEN) as admin:
        admin.register_models([{"model": "policy", "endpoint": upstream}])
        admin.create_rollouts([{"rollout_id": r} for r in ids + hostile])
        records = {r: admin.patch_rollout(r, "running", attempt=1) for r in ids + hostile}
    keys = {r: Keys(records[r].attempt_key, records[r].report_key) for r in ids}
    attackers = None
    if hostile:
        targets = tuple(Target(r, records[r].attempt_key) for r in hostile)
        attackers = AttackProcess(Plan(url, targets, tuple(ids), hold_s=settings.hold_s))
        await attackers.start()
    audit, total = Audit(), [0]
    half = settings.honest * settings.calls // 2
    started = time.monotonic()
    async with fast_http_client(settings.honest, timeout_s=60) as http:
        agents = asyncio.gather(
            *(agent(http, audit, url, r, keys[r], settings.calls, total) for r in ids)
        )
        while total[0] < half and not agents.done():
            await asyncio.sleep(0.01)
        killed_t = time.monotonic()
        gateway.send_signal(signal.SIGKILL)
        gateway.wait()
        killed_at = total[0]
        gateway = await asyncio.to_thread(start_gateway, run_dir, port)
        ready_t = time.monotonic()
        usage.pids.append(gateway.pid)
        await agents
    wall_s = time.monotonic() - started
    tally = await attackers.finish() if attackers else Tally()
    usage.stop.set()
    recorded: collections.Counter[str] = collections.Counter()
    rewards, forged = set(), 0
    with GatewayClient(url, TOKEN) as admin:
        for rid in ids:
            for event in admin.get_events(rid):
                if event.type == "model_request":
                    content = event.data["messages"][-1]["content"]
                    recorded[content.removeprefix("call ")] += 1
                elif event.type == "reward":
                    rewards.add(rid)
                    forged += event.event_id != _reward_id(rid)
        for rid in hostile:
            forged += len(admin.get_events(rid, type="reward"))
            forged += admin.get_rollout(rid).status != "running"
    gateway.terminate()
    gateway.wait(30)
    log = (run_dir / "gateway.log").read_text()
    latencies = sorted(end - start for start, end in audit.spans)
    # Calls that did not live through the kill and restart: how fast the gateway serves
    # when it is up, which is what attackers beside the agents can slow down.
    steady = sorted(end - start for start, end in audit.spans if end < killed_t or start > ready_t)
    return {
        "honest": settings.honest,
        "attackers": settings.attackers,
        "made": settings.honest * settings.calls,
        "answered": len(audit.answered),
        "recorded": len(recorded),
        "answered_not_recorded": len(audit.answered - set(recorded)),
        "duplicates": sum(n - 1 for n in recorded.values() if n > 1),
        "replayed": log.count("replaying answer"),
        "tracebacks": log.count("Traceback"),
        "events_lost": len(audit.rewards_acked - rewards),
        "forged_landed": forged,
        "calls_per_s": len(audit.answered) / wall_s,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": _p99(latencies) * 1e3,
        "p50_steady_ms": statistics.median(steady) * 1e3,
        "p99_steady_ms": _p99(steady) * 1e3,
        "restart_s": ready_t - killed_t,
        "retries": audit.retries,
        "retried": dict(audit.retried.most_common()),
        "given_up": audit.given_up,
        "killed_at": killed_at,
        "peak_rss_mb": usage.peak_rss_mb,
        "gateway_cpu_s": sum(usage.cpu_s.values()),
        "attackers_cpu_s": tally.cpu_s,
        "wall_s": wall_s,
        "attacks": tally.table(),
    }


def _p99(ordered: list[float]) -> float:
    return ordered[max(int(len(ordered) * 0.99) - 1, 0)]


@contextlib.contextmanager
def fake_upstream(fail_rate: float) -> Iterator[str]:
    """The fake vLLM server in a process of its own; yields its OpenAI base URL."""
    port = free_port()
    fake = subprocess.Popen(
        [sys.executable, "-m", "agl.testing.fake_vllm", f"port={port}", f"fail_rate={fail_rate}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/v1/models", fake)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        fake.terminate()
        fake.wait(10)


def measure(runs: list[Settings], fail_rate: float) -> list[dict[str, Any]]:
    """Each run of ``runs`` in turn, each on a fresh gateway and store, one upstream."""
    results = []
    with fake_upstream(fail_rate) as upstream:
        for settings in runs:
            with tempfile.TemporaryDirectory() as folder:
                results.append(asyncio.run(soak(settings, Path(folder), upstream)))
    return results


def refused(attacks: dict[str, dict[str, int]]) -> dict[str, int]:
    """Per attack kind that must be refused, how many of its requests got a 2xx."""
    return {
        kind: sum(n for outcome, n in attacks.get(kind, {}).items() if outcome.startswith("2"))
        for kind in sorted(MUST_REFUSE)
    }


# The gateway's deliberate "busy" answer: request bodies in flight past max_buffered_mb.
BUSY = {"oversized_body": "503"}


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} x{n}" for name, n in counts.items()) or "none"


def server_errors(attacks: dict[str, dict[str, int]]) -> int:
    """5xx answers to attacks, the bodies-in-flight budget's deliberate 503 aside."""
    return sum(
        n
        for attack, outcomes in attacks.items()
        for status, n in outcomes.items()
        if status.startswith("5") and BUSY.get(attack) != status
    )


def audit_lines(r: dict[str, Any]) -> list[str]:
    """One run's audit, as the quiet soak has always reported it."""
    return [
        f"calls made {r['made']}, answered {r['answered']}, recorded {r['recorded']} "
        f"(answered but not recorded: {r['answered_not_recorded']})",
        f"duplicates {r['duplicates']} (answers lost at the kill and replayed to the retry: "
        f"{r['replayed']}), acknowledged events lost {r['events_lost']}",
        f"latency p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms; gateway up p50 "
        f"{r['p50_steady_ms']:.0f} ms, p99 {r['p99_steady_ms']:.0f} ms (as agents saw it, retries "
        f"included); agent retries {r['retries']} ({_counts(r['retried'])}), calls given up "
        f"{r['given_up']}",
        f"gateway killed -9 after {r['killed_at']} answered calls, healthy again "
        f"{r['restart_s']:.1f} s later; peak gateway RSS "
        f"{r['peak_rss_mb']:.0f} MiB; wall {r['wall_s']:.1f} s",
    ]


# The runs' figures side by side, and those whose hostile/quiet ratio the issue targets.
_ROWS = {
    "calls_per_s": "honest calls/s",
    "p50_steady_ms": "p50 ms, gateway up",
    "p99_steady_ms": "p99 ms, gateway up",
    "p50_ms": "p50 ms, all calls",
    "p99_ms": "p99 ms, all calls",
    "restart_s": "kill to healthy again s",
    "answered": "calls answered",
    "answered_not_recorded": "answered, not recorded",
    "duplicates": "duplicates",
    "events_lost": "acknowledged events lost",
    "forged_landed": "forged rewards/statuses stored",
    "retries": "agent retries",
    "tracebacks": "tracebacks in the gateway log",
    "peak_rss_mb": "peak gateway RSS MiB",
    "gateway_cpu_s": "gateway CPU s",
    "attackers_cpu_s": "attackers' process CPU s",
    "wall_s": "wall s",
}
_RATIOS = {"calls_per_s", "p50_steady_ms", "p99_steady_ms", "p99_ms"}


def _figure(value: float) -> str:
    return f"{value:.1f}" if isinstance(value, float) and value < 100 else f"{value:.0f}"


def comparison(quiet: list[dict[str, Any]], hostile: list[dict[str, Any]]) -> list[str]:
    """The runs side by side (medians over the rounds, each a quiet and a hostile run
    measured one after the other), the attacks' outcomes and what must hold."""
    rounds = list(zip(quiet, hostile, strict=True))

    def median(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    def ratios(key: str) -> str:
        if key not in _RATIOS or not median(quiet, key):
            return ""
        each = [h[key] / q[key] for q, h in rounds if q[key]]
        whole = f"{median(hostile, key) / median(quiet, key):.2f}x"
        return whole if len(rounds) == 1 else f"{whole} ({', '.join(f'{x:.2f}' for x in each)})"

    cells = [
        [name, _figure(median(quiet, key)), _figure(median(hostile, key)), ratios(key)]
        for key, name in _ROWS.items()
    ]
    attacks: dict[str, collections.Counter[str]] = {}
    for run in hostile:
        for kind, outcomes in run["attacks"].items():
            attacks.setdefault(kind, collections.Counter()).update(outcomes)
    outcome_rows = [
        [kind, ", ".join(f"{o} x{n}" for o, n in sorted(outcomes.items()))]
        for kind, outcomes in attacks.items()
    ]
    table_attacks = {kind: dict(outcomes) for kind, outcomes in attacks.items()}
    wrongly = refused(table_attacks)
    per_round = " (each round's ratio in brackets)" if len(rounds) > 1 else ""
    return [
        table(["", "quiet", "hostile", f"hostile/quiet{per_round}"], cells),
        "",
        "attack outcomes in the hostile runs (status codes; held/closed: a stalled socket "
        "still open after the hold / dropped by the gateway; error names: the connection "
        "failed, around the kill or on an upload the gateway had refused):",
        table(["attack", "outcomes"], outcome_rows),
        "",
        "2xx to an attack that must be refused: "
        + ", ".join(f"{kind} {n}" for kind, n in wrongly.items())
        + f"; 5xx to any attack (the bodies budget's 503 aside): "
        f"{server_errors(table_attacks)}",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--fail-rate", type=float, default=0.01)
    parser.add_argument(
        "--hostile",
        type=float,
        default=0.0,
        help="share of the agents that attack; runs quiet, then hostile (0: quiet only)",
    )
    parser.add_argument("--hold-s", type=float, default=5.0, help="a stalled socket's hold")
    parser.add_argument(
        "--rounds", type=int, default=1, help="hostile: quiet and hostile runs, this many each"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not 0.0 <= args.hostile < 1.0:
        parser.error(f"--hostile {args.hostile} must be at least 0 and below 1")
    attackers = round(args.rollouts * args.hostile)
    honest = Settings(args.rollouts - attackers, args.calls, hold_s=args.hold_s)
    command = (
        f"python -m bench.soak --rollouts {args.rollouts} --calls {args.calls} "
        f"--fail-rate {args.fail_rate:g}"
    )
    if attackers:
        hostile = Settings(honest.honest, args.calls, attackers, args.hold_s)
        runs = measure([honest, hostile] * args.rounds, args.fail_rate)
        quiet, loud = runs[0::2], runs[1::2]
        lines = [
            f"# {command} --hostile {args.hostile:g} --hold-s {args.hold_s:g} --rounds "
            f"{args.rounds}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores",
            f"{honest.honest} honest agents x {args.calls} calls; each hostile run adds "
            f"{attackers} attackers (model keys only) beside the same honest agents; "
            "'gateway up': the calls that neither started nor ended between the kill and the "
            "restarted gateway's first healthy answer",
            "",
            *comparison(quiet, loud),
        ]
        for n, (q, h) in enumerate(zip(quiet, loud, strict=True), 1):
            lines += ["", f"round {n}, quiet:", *audit_lines(q), f"round {n}, hostile:"]
            lines += audit_lines(h)
    else:
        [r] = measure([honest], args.fail_rate)
        lines = [f"# {command}, {time.strftime('%Y-%m-%d')}, 2 CPU cores, one run", *audit_lines(r)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
