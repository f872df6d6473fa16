"""Inference benchmark: generated tokens per second from ``python -m agl.serve``.

For each model (tiny; SmolLM2-135M when its wheel is installed) and 1, 8 and 32
concurrent clients, each sending its next request when the last one answered (64 new
tokens per request, ``ignore_eos``, temperature 1): straight to the server, and through
the gateway's recording proxy, side by side in one run. The ratio of 32 clients to one is
what batching buys; the proxy's share is what recording costs.

    python -m bench.serve
    python -m bench.serve --seconds 5 --models tiny
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from pathlib import Path

import orjson

from agl.backends.inference.models import ModelUnavailable, load_model
from agl.core.client import GatewayClient, proxy_base_url
from agl.testing.processes import gateway_process, serve_process
from bench.gateway import Result, Target, load
from bench.tables import table

NEW_TOKENS = 64
CLIENTS = (1, 8, 32)


def body(model: str):
    def make(n: int) -> bytes:
        return orjson.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": f"Tell me a story, number {n}."}],
                "max_tokens": NEW_TOKENS,
                "ignore_eos": True,
                "temperature": 1.0,
            }
        )

    return make


def targets(
    server_url: str, model: str, gateway_url: str, token: str, pid: int
) -> tuple[Target, Target]:
    n = max(CLIENTS)
    direct = Target("direct", [server_url + "/chat/completions"] * n, [{}] * n, body(model), pid)
    with GatewayClient(gateway_url, token) as admin:
        admin.register_models([{"model": model, "endpoint": server_url}])
        specs = [{"rollout_id": f"{model}-{i}"} for i in range(n)]
        rollouts = [
            admin.patch_rollout(r.rollout_id, "running") for r in admin.create_rollouts(specs)
        ]
    proxied = Target(
        "proxy",
        [proxy_base_url(gateway_url, r.rollout_id, 1) + "/chat/completions" for r in rollouts],
        [{"Authorization": f"Bearer {r.attempt_key}"} for r in rollouts],
        body(model),
        pid,
    )
    return direct, proxied


def run(models: list[str], seconds: float) -> str:
    rows: list[list[str]] = []
    for name in models:
        try:
            load_model(name)  # converts and caches once, outside the measurement
        except ModelUnavailable as missing:
            rows.append([name, "-", "-", f"skipped: {missing}", "", "", ""])
            continue
        with (
            tempfile.TemporaryDirectory() as tmp,
            serve_process(name) as server,
            gateway_process(Path(tmp)) as gw,
        ):
            direct, proxied = targets(
                server.url, server.model, gw.url, gw.token, server.process.pid
            )
            results: dict[tuple[str, int], Result] = {}
            for clients in CLIENTS:
                for target in (direct, proxied):
                    results[target.name, clients] = asyncio.run(load(target, clients, seconds))
            for target in (direct, proxied):
                one = results[target.name, 1].rate
                for clients in CLIENTS:
                    r = results[target.name, clients]
                    share = 1 - r.rate / results["direct", clients].rate
                    rows.append(
                        [
                            name,
                            target.name,
                            str(clients),
                            f"{r.rate * NEW_TOKENS:.0f}",
                            f"{r.rate / one:.1f}x",
                            f"{r.pct(0.5):.0f}",
                            "-" if target.name == "direct" else f"{share:+.0%}",
                        ]
                    )
    header = ["model", "path", "clients", "tokens/s", "vs 1 client", "p50 ms", "proxy share"]
    return (
        f"Generated tokens/s, {NEW_TOKENS} new tokens per request, {seconds:.0f} s per cell\n"
        f"{table(header, rows)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--models", default="tiny,smollm2")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        print(run(args.models.split(","), args.seconds))


if __name__ == "__main__":
    main()
