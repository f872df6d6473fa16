"""verl's FSDP workers on Ray (``agl/backends/training/verl/ray.py``), 2 ranks on CPU.

1. **Exact across real ranks.** One ``RayVerlPolicy.train`` (verl's ``RayWorkerGroup`` of
   two ``TrainingWorker`` processes, gloo, FSDP2's gradient average) moves the
   parameters as ``TorchBackend.train`` does on the same batch: dp averaging times
   ``token-sum``'s ``dp_size`` is agl's loss, on real ranks (``test_verl_backend.py``
   simulates the split in one process). The batch's tokens were sampled under per-token
   transforms (temperature, top-p, top-k: each worker's engine scores them under their
   own), and the step has an entropy bonus, a KL to the reference the workers hold and
   token TIS (its π_old from the workers' forward-only pass), so the workers' side of
   all of that is checked too (``test_verl_sampling.py`` checks each alone, in-process,
   gradient by gradient).
2. **Rollouts stay in one update.** Every rollout's rows are in one hand-off, each
   hand-off is one AdamW step on every rank, and both ranks got rows of it.
3. **Weights back, checkpoints.** The trainer's module holds the workers' weights after
   ``train()``; verl's sharded checkpoint round-trips.
4. **No Ray process outlives the tests**, and ``python -m agl.train backend=verl
   backend.ranks=2`` runs end to end.

One Ray (3 logical CPUs, no dashboard, a small object store) and one worker group per
module: starting them is most of the runtime. Skipped where verl or Ray is missing.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is not installed: pip install --no-deps verl==0.9.1")
pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[verl]'")
pytest.importorskip("peft", reason="verl's FSDP engine imports peft: pip install -e '.[verl]'")


import ray
import torch
from verl.utils import tensordict_utils as tu

import agl.strategies.loss  # noqa: F401  (registers the loss strategies)
from agl.backends.inference.models import load_model
from agl.backends.training.torch import TorchBackend, TorchBackendConfig
from agl.backends.training.verl.config import VerlBackendConfig
from agl.backends.training.verl.ray import RayVerlPolicy, start_ray
from agl.strategies.registry import get
from tests.helpers.ray_processes import gone
from tests.helpers.train_runs import run_train, trained_two_steps
from tests.helpers.verl_batches import CLIP_HIGH, CLIP_LOW, SAMPLED, sampled_batch

RANKS = 2
# Marks every process this module's Ray starts (they inherit the environment), so the
# leak check finds ours and not another engineer's Ray on the same machine.
TAG = f"agl-test-verl-ray-{uuid.uuid4().hex[:8]}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_agl_train_runs_verl_on_two_ray_ranks(tmp_path: Path) -> None:
    """``python -m agl.train backend=verl backend.ranks=2``: a subprocess (it starts its
    own Ray, which must be gone once it exits)."""
    tag = f"{TAG}-train"
    result = run_train(
        tmp_path, "backend=verl", f"backend.ranks={RANKS}", env={"AGL_RAY_TEST": tag}, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = trained_two_steps(tmp_path)
    print("agl.train 2 ranks, train_s per step:", [round(r["time/train_s"], 2) for r in steps])
    left = gone(tag)
    assert not left, f"Ray processes outlived agl.train: {[p.cmdline()[:2] for p in left]}"


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    os.environ["AGL_RAY_TEST"] = TAG
    try:
        assert start_ray(None, num_cpus=RANKS + 1), "a Ray was already running in the tests"
        yield
    finally:
        ray.shutdown()
        os.environ.pop("AGL_RAY_TEST", None)
    left = gone(TAG)
    assert not left, f"Ray processes outlived the tests: {[p.cmdline()[:2] for p in left]}"


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "lr": 1e-3,
        "clip_low": CLIP_LOW,
        "clip_high": CLIP_HIGH,
        "num_mini_batches": 2,
        "max_tokens_per_micro_batch": 40,
        "entropy_coef": 0.01,
        "kl_coef": 0.1,
        "kl_type": "k1",  # the reference is the start: k1's gradient is not 0 there
        "rollout_is": "token",
        "rollout_is_threshold": 1.02,
        "lr_scheduler_type": "cosine",
        "min_lr_ratio": 0.1,
        "total_training_steps": 4,
        **extra,
    }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _batch() -> tuple[list, list[float]]:
    """Tokens drawn from tiny under per-token transforms, recorded with noise."""
    return sampled_batch(load_model("tiny").model.eval(), seed=5, transforms=SAMPLED)


@pytest.fixture(scope="module")
def trained(local_ray: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A 2-rank policy after one ``train()``, its hand-offs, and the reference run."""
    torch.set_num_threads(1)
    samples, advantages = _batch()
    loss = get("loss", "rollout_mean")
    ref_model = load_model("tiny").model
    before = {k: v.clone() for k, v in ref_model.state_dict().items()}
    reference = TorchBackend(ref_model, TorchBackendConfig(**_config()))
    ref_metrics = reference.train(samples, advantages, loss)

    loaded = load_model("tiny")
    pauses = []

    def paused() -> Any:
        pauses.append(time.monotonic())
        return torch.no_grad()

    policy = RayVerlPolicy(
        loaded.model,
        VerlBackendConfig(**_config(ranks=RANKS)),
        tokenizer=loaded.tokenizer,
        paused=paused,
        work_dir=tmp_path_factory.mktemp("verl-ray"),
    )
    hand_offs: list[list[str]] = []
    update = policy._update

    def spy(td: Any) -> Any:
        hand_offs.append([str(r) for r in tu.get(td, "rollout_id")])
        return update(td)

    policy._update = spy  # type: ignore[method-assign]
    started = time.perf_counter()
    metrics = policy.train(samples, advantages, loss)
    step_s = time.perf_counter() - started
    policy._update = update  # type: ignore[method-assign]
    try:
        yield {
            "policy": policy,
            "model": loaded.model,
            "reference": ref_model,
            "before": before,
            "metrics": metrics,
            "ref_metrics": ref_metrics,
            "hand_offs": hand_offs,
            "pauses": pauses,
            "step_s": step_s,
            "batch": (samples, advantages, loss),
        }
    finally:
        policy.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_move_parameters_as_torch_backend(trained: dict) -> None:
    policy = trained["policy"]
    after = policy.state_dict()
    reference = trained["reference"].state_dict()
    moved = _max_diff(reference, trained["before"])
    diff = _max_diff(after, reference)
    print(f"2 ranks vs TorchBackend: max |diff| {diff:.2e} for a {moved:.2e} update")
    assert moved > 1e-4
    assert diff <= 1e-2 * moved, (diff, moved)  # test_verl_backend's tolerance
    metrics, ref = trained["metrics"], trained["ref_metrics"]
    assert metrics["mini_batches"] == ref["mini_batches"] == 2
    assert metrics["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    for name in ("entropy", "kl_reference", "correction/is_weight_mean"):
        assert metrics[name] == pytest.approx(ref[name], rel=1e-4, abs=1e-7), name
    assert 0 < ref["correction/is_truncated_fraction"] < 1  # TIS bound some tokens
    assert metrics["lr"] == ref["lr"] == pytest.approx(1e-3)
    print(f"2-rank step: {trained['step_s']:.2f}s")


def test_the_trainers_module_holds_the_workers_weights(trained: dict) -> None:
    """After ``train()`` the served module was loaded from rank 0, under ``paused()``."""
    local = trained["model"].state_dict()
    workers = trained["policy"].state_dict()
    assert _max_diff(local, workers) == 0.0
    assert trained["pauses"], "the weights were loaded outside paused()"
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in local.values())


