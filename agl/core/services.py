"""Child services of a training run: the gateway as its own process (its own GIL, its own
crash domain), tied to the trainer's lifetime so that nothing outlives a run — also on
Ctrl-C, a crash, or ``kill -9`` of the trainer (Linux: the kernel's parent-death signal).
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


PARENT_ENV = "AGL_PARENT_PID"


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child that must not outlive this process (see
    :func:`bind_to_parent`, which the child calls at start)."""
    return {**os.environ, PARENT_ENV: str(os.getpid()), **extra}


def bind_to_parent() -> None:
    """In a child started with :func:`child_env`: die (SIGKILL) when the parent dies, also
    by ``kill -9`` (Linux's parent-death signal). Done by the child itself rather than in
    a ``preexec_fn``, which is unsafe in a parent that runs threads. If the parent is
    already gone, exit now."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):
        os._exit(1)


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ChildGateway:
    """``python -m agl.gateway`` as a child process with a fresh admin token."""

    def __init__(self, run_dir: Path, host: str = "127.0.0.1", port: int = 0) -> None:
        if port and not port_free(host, port):
            raise OSError(f"gateway port {port} on {host} is in use")
        self.run_dir = run_dir
        self.host = host
        self.port = port or free_port(host)
        self.token = secrets.token_urlsafe(32)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ChildGateway:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(self.run_dir / "gateway.log", "ab")  # noqa: SIM115 - the child owns it
        args = [f"host={self.host}", f"port={self.port}", f"run_dir={self.run_dir}"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agl.gateway", *args, "log_level=warning"],
            env=child_env(AGL_ADMIN_TOKEN=self.token),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # Its own process group: Ctrl-C reaches only the trainer, which stops the
            # children in order.
            process_group=0,
        )
        log_file.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the gateway exited with code {self.process.returncode} "
                    f"(see {self.run_dir / 'gateway.log'})"
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the gateway was not up after {timeout_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
