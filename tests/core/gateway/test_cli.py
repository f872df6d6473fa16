"""``python -m agl.gateway``: a bad option is one line on stderr, never a traceback."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agl.testing.processes import free_port, wait_healthy


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["port=abc"], "option port='abc' is not a valid int"),
        (["colour=blue"], "unknown option 'colour'"),
        (["port"], "expected key=value"),
        (["access_log=maybe"], "not a valid bool"),
        (["port=99999"], "port=99999 is not a TCP port"),
        (["max_body_mb=0"], "must be positive"),
    ],
)
def test_bad_options_fail_in_one_line(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agl.gateway", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and message in done.stderr
    assert "Traceback" not in done.stderr


def test_admin_token_is_made_once_with_mode_600(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "AGL_ADMIN_TOKEN"}
    process = subprocess.Popen(
        [sys.executable, "-m", "agl.gateway", f"port={port}", f"run_dir={tmp_path}"],
        env=env,
        stderr=subprocess.PIPE,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", process)
        token_file = tmp_path / "admin_token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        ok = httpx.get(
            f"http://127.0.0.1:{port}/api/models", headers={"Authorization": f"Bearer {token}"}
        )
        assert ok.status_code == 200
        assert (tmp_path / "gateway.db").exists()
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=10)
    assert token not in stderr.decode()  # never logged


def test_no_token_or_key_reaches_the_log(tmp_path: Path) -> None:
    """Even with the access log on and calls failing, tokens and keys stay out of it."""
    from agl.core.client import GatewayClient, proxy_base_url

    port = free_port()
    env = {**os.environ, "AGL_ADMIN_TOKEN": "admin-secret-token"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agl.gateway",
            f"port={port}",
            f"run_dir={tmp_path}",
            "access_log=true",
            "log_level=debug",
            "upstream_retries=0",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(f"{url}/healthz", process)
        admin = GatewayClient(url, "admin-secret-token")
        admin.register_models([{"model": "m", "endpoint": "http://127.0.0.1:9/v1"}])
        (r,) = admin.create_rollouts([{"rollout_id": "r"}])
        admin.patch_rollout("r", "running")
        key = r.attempt_key or ""
        proxied = httpx.post(
            proxy_base_url(url, "r", 1) + "/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert proxied.status_code == 502
        assert (
            httpx.get(f"{url}/api/rollouts", headers={"Authorization": "Bearer nope"}).status_code
            == 401
        )
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=10)
    log = output.decode()
    assert "/proxy/rollout/r/attempt/1" in log  # the access log did run
    assert "admin-secret-token" not in log and key not in log and "nope" not in log