def test_rollouts_stay_in_one_update_across_ranks(trained: dict) -> None:
    hand_offs = trained["hand_offs"]
    assert len(hand_offs) == 2  # one per agl mini-batch
    seen: dict[str, int] = {}
    for i, rollout_ids in enumerate(hand_offs):
        assert len(rollout_ids) % RANKS == 0  # fillers pad to the dp size
        for rollout in filter(None, rollout_ids):  # "" = a filler, trains nothing
            assert seen.setdefault(rollout, i) == i, f"rollout {rollout} spans two updates"
    samples = trained["batch"][0]
    assert set(seen) == {s.rollout_id for s in samples}
    # every rank stepped exactly once per hand-off
    assert trained["policy"].workers.group.agl_optimizer_steps() == [2] * RANKS


def test_save_load_round_trips_through_verls_checkpoint(trained: dict, tmp_path: Path) -> None:
    policy = trained["policy"]
    samples, advantages, loss = trained["batch"]
    saved = policy.state_dict()
    policy.save(tmp_path)
    for folder in ("verl", "verl_reference"):  # the KL reference is kept, a shard per rank
        assert len(list((tmp_path / folder).glob("model_world_size_2_rank_*.pt"))) == RANKS
    second = policy.train(samples, advantages, loss)
    assert _max_diff(policy.state_dict(), saved) > 0
    policy.load(tmp_path)
    assert _max_diff(policy.state_dict(), saved) == 0.0
    assert _max_diff(trained["model"].state_dict(), saved) == 0.0  # served module too
    # every rank's schedule resumed at the saved step: one agl step, not one per mini-batch
    lr = VerlBackendConfig(**_config()).lr_factor(1) * 1e-3
    assert lr < 1e-3
    assert second["lr"] == pytest.approx(lr)
    assert policy.train(samples, advantages, loss)["lr"] == pytest.approx(lr)
