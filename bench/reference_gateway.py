"""Drive the reference gateway of Agent Lightning v1.0 (``agentlightning==1.0.2``).

The reference needs Python 3.12, so it lives in its own venv and runs as a subprocess
(``agl-server``, a Hydra app). This module only uses the stdlib and ``httpx`` so it can be
imported from agl's Python 3.11 benchmarks. See ``bench/REFERENCE.md`` for the findings.

Typical use::

    python = ensure_reference_venv(Path("/tmp/agl-ref-venv"))
    with start_reference_gateway(python, "http://127.0.0.1:9000/v1") as gw:
        (rid, attempt), = gw.create_running_rollouts(1)
        httpx.post(gw.proxy_chat_url(rid, attempt), headers=gw.headers, json={...})
        httpx.post(gw.events_url(rid, attempt), headers=gw.headers, json=gw.event_body())
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)

REFERENCE_VERSION = "1.0.2"

# agentlightning itself plus the server stack pinned to the versions the numbers in
# REFERENCE.md were measured with (pip still resolves the remaining, unused deps such as
# kr8s/jinja2; no torch or CUDA packages are pulled in).
REFERENCE_REQUIREMENTS: tuple[str, ...] = (
    f"agentlightning=={REFERENCE_VERSION}",
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "pydantic==2.14.4",
    "httpx==0.28.1",
    "httpcore==1.0.9",
    "h11==0.16.0",
    "anyio==4.16.0",
    "hydra-core==1.3.2",
    "omegaconf==2.3.0",
    "structlog==26.1.0",
)

# The proxy ignores the client's "model" and always routes to the model named in the
# server config (``default_proxy.model_name``); registered endpoints must use this name.
DEFAULT_MODEL_NAME = "Qwen/Qwen2.5-7B-Instruct"

_SENTINEL = ".agl-reference-ok"
_PYTHON312_ENV = "AGL_REFERENCE_PYTHON312"
_PROXY_ENV_VARS = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
)


# --------------------------------------------------------------------------- venv


def find_python312() -> Path:
    """Locate a Python 3.12 interpreter (env override, then pyenv, then PATH)."""
    override = os.environ.get(_PYTHON312_ENV)
    if override:
        return Path(override)
    pyenv_root = Path(os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv")))
    candidates = sorted(
        pyenv_root.glob("versions/3.12*/bin/python"),
        key=lambda p: tuple(int(x) for x in p.parent.parent.name.split(".") if x.isdigit()),
    )
    if candidates:
        return candidates[-1]
    found = shutil.which("python3.12")
    if found:
        return Path(found)
    raise FileNotFoundError(
        f"no Python 3.12 found; install one (pyenv install 3.12) or set {_PYTHON312_ENV}"
    )


def _venv_ready(path: Path) -> bool:
    python = path / "bin" / "python"
    sentinel = path / _SENTINEL
    if not python.exists() or not sentinel.exists():
        return False
    return sentinel.read_text().split() == list(REFERENCE_REQUIREMENTS)


def _run_checked(cmd: Sequence[str], *, timeout: float) -> None:
    log.info("running: %s", " ".join(cmd))
    proc = subprocess.run(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {cmd}\n{proc.stdout[-4000:]}")


def ensure_reference_venv(path: Path, *, python312: Path | None = None) -> Path:
    """Create a Python 3.12 venv at ``path`` with agentlightning installed; return its python.

    Idempotent: when a previous call completed (sentinel file present with the same
    requirement list) it returns at once. A file lock next to the venv serialises
    concurrent callers. A cold install took ~20 s here (PyPI, 2 cores).
    """
    path = path.absolute()
    python = path / "bin" / "python"
    if _venv_ready(path):
        return python
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.parent / f".{path.name}.lock"
    with lock_path.open("w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            if _venv_ready(path):
                return python
            started = time.monotonic()
            if not python.exists():
                base = python312 or find_python312()
                _run_checked([str(base), "-m", "venv", "--clear", str(path)], timeout=300)
            _run_checked(
                [
                    str(python),
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    *REFERENCE_REQUIREMENTS,
                ],
                timeout=900,
            )
            (path / _SENTINEL).write_text("\n".join(REFERENCE_REQUIREMENTS) + "\n")
            log.info("reference venv ready at %s in %.1f s", path, time.monotonic() - started)
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    return python


# --------------------------------------------------------------------------- server


@dataclass
class ReferenceGateway:
    """A running reference ``agl-server`` with the upstream registered as its model."""

    base_url: str
    headers: dict[str, str]
    model_name: str
    upstream_base_url: str
    process: subprocess.Popen[bytes] = field(repr=False)
    log_path: Path
    _client: httpx.Client = field(repr=False)

    # -- URLs -------------------------------------------------------------------------

    def proxy_openai_base_url(self, rollout_id: str, attempt: int, mode: str = "train") -> str:
        """OpenAI ``base_url`` for one rollout attempt (``mode`` is ``train`` or ``val``)."""
        return f"{self.base_url}/proxy/rollout/{rollout_id}/attempt/{attempt}/mode/{mode}/openai/v1"

    def proxy_chat_url(self, rollout_id: str, attempt: int, mode: str = "train") -> str:
        """Full URL of the proxied chat-completions endpoint for one rollout attempt."""
        return f"{self.proxy_openai_base_url(rollout_id, attempt, mode)}/chat/completions"

    def events_url(self, rollout_id: str, attempt: int) -> str:
        """URL to ``POST`` one event (body: :meth:`event_body`) for one rollout attempt."""
        return f"{self.base_url}/api/rollouts/{rollout_id}/attempt/{attempt}/events"

    @staticmethod
    def event_body(value: float = 1.0) -> dict[str, Any]:
        """Body of one event: a ``reward`` (the only user event with well-known shape)."""
        return {"event_type": "reward", "data": {"value": value, "source": "bench"}}

    # -- control calls ----------------------------------------------------------------

    def create_running_rollouts(self, n: int, attempt: int = 0) -> list[tuple[str, int]]:
        """Create ``n`` rollouts and move each to ``running`` with ``last_attempt_id=attempt``.

        The proxy itself only checks that the rollout exists, but ``running`` mirrors
        what the controller does, and ``last_attempt_id`` is the attempt whose events
        ``GET /api/rollouts/{id}/events`` returns. There is no bulk patch: one PATCH each.
        """
        if n <= 0:
            return []
        created: list[str] = []
        batch = 500
        for start in range(0, n, batch):
            items = [
                {"input": {"data_id": f"bench-{start + i}"}, "is_train": True}
                for i in range(min(batch, n - start))
            ]
            resp = self._client.post("/api/rollouts", json=items)
            resp.raise_for_status()
            created.extend(r["rollout_id"] for r in resp.json())
        for rid in created:
            resp = self._client.patch(
                f"/api/rollouts/{rid}",
                json={"status": {"state": "running", "last_attempt_id": str(attempt)}},
            )
            resp.raise_for_status()
        return [(rid, attempt) for rid in created]

    def get_events(self, rollout_id: str, fmt: str | None = None) -> list[dict[str, Any]]:
        """Events of the rollout's ``last_attempt_id`` (``fmt="triplet"`` for the RL view)."""
        params = {"format": fmt} if fmt else None
        resp = self._client.get(f"/api/rollouts/{rollout_id}/events", params=params)
        resp.raise_for_status()
        result: list[dict[str, Any]] = resp.json()
        return result

    def register_model(self, endpoint: str, version: int = 0) -> None:
        """Register (upsert) an OpenAI base URL (``.../v1``) under the proxy's model name."""
        resp = self._client.post(
            "/api/models",
            json=[{"model": self.model_name, "endpoint": endpoint, "version": version}],
        )
        resp.raise_for_status()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _log_tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def _stop(process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)


