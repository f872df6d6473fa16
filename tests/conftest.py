from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agl.core.client import GatewayClient, proxy_base_url
from agl.core.records import Rollout
from agl.testing.fake_vllm import FakeVllm, serve_in_thread
from agl.testing.processes import GatewayProcess, gateway_process


@pytest.fixture(scope="session")
def upstream() -> Iterator[tuple[str, FakeVllm]]:
    with serve_in_thread() as served:
        yield served


@pytest.fixture
def fake(upstream: tuple[str, FakeVllm]) -> Iterator[FakeVllm]:
    """The shared fake endpoint, reset around each test."""
    _, state = upstream
    state.fail_next.clear()
    state.delay_s = 0.0
    state.stream_break_after = None
    state.chunk_delay_s = 0.0
    state.raw_next.clear()
    state.requests.clear()
    yield state
    state.fail_next.clear()
    state.delay_s = 0.0
    state.stream_break_after = None


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, upstream: tuple[str, FakeVllm]
) -> Iterator[GatewayProcess]:
    run_dir = tmp_path_factory.mktemp("gateway")
    with (
        gateway_process(run_dir, upstream_backoff_s=0.01, sweep_interval_s=0.1) as gw,
        GatewayClient(gw.url, gw.token) as client,
    ):
        client.register_models([{"model": "policy", "endpoint": upstream[0], "policy_version": 3}])
        yield gw


@pytest.fixture
def admin(gateway: GatewayProcess) -> Iterator[GatewayClient]:
    with GatewayClient(gateway.url, gateway.token, retries=0) as client:
        yield client


@pytest.fixture
def running(admin: GatewayClient) -> Callable[..., Rollout]:
    """Make a running rollout with a fresh id; answers its record (with attempt_key)."""

    def make(**spec: object) -> Rollout:
        rollout_id = f"r-{uuid.uuid4().hex[:12]}"
        admin.create_rollouts([{"rollout_id": rollout_id, "group_id": "g", **spec}])
        return admin.patch_rollout(rollout_id, "running")

    return make


def base_url(gateway: GatewayProcess, rollout: Rollout) -> str:
    return proxy_base_url(gateway.url, rollout.rollout_id, rollout.attempt, rollout.mode)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
