"""``backend=verl`` on Ray with vLLM (``weight_sync=distributed``): verl's rank 0 sends.

What is proved, on CPU (gloo), 2 Ray ranks and a vLLM replica serving the tiny model:
- after each of two ``train()`` steps, ``publish`` (from ``RayVerlPolicy.weight_source``)
  makes the replica serve the workers' weights: its prompt logprobs equal those of the
  workers' gathered weights, at the new policy version;
- nothing went the old way: no full state dict through Ray (``agl_full_state_dict`` not
  called), no load into the trainer's module (it keeps the starting weights), no weights
  file written after the replica's start;
- the old path (the module's own publish after ``_pull``) still serves the same weights.

The whole ``python -m agl.train inference=vllm backend=verl backend.ranks=2`` run is in
``test_vllm.py``. Skipped where vLLM, verl or Ray is missing.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is not installed: pip install --no-deps verl==0.9.1")
pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[verl]'")
pytest.importorskip("peft", reason="verl's FSDP engine imports peft: pip install -e '.[verl]'")

import httpx
import ray
import torch

import agl.strategies.loss  # noqa: F401  (registers the loss strategies)
from agl.backends.inference.models import load_model
from agl.backends.inference.vllm import WEIGHTS_FILE, VllmOptions, VllmServers, find_vllm_python
from agl.backends.training.verl.config import VerlBackendConfig
from agl.backends.training.verl.ray import RayVerlPolicy, start_ray
from agl.strategies.registry import get
from tests.helpers.prompt_logprobs import LOGPROB_TOL, module_logprobs, served_logprobs
from tests.helpers.verl_batches import CLIP_HIGH, CLIP_LOW, SAMPLED, sampled_batch

RANKS = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    python = find_vllm_python()
    if python is None:
        pytest.skip("vLLM is not installed: bash tests/vllm/install.sh (or set AGL_VLLM_PYTHON)")
    os.environ["AGL_RAY_TEST"] = f"agl-test-verl-ray-vllm-{uuid.uuid4().hex[:8]}"
    torch.set_num_threads(1)
    loaded = load_model("tiny")
    options = VllmOptions(python=python, max_model_len=256, startup_timeout_s=900)
    run_dir = tmp_path_factory.mktemp("verl-ray-vllm")
    assert start_ray(None, num_cpus=RANKS + 1), "a Ray was already running in the tests"
    try:
        with VllmServers(
            loaded.model, loaded.tokenizer, "tiny", run_dir, options, api_key=None
        ) as servers:
            config = VerlBackendConfig(
                ranks=RANKS,
                lr=2e-2,
                clip_low=CLIP_LOW,
                clip_high=CLIP_HIGH,
                num_mini_batches=1,
                max_tokens_per_micro_batch=40,
                total_training_steps=4,
            )
            policy = RayVerlPolicy(
                loaded.model,
                config,
                tokenizer=loaded.tokenizer,
                paused=servers.paused,
                work_dir=run_dir / "verl",
            )
            try:
                yield {"loaded": loaded, "servers": servers, "policy": policy}
            finally:
                policy.close()
    finally:
        ray.shutdown()
        os.environ.pop("AGL_RAY_TEST", None)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rank_zero_sends_the_trained_weights_to_vllm(setup: dict[str, Any]) -> None:
    loaded, servers, policy = setup["loaded"], setup["servers"], setup["policy"]
    group = policy.workers.group
    calls = {"full_state_dict": 0, "pull": 0}
    gather, pull = group.agl_full_state_dict, policy._pull

    def counted_gather(*args: Any, **kwargs: Any) -> Any:
        calls["full_state_dict"] += 1
        return gather(*args, **kwargs)

    def counted_pull() -> None:
        calls["pull"] += 1
        pull()

    group.agl_full_state_dict = counted_gather
    policy._pull = counted_pull  # type: ignore[method-assign]
    servers.publish_from(policy.weight_source())
    weights = servers.weights_dir / WEIGHTS_FILE
    written = weights.stat().st_mtime_ns
    start = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    before = served_logprobs(servers.url)
    samples, advantages = sampled_batch(load_model("tiny").model.eval(), seed=5, transforms=SAMPLED)
    loss = get("loss", "rollout_mean")
    workers = load_model("tiny").model.eval()  # a module to hold the workers' weights
    for version in (1, 2):
        policy.train(samples, advantages, loss)
        started = time.monotonic()
        servers.publish(version)
        print(f"rank-0 publish {version}: {time.monotonic() - started:.2f} s")
        assert calls == {"full_state_dict": 0, "pull": 0}
        workers.load_state_dict(gather(), strict=False)  # uncounted: the check's own copy
        expected = module_logprobs(workers)
        served = served_logprobs(servers.url)
        assert float((served - expected).abs().max()) < LOGPROB_TOL
        version_info = httpx.get(f"{servers.endpoints[0].removesuffix('/v1')}/weight_info")
        assert str(version) in str(version_info.json())
    assert float((served - before).abs().max()) > 10 * LOGPROB_TOL  # stale would fail
    assert weights.stat().st_mtime_ns == written
    assert all(torch.equal(v, start[k]) for k, v in loaded.model.state_dict().items())
    # The old path on the same replica: the trainer's module, loaded from rank 0, sends.
    servers._source = None
    policy.publishes_itself = False
    started = time.monotonic()
    pull()
    servers.publish(3)
    print(f"old path (gather through Ray + module publish): {time.monotonic() - started:.2f} s")
    assert float((served_logprobs(servers.url) - expected).abs().max()) < LOGPROB_TOL