def _wait_ready(
    process: subprocess.Popen[bytes], base_url: str, log_path: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=2.0) as probe:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"agl-server exited with {process.returncode}:\n{_log_tail(log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if probe.get(f"{base_url}/healthz").status_code == 200:
                    return
            time.sleep(0.1)
    raise TimeoutError(f"agl-server not ready after {timeout} s:\n{_log_tail(log_path)}")


@contextlib.contextmanager
def start_reference_gateway(
    python: Path,
    upstream_base_url: str,
    *,
    model_name: str = DEFAULT_MODEL_NAME,
    key: str | None = None,
    log_path: Path | None = None,
    extra_overrides: Sequence[str] = (),
    ready_timeout: float = 60.0,
) -> Iterator[ReferenceGateway]:
    """Start ``agl-server`` on a free 127.0.0.1 port and register ``upstream_base_url``.

    ``upstream_base_url`` is an OpenAI base URL including ``/v1``: the proxy posts to
    ``{endpoint}/chat/completions`` with no auth header. ``key=None`` picks a random API
    key; ``key=""`` runs the server without auth. ``extra_overrides`` are extra Hydra
    overrides (e.g. ``"default_proxy.include_log_probs=false"``). The server's stdout and
    stderr (one uvicorn access-log line per request) go to ``log_path`` (default: a file
    in a temporary run dir, removed on exit). The process is stopped on exit.
    """
    api_key = secrets.token_hex(16) if key is None else key
    agl_server = python.parent / "agl-server"
    with tempfile.TemporaryDirectory(prefix="agl-ref-run-") as run_dir:
        out_path = log_path or Path(run_dir) / "server.log"
        for attempt_no in range(3):
            port = _free_port()
            base_url = f"http://127.0.0.1:{port}"
            launcher = (
                [str(agl_server)]
                if agl_server.exists()
                else [str(python), "-m", "agentlightning.server"]
            )
            cmd = [
                *launcher,
                "host=127.0.0.1",
                f"port={port}",
                f"key={api_key}",
                f"default_proxy.model_name={model_name}",
                # Keep Hydra's outputs/<date>/<time> dir out of the caller's cwd.
                f"hydra.run.dir={run_dir}",
                "hydra.output_subdir=null",
                *extra_overrides,
            ]
            env = {k: v for k, v in os.environ.items() if k not in _PROXY_ENV_VARS}
            env["NO_PROXY"] = "127.0.0.1,localhost"
            log.info("starting reference gateway on %s", base_url)
            with out_path.open("ab") as out:
                process = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=run_dir
                )
            try:
                _wait_ready(process, base_url, out_path, ready_timeout)
                break
            except RuntimeError:
                _stop(process)
                # Most likely lost a race for the port; try another one.
                if attempt_no == 2:
                    raise
                log.warning("agl-server failed to start, retrying on another port")
            except BaseException:
                _stop(process)
                raise
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.Client(base_url=base_url, headers=headers, trust_env=False, timeout=30.0)
        gateway = ReferenceGateway(
            base_url=base_url,
            headers=headers,
            model_name=model_name,
            upstream_base_url=upstream_base_url,
            process=process,
            log_path=out_path,
            _client=client,
        )
        try:
            gateway.register_model(upstream_base_url)
            yield gateway
        finally:
            client.close()
            _stop(process)
            log.info("reference gateway on %s stopped", base_url)
