"""Start agl's services as real processes on free loopback ports (tests, benchmarks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from agl.core.ports import free_port


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{process.args!r} exited with {process.returncode} before it was ready"
            )
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


@dataclass
class GatewayProcess:
    url: str
    token: str
    run_dir: Path
    process: subprocess.Popen[bytes]

    def kill(self) -> None:
        """``kill -9``: no shutdown hook runs."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def gateway_process(
    run_dir: Path, token: str = "test-admin-token", port: int | None = None, **options: object
) -> Iterator[GatewayProcess]:
    """``python -m agl.gateway`` on a free port; stopped on exit. Refusals are answered at
    once unless ``refusal_delay_s`` says otherwise: tests refuse on purpose, by the hundred."""
    port = port or free_port()
    options.setdefault("refusal_delay_s", 0)
    args = [f"port={port}", f"run_dir={run_dir}", *(f"{k}={v}" for k, v in options.items())]
    env = {**os.environ, "AGL_ADMIN_TOKEN": token}
    process = subprocess.Popen([sys.executable, "-m", "agl.gateway", *args], env=env)
    gateway = GatewayProcess(f"http://127.0.0.1:{port}", token, run_dir, process)
    try:
        wait_healthy(f"{gateway.url}/healthz", process)
        yield gateway
    finally:
        gateway.stop()


@dataclass
class ServeProcess:
    url: str  # the OpenAI base URL, ending in /v1
    model: str  # the served name
    process: subprocess.Popen[bytes]


@contextmanager
def serve_process(
    model: str = "tiny", port: int | None = None, timeout_s: float = 120.0, **options: object
) -> Iterator[ServeProcess]:
    """``python -m agl.serve model=...`` on a free port; stopped on exit."""
    port = port or free_port()
    args = [f"model={model}", f"port={port}", *(f"{k}={v}" for k, v in options.items())]
    process = subprocess.Popen([sys.executable, "-m", "agl.serve", *args])
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", process, timeout_s=timeout_s)
        served = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        yield ServeProcess(f"http://127.0.0.1:{port}/v1", served["data"][0]["id"], process)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
