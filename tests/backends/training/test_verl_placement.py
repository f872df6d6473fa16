"""Where verl's Ray ranks are placed (``agl/backends/training/verl/ray.py``): per node, on
the GPUs training may use.

1. **Per node.** ``backend.gpus_per_node`` splits ``ranks`` into verl's
   ``process_on_nodes`` (``[gpus_per_node] * nodes``); a split that does not divide, or
   spans nodes with agl's own one-node Ray, is refused in one line; a group no node of
   the cluster can hold is refused in one line instead of pending forever.
2. **Training's GPUs only.** agl's local Ray declares the first ``ranks`` visible GPUs,
   and its workers see exactly those (``CUDA_VISIBLE_DEVICES``), never vLLM's.
3. **Across nodes.** On a Ray cluster of two "nodes" (``ray.cluster_utils.Cluster``, each
   declaring 2 logical GPUs it does not have), ``ranks=4 gpus_per_node=2`` puts two
   bundles on each node, and one ``train()`` across both (gloo, the ranks computing on
   CPU while their bundles hold the GPUs' places) moves the parameters as
   ``TorchBackend.train`` does on the same batch.

Skipped where verl or Ray is missing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is not installed: pip install --no-deps verl==0.9.1")
pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[verl]'")
pytest.importorskip("peft", reason="verl's FSDP engine imports peft: pip install -e '.[verl]'")

import ray
import torch
from ray.cluster_utils import Cluster

import agl.strategies.loss  # noqa: F401  (registers the loss strategies)
from agl.backends.inference.models import load_model
from agl.backends.training.torch import TorchBackend, TorchBackendConfig
from agl.backends.training.verl import ray as verl_ray
from agl.backends.training.verl.config import VerlBackendConfig
from agl.backends.training.verl.ray import RayVerlPolicy, check_fits, start_ray, training_gpus
from agl.strategies.registry import get
from tests.helpers.ray_processes import gone
from tests.helpers.verl_batches import CLIP_HIGH, CLIP_LOW, SAMPLED, sampled_batch

TAG = f"agl-test-verl-placement-{uuid.uuid4().hex[:8]}"
GPU_BUNDLE = {"CPU": 1.0, "GPU": 1.0}


# --- 1. per node -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "per_node", "address", "nodes"),
    [(8, None, None, [8]), (8, 8, None, [8]), (16, 8, "auto", [8, 8]), (4, 2, "h:1", [2, 2])],
)
def test_gpus_per_node_is_verls_process_on_nodes(
    ranks: int, per_node: int | None, address: str | None, nodes: list[int]
) -> None:
    config = VerlBackendConfig(ranks=ranks, gpus_per_node=per_node, ray_address=address)
    assert config.process_on_nodes == nodes


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"ranks": 6, "gpus_per_node": 4, "ray_address": "auto"}, "must divide backend.ranks=6"),
        ({"ranks": 8, "gpus_per_node": 4}, "spans nodes: set backend.ray_address"),
        ({"ranks": 2, "gpus_per_node": 0}, "must divide"),
    ],
)
def test_a_split_that_cannot_be_met_is_one_line(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words) as error:
        VerlBackendConfig(**options)
    assert "\n" not in str(error.value)


def test_groups_are_checked_against_the_nodes() -> None:
    eight = {"CPU": 32.0, "GPU": 8.0}
    check_fits([8, 8], GPU_BUNDLE, [eight, eight])
    check_fits([4, 4, 4, 4], GPU_BUNDLE, [eight, eight])  # two groups share a node
    check_fits([2], {"CPU": 1.0}, [{"CPU": 3.0}])  # CPU ranks: no GPU asked for
    with pytest.raises(ValueError, match=r"1 node\(s\) x 16 ranks.*gpus_per_node") as error:
        check_fits([16], GPU_BUNDLE, [eight, eight])  # verl's STRICT_PACK: one node each
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="do not fit"):
        check_fits([8, 8], GPU_BUNDLE, [eight, {"CPU": 32.0}])  # a node without GPUs
    with pytest.raises(ValueError, match="none"):
        check_fits([1], GPU_BUNDLE, [])


# --- 2. training's GPUs only -------------------------------------------------------------------


def test_local_ray_takes_the_first_ranks_gpus() -> None:
    visible = ["0", "1", "2", "3", "4", "5", "6", "7"]
    assert training_gpus(visible, 4) == ["0", "1", "2", "3"]  # 4-7: vLLM's replicas
    assert training_gpus(visible, None) == visible
    assert training_gpus([], 4) == []  # no GPU: the ranks run on CPU
    with pytest.raises(ValueError, match=r"backend.ranks=9 needs 9 GPUs.*8 are visible"):
        training_gpus(visible, 9)


@pytest.fixture
def tagged_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every Ray process the test starts carries a tag; none may outlive it."""
    tag = f"{TAG}-{uuid.uuid4().hex[:4]}"
    monkeypatch.setenv("AGL_RAY_TEST", tag)
    yield tag
    left = gone(tag)
    assert not left, f"Ray processes outlived the test: {[p.cmdline()[:2] for p in left]}"


