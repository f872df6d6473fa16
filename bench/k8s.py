"""The Kubernetes controller at scale, watch vs relist-only, side by side in one run
(``python -m bench.k8s``).

1,000 queued rollouts; the controller makes a Job (and a Secret) for each against the test
API server (``agl.testing.k8s.api_server.ApiServer``), and the node simulator ends every Job after a
random delay. The Jobs run no agent, so a Job's end is the only news of an attempt: the
controller must see it, fail the attempt ("agent exited without reporting a status") and
delete the Job. Figures per mode:

- latency: from the moment the simulator wrote the Job's terminal status to the moment
  the gateway recorded the rollout's terminal status (p50 / p99);
- API requests per rollout made by the controller (creates, deletes, lists, watches);
- wall-clock for the whole batch.

With a watch the latency is the watch's delivery plus one controller pass; relist-only
waits for the next list (``relist_s``), on average half of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from agl.backends.execution.k8s.config import K8sExecutorConfig
from agl.backends.execution.k8s.executor import K8sExecutor
from agl.backends.execution.k8s.naming import job_name
from agl.core.client import AsyncGatewayClient, fast_http_client
from agl.core.contracts.records import Status
from agl.core.controller.reconcile import Controller
from agl.testing.k8s.api_server import ApiServer
from agl.testing.k8s.node import NodeSimulator
from agl.testing.processes import gateway_process

TEMPLATE = """\
kind: Job
spec:
  template:
    spec:
      containers: [{name: agent, image: agl:bench, command: ["true"]}]
"""


async def _batch(
    args: argparse.Namespace, server: ApiServer, gateway_url: str, token: str, watch: bool
) -> dict[str, Any]:
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    rng = random.Random(args.seed)

    def outcome(job: Any) -> tuple[float, bool]:
        return rng.uniform(args.delay_min_s, args.delay_max_s), True

    executor = K8sExecutor(
        K8sExecutorConfig(
            template=TEMPLATE,
            namespace=namespace,
            kubeconfig=str(server.kubeconfig),
            agent_gateway_url=gateway_url,
            max_jobs=args.rollouts,
            create_qps=args.create_qps,
            create_burst=args.create_qps,
            watch=watch,
            relist_s=args.relist_s,
        )
    )
    with NodeSimulator(
        server.api_client,
        namespace=namespace,
        label_selector="app.kubernetes.io/managed-by=agl",
        log_dir=Path(tempfile.mkdtemp()),
        outcome=outcome,
    ) as node:
        async with fast_http_client(64) as http:
            client = AsyncGatewayClient(gateway_url, token, http=http)
            controller = Controller(
                client, executor, gateway_url=gateway_url, model="m", reconcile_s=30
            )
            task = asyncio.create_task(controller.run())
            prefix = f"{namespace}-"
            ids = [f"{prefix}{i}" for i in range(args.rollouts)]
            started = time.monotonic()
            await client.create_rollouts([{"rollout_id": i, "group_id": namespace} for i in ids])
            while True:
                done = await client.list_rollouts(Status.FAILED, group_id=namespace)
                if len(done) == len(ids):
                    break
                await asyncio.sleep(0.5)
            wall_s = time.monotonic() - started
            while executor.running() or controller.stats.exited_without_status < len(ids):
                await asyncio.sleep(0.1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finished = node.finished
    latencies = [
        r.ended_at - finished[job_name("agl", r.rollout_id, 1)]
        for r in done
        if r.ended_at is not None
    ]
    return {
        "latencies": sorted(latencies),
        "requests": executor.stats.requests / len(ids),
        "wall_s": wall_s,
        "relists": executor.stats.relists,
    }


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if values else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    # Completions spread over ~100 s (~10/s): below what 2 cores sustain with the API
    # server, etcd, the gateway and the simulator on them (~35 rollouts/s), so the figure
    # is the controller's reaction time, not a queue.
    parser.add_argument("--delay-min-s", type=float, default=10.0)
    parser.add_argument("--delay-max-s", type=float, default=90.0)
    parser.add_argument("--relist-s", type=float, default=10.0)
    parser.add_argument("--create-qps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if reason := ApiServer.available():
        sys.exit(f"bench.k8s: {reason}")

    results = {}
    with (
        tempfile.TemporaryDirectory() as folder,
        ApiServer(Path(folder) / "k8s") as server,
        gateway_process(Path(folder) / "gateway", sweep_interval_s=1.0) as gw,
    ):
        for mode in ("watch", "relist-only"):
            results[mode] = asyncio.run(
                _batch(args, server, gw.url, gw.token, watch=mode == "watch")
            )
    lines = [
        f"# python -m bench.k8s --rollouts {args.rollouts} --relist-s {args.relist_s:g} "
        f"(Job delays uniform {args.delay_min_s:g}-{args.delay_max_s:g} s, "
        f"create_qps {args.create_qps}), {time.strftime('%Y-%m-%d')}, one run",
        f"{'mode':<12} {'p50 ms':>8} {'p99 ms':>8} {'req/rollout':>12} {'relists':>8} "
        f"{'batch s':>8}",
    ]
    for mode, r in results.items():
        lines.append(
            f"{mode:<12} {_percentile(r['latencies'], 50) * 1e3:>8.0f} "
            f"{_percentile(r['latencies'], 99) * 1e3:>8.0f} {r['requests']:>12.2f} "
            f"{r['relists']:>8} {r['wall_s']:>8.1f}"
        )
    watch, relist = results["watch"], results["relist-only"]
    ratio = _percentile(relist["latencies"], 50) / max(_percentile(watch["latencies"], 50), 1e-9)
    lines.append(f"p50 latency, relist-only / watch: {ratio:.1f}x")
    lines.append(
        "latency: Job terminal status written by the node -> rollout terminal at the gateway."
    )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
