from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from hypothesis import settings

from agl.core.client import GatewayClient, proxy_base_url
from agl.core.contracts.records import Rollout
from agl.testing.fake_vllm import FakeVllm, serve_in_thread
from agl.testing.processes import GatewayProcess, gateway_process
from tests.helpers.shared import built_once

# Where the suite's time goes (--durations-json), and the longest files first.
pytest_plugins = ["tests.helpers.durations"]

# Tests assert outcomes, never timing: Hypothesis's per-example deadline (200 ms) fails a
# correct test when both cores are busy (seen on test_malformed_upstream under the suite).
settings.register_profile("agl", deadline=None)
settings.load_profile("agl")

if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    # One intra-op thread per worker: with one worker per core, torch's default (a thread
    # per core) puts two spinning OpenMP threads in each worker, and every op waits on the
    # thread the other worker's core is busy with (conf/backend/torch.yaml says the same
    # of a run). The processes a test starts choose their own threads, as they would.
    torch.set_num_threads(1)


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
    state.script = None
    yield state
    state.script = None
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


def proxy_root(gateway: GatewayProcess, rollout: Rollout) -> str:
    """The attempt's proxy prefix, above its ``/openai`` and ``/anthropic`` surfaces."""
    return base_url(gateway, rollout).removesuffix("/openai/v1")


def agent(gateway: GatewayProcess, rollout: Rollout, **kwargs: Any) -> openai.OpenAI:
    """The ``openai`` client a harness of this attempt would use (no retries)."""
    return openai.OpenAI(
        base_url=base_url(gateway, rollout), api_key=rollout.attempt_key, max_retries=0, **kwargs
    )


def anthropic_agent(
    gateway: GatewayProcess, rollout: Rollout, key: str | None = None
) -> anthropic.Anthropic:
    """The ``anthropic`` client a harness of this attempt would use (no retries)."""
    return anthropic.Anthropic(
        base_url=proxy_root(gateway, rollout) + "/anthropic",
        api_key=key or rollout.attempt_key,
        max_retries=0,
    )


def model_requests(
    admin: GatewayClient, rollout: Rollout, type: str = "model_request"
) -> list[dict[str, Any]]:
    """The data of the attempt's recorded calls (``type``: or its failed ones)."""
    return [e.data for e in admin.get_events(rollout.rollout_id, type=type)]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


# The session's short run: 2 steps of the default experiment (merge=prefix), small.
SHORT_RUN = (
    "merge=prefix",
    "trainer.steps=2",
    "trainer.groups_per_step=4",
    "trainer.group_size=8",
    "trainer.val_every=1",
    "trainer.val_size=4",
    "task.warmup_options.steps=30",
    "logging.wandb=false",
    "logging.progress=false",
)


def train_run(folder: Path, *overrides: str) -> Path:
    """``python -m agl.train`` into ``folder`` with ``overrides``; fails the test with
    the run's stderr if it fails."""
    done = subprocess.run(
        [sys.executable, "-m", "agl.train", *overrides, f"hydra.run.dir={folder}"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.fixture(scope="session")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-step ``agl.train`` run of the default experiment (merge=prefix), made once
    for every test that reads a run folder: its tiny model's BPE-dropout makes some
    prompts come back retokenized, which breaks samples. Read it, do not change it."""
    folder = built_once(tmp_path_factory, "short_run", lambda d: train_run(d / "run", *SHORT_RUN))
    return folder / "run"


def vllm_text(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text vLLM returns for sampled ``ids`` that no stop string cut: the eos that
    ended the answer is no text, other special tokens are skipped (vLLM's default) or
    kept, and an unfinished last character is never released."""
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)).rstrip("\ufffd")
