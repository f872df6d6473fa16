"""``backend.param_offload`` / ``backend.optimizer_offload`` reach verl's FSDP engine and
change where the shards wait between updates, not what an update computes.

On this CPU machine "offloaded" and "resident" are the same memory, so what is proved is
the plumbing (verl's engine reports both offloads on) and that an update with both on
gives the loss and the weights of one without (verl's own load/offload round trip runs
around it). The GPU memory they free is not measured here.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="backend=verl needs verl 0.9.1: pip install -e '.[verl]'")
pytest.importorskip("peft", reason="verl's FSDP engine imports peft: pip install -e '.[verl]'")

import torch

import agl.strategies.loss  # noqa: F401  (registers the loss strategies)
from agl.backends.inference.models import load_model
from agl.backends.training.verl.config import VerlBackendConfig
from agl.backends.training.verl.policy import VerlPolicy
from agl.core.run.build import backend_config
from agl.strategies.registry import get
from tests.helpers.torch_models import random_batch


def one_update(offload: bool, work_dir: Path) -> tuple[VerlPolicy, float, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    loaded = load_model("tiny")
    config = VerlBackendConfig(param_offload=offload, optimizer_offload=offload)
    policy = VerlPolicy(loaded.model, config, tokenizer=loaded.tokenizer, work_dir=work_dir)
    samples = random_batch(random.Random(0), 4)
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    metrics = policy.train(samples, advantages, get("loss", "token_mean"))
    return policy, metrics["loss"], policy.state_dict()


def test_offload_reaches_verls_engine_and_changes_no_update(tmp_path: Path) -> None:
    plain, plain_loss, plain_weights = one_update(False, tmp_path / "plain")
    offloaded, loss, weights = one_update(True, tmp_path / "offloaded")
    try:
        assert not plain.worker.engine.is_param_offload_enabled
        assert offloaded.worker.engine.is_param_offload_enabled
        assert offloaded.worker.engine.is_optimizer_offload_enabled
        assert loss == plain_loss
        assert weights.keys() == plain_weights.keys()
        assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)
    finally:
        plain.close()
        offloaded.close()


def test_the_options_come_from_conf_backend_verl() -> None:
    group = {"name": "verl", "param_offload": True, "optimizer_offload": True}
    config = backend_config(group, steps=2)
    assert (config.param_offload, config.optimizer_offload) == (True, True)
    assert (VerlBackendConfig().param_offload, VerlBackendConfig().optimizer_offload) == (
        False,
        False,
    )