@ray.remote(num_gpus=1)
def _devices() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_ray_declares_only_trainings_gpus(
    tagged_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose trainer sees GPUs 3,5,6,7 (this machine has none: their discovery is
    stood in for, the rest is Ray's own): Ray holds 2 GPUs for 2 ranks, the first two
    visible, a task given one sees only it (by the node's numbering), and this process's
    own environment is as it was."""
    visible = ["3", "5", "6", "7"]
    monkeypatch.setattr(verl_ray, "visible_gpus", lambda: visible)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(visible))
    assert not ray.is_initialized()
    assert start_ray(None, num_cpus=2, gpus=2)
    try:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5,6,7"
        assert ray.cluster_resources().get("GPU") == 2
        seen = set(ray.get([_devices.remote() for _ in range(4)]))
        assert seen and seen <= {"3", "5"}, seen
    finally:
        ray.shutdown()


# --- 3. across nodes ---------------------------------------------------------------------------


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "lr": 1e-3,
        "clip_low": CLIP_LOW,
        "clip_high": CLIP_HIGH,
        "num_mini_batches": 1,
        "max_tokens_per_micro_batch": 40,
        "lr_scheduler_type": "constant",
        "total_training_steps": 2,
        **extra,
    }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


@pytest.fixture
def two_nodes(tagged_env: str) -> Iterator[Cluster]:
    """A head without GPUs (the trainer's driver) and two nodes of 2 logical GPUs and 2
    CPUs each: 4 one-rank bundles fit only as two per node."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False},
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2, num_gpus=2, object_store_memory=128 * 1024 * 1024)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_four_ranks_train_across_two_nodes(two_nodes: Cluster) -> None:
    torch.set_num_threads(1)
    samples, advantages = sampled_batch(load_model("tiny").model.eval(), seed=5, transforms=SAMPLED)
    loss = get("loss", "rollout_mean")
    ref_model = load_model("tiny").model
    before = {k: v.clone() for k, v in ref_model.state_dict().items()}
    ref_metrics = TorchBackend(ref_model, TorchBackendConfig(**_config())).train(
        samples, advantages, loss
    )

    loaded = load_model("tiny")
    config = VerlBackendConfig(
        **_config(ranks=4, gpus_per_node=2, ray_address=two_nodes.address, device="cpu")
    )
    policy = RayVerlPolicy(loaded.model, config, tokenizer=loaded.tokenizer, bundle_resource="GPU")
    try:
        assert policy.workers.started_ray  # joined the cluster: close() disconnects
        workers = {node.node_id for node in two_nodes.worker_nodes}
        placed = []
        for pg in policy.workers.pool.pgs:
            table = ray.util.placement_group_table(pg)
            placed.append(set(table["bundles_to_node_id"].values()))
            assert len(table["bundles"]) == 2
            assert all(b == GPU_BUNDLE for b in table["bundles"].values())
        # each group packed on one node, the two groups on the two GPU nodes
        assert all(len(nodes) == 1 for nodes in placed)
        assert set().union(*placed) == workers, (placed, workers)
        assert policy._dp == 4

        metrics = policy.train(samples, advantages, loss)
        after = policy.state_dict()
        moved = _max_diff(ref_model.state_dict(), before)
        diff = _max_diff(after, ref_model.state_dict())
        print(f"4 ranks on 2 nodes vs TorchBackend: max |diff| {diff:.2e} for {moved:.2e}")
        assert moved > 1e-4
        # The gradient is torch's (its loss and norm); AdamW's first step, lr·g/(|g|+eps),
        # turns the 4 ranks' summation order into up to ~1% of the step on the few
        # entries whose gradient is near 0 (measured: 1.1e-5 on 7 of 49152, lr 1e-3).
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-4)
        assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
        assert diff <= 2e-2 * moved, (diff, moved)
        assert policy.workers.group.agl_optimizer_steps() == [1] * 4
    finally:
        policy.close()
