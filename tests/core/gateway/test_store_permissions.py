"""What the gateway keeps on disk is its owner's alone: ``run_dir`` 0700, the store (which
holds the attempt keys' signing secret), its WAL files and the admin token 0600, under
the usual umask of 022 (which makes new files 0644, readable by every local user)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from agl.core.client import GatewayClient, proxy_base_url
from agl.core.gateway import private_files
from agl.core.gateway.private_files import private_dir, private_file
from agl.core.ports import free_port
from agl.testing.fake_vllm import FakeVllm
from agl.testing.processes import GatewayProcess, wait_healthy

STORE_FILES = ("gateway.db", "gateway.db-wal", "gateway.db-shm", "admin_token")
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextmanager
def gateway_under_umask_022(run_dir: Path, log_path: Path) -> Iterator[GatewayProcess]:
    """A gateway that makes its own admin token (``AGL_ADMIN_TOKEN`` unset), its log in
    ``log_path``."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "AGL_ADMIN_TOKEN"}
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "agl.gateway", f"port={port}", f"run_dir={run_dir}"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            umask=0o022,
        )
    gateway = GatewayProcess(f"http://127.0.0.1:{port}", "", run_dir, process)
    try:
        wait_healthy(f"{gateway.url}/healthz", process)
        gateway.token = (run_dir / "admin_token").read_text().strip()
        yield gateway
    finally:
        gateway.stop()


def record_a_call(gateway: GatewayProcess, endpoint: str) -> None:
    """One proxied call, so that the store has written its WAL."""
    with GatewayClient(gateway.url, gateway.token, retries=0) as admin:
        admin.register_models([{"model": "policy", "endpoint": endpoint, "policy_version": 1}])
        admin.create_rollouts([{"rollout_id": "r-1"}])
        r = admin.patch_rollout("r-1", "running")
        url = proxy_base_url(gateway.url, r.rollout_id, r.attempt, r.mode)
        response = httpx.post(
            url + "/chat/completions",
            json=CHAT,
            headers={"Authorization": f"Bearer {r.attempt_key}"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert [e.type for e in admin.get_events("r-1")] == ["model_request"]


def test_run_dir_and_every_store_file_are_private_under_umask_022(
    tmp_path: Path, upstream: tuple[str, FakeVllm]
) -> None:
    run_dir = tmp_path / "run"
    with gateway_under_umask_022(run_dir, tmp_path / "gateway.log") as gateway:
        record_a_call(gateway, upstream[0])
        assert mode(run_dir) == 0o700
        modes = {name: mode(run_dir / name) for name in STORE_FILES}  # the WAL exists now
        assert modes == dict.fromkeys(STORE_FILES, 0o600)


def test_a_run_dir_an_earlier_gateway_left_open_is_tightened_with_a_warning(
    tmp_path: Path, upstream: tuple[str, FakeVllm]
) -> None:
    run_dir, log_path = tmp_path / "run", tmp_path / "gateway.log"
    with gateway_under_umask_022(run_dir, log_path) as gateway:
        record_a_call(gateway, upstream[0])
        gateway.kill()  # kill -9 leaves the WAL and its index behind
    # What a gateway before 0600/0700 left under umask 022.
    os.chmod(run_dir, 0o755)
    for name in STORE_FILES:
        os.chmod(run_dir / name, 0o644)
    log_path.write_bytes(b"")
    with gateway_under_umask_022(run_dir, log_path) as gateway:
        assert mode(run_dir) == 0o700
        assert {name: mode(run_dir / name) for name in STORE_FILES} == dict.fromkeys(
            STORE_FILES, 0o600
        )
        with GatewayClient(gateway.url, gateway.token, retries=0) as admin:
            assert [e.type for e in admin.get_events("r-1")] == ["model_request"]
    log = log_path.read_text()
    assert f"{run_dir} had mode 755, open to other users: now 700" in log, log[-3000:]
    for name in STORE_FILES:
        assert f"{run_dir / name} had mode 644, open to other users: now 600" in log, name


def test_a_folder_or_file_not_ours_to_change_is_a_warning_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A volume's root owned by root, with the gateway in its group (Kubernetes' fsGroup).
    folder, file = tmp_path / "volume", tmp_path / "volume" / "admin_token"
    folder.mkdir(mode=0o775)
    os.chmod(folder, 0o775)
    file.write_text("x")
    os.chmod(file, 0o644)

    def refuse(path: object, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(private_files.os, "chmod", refuse)
    with caplog.at_level(logging.WARNING, logger=private_files.__name__):
        private_dir(folder)
        private_file(file)
    assert [r.getMessage() for r in caplog.records] == [
        f"{folder} has mode 775 and is not ours to change; make it 700",
        f"{file} has mode 644 and is not ours to change; make it 600",
    ]


def test_a_new_file_is_0600_even_under_a_umask_narrower_than_that(tmp_path: Path) -> None:
    previous = os.umask(0o277)
    try:
        private_dir(tmp_path / "run")
        private_file(tmp_path / "run" / "secret")
    finally:
        os.umask(previous)
    assert mode(tmp_path / "run") == 0o700
    assert mode(tmp_path / "run" / "secret") == 0o600
