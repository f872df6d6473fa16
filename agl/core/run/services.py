"""Child services of a training run: the gateway as its own process (its own GIL, its own
crash domain), tied to the trainer's lifetime so that nothing outlives a run — also on
Ctrl-C, a crash, or ``kill -9`` of the trainer (Linux: the kernel's parent-death signal,
set by :func:`die_with_parent`, which the agent workers use too).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from agl.core.gateway.private_files import private_dir
from agl.core.gateway.upstream import KEY_ENV_VAR
from agl.core.ports import connect_host, free_port, port_free
from agl.core.processes import die_with_parent, end_process

log = logging.getLogger(__name__)


class ChildGateway:
    """``python -m agl.gateway`` as a child process with a fresh admin token, restarted on
    its store (same port, same token) if it dies: clients retry through the gap, so a
    run outlives a crashed or killed gateway.

    The token (32 random bytes) goes to the child as ``AGL_ADMIN_TOKEN``, which counts as
    a secret configured, so ``gateway.host=0.0.0.0`` (say, for agents on other machines)
    starts as well as the loopback default does. ``inference_key``, the key the run's
    inference servers require, goes to it as ``AGL_INFERENCE_KEY`` (its upstream calls
    send it): in the child's environment only, never on its command line or in a file."""

    # Seconds between tries to bring a dead gateway back, then give up (the run fails).
    RESTART_WAITS = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0)

    def __init__(
        self,
        run_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        sampling_seed: int = -1,
        inference_key: str | None = None,
    ) -> None:
        if port and not port_free(host, port):
            raise OSError(f"gateway port {port} on {host} is in use")
        self.run_dir = run_dir
        self.host = host
        self.port = port or free_port(host)
        self.sampling_seed = sampling_seed
        self.token = secrets.token_urlsafe(32)
        self._inference_key = inference_key
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._lock = threading.Lock()
        self._stopping = False
        self._supervisor: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}"

    @property
    def token_file(self) -> Path:
        """The admin token, readable by its owner only: what opens the run's trajectory
        viewer (``/ui``) and ``python -m agl.rollouts`` while the run goes on."""
        return self.run_dir / "admin_token"

    def start(self, timeout_s: float = 60.0) -> ChildGateway:
        private_dir(self.run_dir)
        descriptor = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(descriptor, 0o600)  # a file left by an earlier run keeps its mode otherwise
        with os.fdopen(descriptor, "w") as file:
            file.write(self.token + "\n")
        self._launch(timeout_s)
        if self._supervisor is None:
            self._supervisor = threading.Thread(
                target=self._supervise, name="gateway-supervisor", daemon=True
            )
            self._supervisor.start()
        return self

    def _launch(self, timeout_s: float) -> None:
        private_dir(self.run_dir)
        args = [
            f"host={self.host}",
            f"port={self.port}",
            f"run_dir={self.run_dir}",
            f"sampling_seed={self.sampling_seed}",
        ]
        with self._lock:
            if self._stopping:
                return
            with (self.run_dir / "gateway.log").open("ab") as log_file:
                process = self.process = subprocess.Popen(
                    [sys.executable, "-m", "agl.gateway", *args, "log_level=warning"],
                    env=self._child_env(),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    # Its own process group: Ctrl-C reaches only the trainer, which stops
                    # the children in order.
                    process_group=0,
                    preexec_fn=die_with_parent(),
                )
        deadline = time.monotonic() + timeout_s
        while not self._stopping:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the gateway exited with code {process.returncode} "
                    f"(see {self.run_dir / 'gateway.log'})"
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                process.kill()
                process.wait(timeout=10)
                raise TimeoutError(f"the gateway was not up after {timeout_s} s")
            time.sleep(0.05)

    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, "AGL_ADMIN_TOKEN": self.token}
        if self._inference_key is not None:
            env[KEY_ENV_VAR] = self._inference_key
        return env

    def _supervise(self) -> None:
        while True:
            process = self.process
            assert process is not None
            code = process.wait()
            if self._stopping or process is not self.process:
                return
            log.warning("the gateway exited with code %d; restarting it on its store", code)
            for wait in self.RESTART_WAITS:
                time.sleep(wait)
                if self._stopping:
                    return
                try:
                    self._launch(timeout_s=60.0)
                except (OSError, RuntimeError, TimeoutError) as error:
                    log.warning("the gateway did not come back: %s", error)
                    continue
                self.restarts += 1
                log.warning("the gateway is back at %s (restart %d)", self.url, self.restarts)
                break
            else:
                log.error("the gateway did not come back after %d tries", len(self.RESTART_WAITS))
                return

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            process = self.process
        end_process(process)
