"""The verl training backend (``agl/backends/training/verl/``) against verl 0.9.1 itself.

1. **Layout.** agl samples ↔ verl rows ↔ ``DataProto`` round-trip (Hypothesis); a token is
   trained through verl iff ``TorchBackend`` trains it; verl's own un-padding
   (``left_right_2_no_padding`` + ``no_padding_2_padding``) reads each response token's
   logprob at the position agl reads it (the previous token); tree samples are refused.
2. **The loss, exact.** On the tiny model, the gradient verl's FSDP engine accumulates
   (``forward_backward_batch``: its micro-batching, its ``ppo_loss`` and ``agg_loss``) on
   agl's folded weights equals the gradient of ``TorchBackend``'s loss (its packed forward
   and PPO-clip), for token_mean / seq_mean / rollout_mean, several micro-batch cuts, and a
   simulated data-parallel split (verl's ``_balance_batch`` order, ``DataProto.chunk``
   shares, verl's ``dp_size`` scaling in ``agg_loss``, then FSDP's average).
3. **Rollout boundaries.** verl's ``_balance_batch`` reorder, dispatch chunking and
   mini-batch iterator applied to agl's hand-offs keep every rollout in one update.
4. **A real update.** ``VerlPolicy.train`` (verl's ``TrainingWorker.train_mini_batch`` on
   verl's FSDP2 engine, in-process on CPU) moves the parameters as ``TorchBackend.train``
   does; the embedded inference engine keeps serving the same (updated) module;
   save/load round-trips.

Skipped where verl is not installed.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip(
    "verl",
    reason="verl 0.9.1 is not installed: pip install -e '.[verl]' && pip install --no-deps "
    "verl==0.9.1",
)
pytest.importorskip("peft", reason="verl's FSDP engine imports peft: pip install -e '.[verl]'")

import torch
from omegaconf import OmegaConf
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import (
    left_right_2_no_padding,
    no_padding_2_padding,
)

import agl.strategies.loss  # noqa: F401  (registers the loss strategies)
from agl.backends.inference.models import load_model
from agl.backends.training.packing import packed_logprobs
from agl.backends.training.schedule import schedule
from agl.backends.training.torch import TorchBackend, TorchBackendConfig, ppo_clip_loss
from agl.backends.training.verl.config import VerlBackendConfig
from agl.backends.training.verl.dataproto import (
    from_dataproto,
    mini_batch_rows,
    to_dataproto,
    to_train_tensordict,
)
from agl.backends.training.verl.layout import (
    TreeSampleError,
    VerlRow,
    full_weights,
    join,
    pad,
    pad_to_multiple,
    split,
    unpad,
)
from agl.backends.training.verl.loss import actor_config
from agl.backends.training.verl.policy import VerlPolicy
from agl.core.contracts.samples import Sample
from agl.strategies.registry import get
from tests.helpers.verl_batches import CLIP_HIGH, CLIP_LOW, PAD, linear_samples, make_batch

CHECKS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOSSES = ("token_mean", "seq_mean", "rollout_mean")


# ----------------------------------------------------------------------------- 1. layout


def _first_token_dropped(s: Sample) -> Sample:
    """What a row keeps of ``s``: a first token is never trained, so not as an action."""
    mask, logprobs = list(s.action_mask), list(s.logprobs)
    mask[0], logprobs[0] = 0, 0.0
    return Sample(s.tokens, mask, logprobs, rollout_id=s.rollout_id, group_id=s.group_id)


@CHECKS
@given(st.lists(linear_samples(), min_size=1, max_size=6), st.data())
def test_rows_and_dataproto_round_trip(samples: list[Sample], data: st.DataObject) -> None:
    advantages = [data.draw(st.floats(-3, 3, allow_nan=False, width=32)) for _ in samples]
    weights = [
        [data.draw(st.floats(0, 1, width=32)) if a else 0.0 for a in s.action_mask] for s in samples
    ]
    rows = mini_batch_rows(samples, advantages, weights)
    for s, w, a, row in zip(samples, weights, advantages, rows, strict=True):
        back = join(row)
        want = _first_token_dropped(s)
        assert (back.tokens, back.action_mask, back.logprobs) == (
            want.tokens,
            want.action_mask,
            want.logprobs,
        )
        assert (back.rollout_id, back.group_id, row.advantage) == (s.rollout_id, s.group_id, a)
        assert len(row.prompt) >= 1 and row.response  # verl: prompt_len > 0
        assert full_weights(row)[1:] == [float(x) for x in w][1:]
        assert split(back, full_weights(row), a) == row
    padded = pad(rows, PAD)
    assert (
        unpad(padded, advantages, [r.rollout_id for r in rows], [r.group_id for r in rows]) == rows
    )
    proto = to_dataproto(rows, PAD)
    assert from_dataproto(proto) == rows
    b = proto.batch
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    assert torch.allclose(b["advantages"], b["agl_advantages"] * b["agl_loss_weights"])
    assert not (b["agl_loss_weights"] * (1 - b["response_mask"])).any()
    assert list(proto.non_tensor_batch["uid"]) == [s.group_id for s in samples]


@CHECKS
@given(st.lists(linear_samples(), min_size=1, max_size=6), st.data())
def test_verl_trains_exactly_the_tokens_torch_trains(
    samples: list[Sample], data: st.DataObject
) -> None:
    weights = [
        [data.draw(st.sampled_from([0.0, 0.5, 1.0])) if a else 0.0 for a in s.action_mask]
        for s in samples
    ]
    rows = mini_batch_rows(samples, [1.0] * len(samples), weights)
    for s, w, row in zip(samples, weights, rows, strict=True):
        torch_trains = {
            i for i, (a, x) in enumerate(zip(s.action_mask, w, strict=True)) if a and x and i > 0
        }
        p = len(row.prompt)
        verl_trains = {
            p + j
            for j, (m, x) in enumerate(zip(row.response_mask, row.weights, strict=True))
            if m and x
        }
        assert verl_trains == torch_trains


@CHECKS
@given(st.lists(linear_samples(), min_size=1, max_size=5))
def test_verl_reads_each_response_logprob_at_the_previous_token(samples: list[Sample]) -> None:
    """verl's own un-padding: feed "the position in the packed sequence" as the model's
    per-token output and see which position each response column reads."""
    rows = mini_batch_rows(samples, [0.0] * len(samples), [[0.0] * len(s) for s in samples])
    td = left_right_2_no_padding(to_dataproto(rows, PAD).to_tensordict())
    total = int(td["input_ids"].offsets()[-1])
    read = no_padding_2_padding(torch.arange(total, dtype=torch.float32), td)
    start = 0
    for i, row in enumerate(rows):
        for j in range(len(row.response)):
            token = len(row.prompt) + j  # index in the sample
            assert int(read[i, j]) == start + token - 1  # its logits row: the previous token
        start += row.length


def test_tree_samples_are_refused() -> None:
    tree = Sample(
        [5, 6, 7, 8],
        [0, 1, 1, 1],
        [0.0, -1.0, -1.0, -1.0],
        rollout_id="r",
        group_id="g",
        position_ids=[0, 1, 2, 2],
        parents=[-1, 0, 1, 1],
    )
    with pytest.raises(TreeSampleError, match="tree"):
        mini_batch_rows([tree], [1.0], [[0.0, 1.0, 1.0, 1.0]])


# ----------------------------------------------------------------------------- 3. boundaries


def balance_batch(batch: DataProto, dp: int, mini_batch_size: int, keep_minibatch: bool) -> None:
    """verl's own ``RayPPOTrainer._balance_batch`` on ``batch``; ``self`` carries only what
    it reads (the actor's dp size and ``ppo_mini_batch_size``), no worker group."""
    trainer = SimpleNamespace(
        config=OmegaConf.create(
            {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini_batch_size}}}
        ),
        actor_rollout_wg=None,
        use_prefix_grouper=False,
        _get_dp_size=lambda worker_group, role: dp,
    )
    RayPPOTrainer._balance_batch(trainer, batch, {}, keep_minibatch=keep_minibatch)


def verl_updates(batch: DataProto, dp: int, mini_batch_size: int) -> list[set[str]]:
    """The rollouts in each optimizer update verl makes of ``batch``: dispatch's even
    chunks (one per dp rank), each rank iterating ``mini_batch_size / dp`` rows per update
    (``TrainingWorker.train_mini_batch``); update k is every rank's k-th mini-batch."""
    per_rank = mini_batch_size // dp
    updates: list[set[str]] = []
    for chunk in batch.chunk(dp):
        td = to_train_tensordict(chunk)
        for k, mini in enumerate(tu.make_iterator(td, mini_batch_size=per_rank, epochs=1)):
            if k == len(updates):
                updates.append(set())
            ids = tu.get(mini, "rollout_id")
            weights = mini["agl_loss_weights"]
            for rid, w in zip(ids, weights.unbind(0), strict=True):
                if w.abs().sum() > 0:
                    updates[k].add(str(rid))
    return updates


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 2**31),
    st.integers(1, 7),
    st.integers(1, 3),
    st.sampled_from([1, 2, 4]),
)
def test_rollouts_stay_in_one_update_through_verl_balancing(
    seed: int, rollouts: int, mini_batches: int, dp: int
) -> None:
    samples, advantages = make_batch(seed, rollouts, max_samples=4)
    mini_batches = min(mini_batches, rollouts)
    plan = schedule(samples, num_mini_batches=mini_batches, ranks=1, max_tokens_per_micro_batch=64)
    loss = get("loss", "rollout_mean")
    seen: set[str] = set()
    for mini in plan.mini_batches:
        index = mini.sample_indices
        chosen = [samples[i] for i in index]
        rows = pad_to_multiple(
            mini_batch_rows(chosen, [advantages[i] for i in index], loss(chosen)), dp
        )
        assert len(rows) % dp == 0
        batch = to_dataproto(rows, PAD)
        balance_batch(batch, dp, len(rows), keep_minibatch=False)
        updates = verl_updates(batch, dp, mini_batch_size=len(rows))
        assert len(updates) == 1  # one hand-off, one update, whatever the order inside
        assert updates[0] == set(mini.rollout_ids)
        assert not (updates[0] & seen)
        seen |= updates[0]
        # fillers train nothing; every real row is there exactly once
        back = from_dataproto(batch)
        real = [r for r in back if r.rollout_id]
        assert sorted(r.length for r in real) == sorted(len(s) for s in chosen)
        assert all(not any(r.weights) for r in back if not r.rollout_id)
    assert seen == {s.rollout_id for s in samples}


def test_stock_verl_mini_batches_split_a_rollout() -> None:
    """Why agl hands verl one mini-batch at a time: verl's own ``ppo_mini_batch_size`` cuts
    rows after balancing, so a rollout of 3 samples ends up in two updates."""
    samples, _ = make_batch(3, rollouts=1, max_samples=1)
    samples = [samples[0], copy.deepcopy(samples[0]), copy.deepcopy(samples[0])]
    samples += [Sample(s.tokens, s.action_mask, s.logprobs, "r1", "g") for s in samples[:1]]
    rows = mini_batch_rows(samples, [1.0] * 4, get("loss", "token_mean")(samples))
    batch = to_dataproto(rows, PAD)
    updates = verl_updates(batch, dp=1, mini_batch_size=2)
    assert len(updates) == 2 and "r0" in updates[0] and "r0" in updates[1]


# ----------------------------------------------------------------------------- 2. exact loss


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VerlPolicy]:
    """One verl worker on the tiny model for the gradient checks (never stepped)."""
    torch.set_num_threads(1)
    loaded = load_model("tiny")
    config = VerlBackendConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    built = VerlPolicy(
        loaded.model, config, tokenizer=loaded.tokenizer, work_dir=tmp_path_factory.mktemp("v")
    )
    yield built
    built.close()


def torch_gradient(
    samples: list[Sample], advantages: list[float], weights: list[list[float]]
) -> dict[str, torch.Tensor]:
    """The gradient of ``TorchBackend``'s loss, Σ w · PPO-clip, on a fresh tiny model
    (same seed = same weights), from its own packed forward and ``ppo_clip_loss``."""
    model = load_model("tiny").model.train()
    logp = packed_logprobs(model, samples)
    total = torch.zeros((), dtype=torch.float32)
    for s, lp, w, a in zip(samples, logp, weights, advantages, strict=True):
        old = torch.tensor(s.logprobs)
        token_loss, _, _ = ppo_clip_loss(lp, old, torch.full_like(lp, a), CLIP_LOW, CLIP_HIGH)
        mask = torch.tensor([1.0 if i > 0 else 0.0 for i in range(len(s))])
        total = total + (torch.tensor(w) * token_loss * mask).sum()
    total.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def verl_gradient(
    policy: VerlPolicy,
    rows: list[VerlRow],
    dp: int,
    micro: dict[str, Any],
) -> tuple[dict[str, torch.Tensor], float]:
    """The gradient verl's FSDP engine accumulates on ``rows``: ordered by verl's
    ``_balance_batch``, cut into ``dp`` dispatch chunks; each chunk is one rank's
    ``forward_backward_batch`` (verl's micro-batching per ``micro``) with ``ppo_loss``
    scaling by ``dp_size`` as on a dp-rank; FSDP averages the ranks' gradients. Answers
    the gradient and the sum of the ranks' losses / dp (the loss FSDP's average trains)."""
    engine = policy.worker.engine
    rows = pad_to_multiple(rows, dp)
    batch = to_dataproto(rows, PAD)
    balance_batch(batch, dp, len(rows), keep_minibatch=False)
    config = actor_config(policy.config)

    def rank_loss(model_output: Any, data: Any, dp_group: Any = None) -> Any:
        tu.assign_non_tensor(data, dp_size=dp)  # what this rank's engine would report
        return ppo_loss(config, model_output, data, dp_group)

    grads: dict[str, torch.Tensor] = {}
    total = 0.0
    with engine.train_mode(zero_grad_on_exit=True):
        for chunk in batch.chunk(dp):
            engine.optimizer_zero_grad()
            td = to_train_tensordict(chunk)
            tu.assign_non_tensor(td, use_remove_padding=False, use_fused_kernels=False, **micro)
            out = engine.forward_backward_batch(td, loss_function=rank_loss)
            total += sum(float(x) for x in out["loss"]) / dp
            for name, p in engine.module.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    grads[name] = grads.get(name, 0) + g.detach().clone() / dp
    return grads, total


MICRO = {
    "one row": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 1},
    "16 tokens": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 16},
    "48 tokens": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 48},
    "all": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 100_000},
}


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize(
    ("micro_name", "dp"), [("one row", 1), ("16 tokens", 1), ("48 tokens", 2), ("all", 3)]
)
def test_verl_gradient_equals_torch_backend_gradient(
    policy: VerlPolicy, loss_name: str, micro_name: str, dp: int
) -> None:
    samples, advantages = make_batch(11, rollouts=3, max_samples=3)
    weights = get("loss", loss_name)(samples)
    ref = torch_gradient(samples, advantages, weights)
    rows = mini_batch_rows(samples, advantages, weights)
    got, _ = verl_gradient(policy, rows, dp, MICRO[micro_name])
    assert set(got) == set(ref)
    worst = max((got[n] - ref[n]).abs().max().item() for n in ref)
    scale = max(ref[n].abs().max().item() for n in ref)
    assert scale > 1e-4  # a real gradient, not two zeros
    assert worst <= 1e-8 + 1e-6 * scale, (loss_name, micro_name, dp, worst, scale)


# ----------------------------------------------------------------------------- 4. update


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def test_verl_update_moves_parameters_as_torch_backend(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    samples, advantages = make_batch(5, rollouts=4, max_samples=2)
    loss = get("loss", "rollout_mean")
    common = {
        "lr": 1e-3,
        "clip_low": CLIP_LOW,
        "clip_high": CLIP_HIGH,
        "num_mini_batches": 2,
        "lr_scheduler_type": "cosine",
        "min_lr_ratio": 0.1,
        "total_training_steps": 4,
    }
    ref_model = load_model("tiny").model
    before = {k: v.clone() for k, v in ref_model.state_dict().items()}
    reference = TorchBackend(ref_model, TorchBackendConfig(max_tokens_per_micro_batch=40, **common))
    ref_metrics = reference.train(samples, advantages, loss)

    loaded = load_model("tiny")
    engine = _engine(loaded)
    try:
        policy = VerlPolicy(
            loaded.model,
            VerlBackendConfig(max_tokens_per_micro_batch=40, **common),
            tokenizer=loaded.tokenizer,
            paused=engine.paused,
            work_dir=tmp_path / "work",
        )
        # FSDP2 has wrapped the module in place; the engine serves it (inference mode)
        fresh = load_model("tiny").model
        assert _engine_logprobs(engine, [5, 6, 7]) == pytest.approx(_greedy(fresh, [5, 6, 7]))
        metrics = policy.train(samples, advantages, loss)
        after = policy.state_dict()
        moved = _max_diff(ref_model.state_dict(), before)
        diff = _max_diff(after, ref_model.state_dict())
        assert moved > 1e-4
        assert diff <= 1e-2 * moved, (diff, moved)
        assert metrics["mini_batches"] == ref_metrics["mini_batches"] == 2
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-4, abs=1e-7)
        assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
        # one schedule step per train(), verl's engine and the torch backend alike
        assert metrics["lr"] == ref_metrics["lr"] == pytest.approx(1e-3)
        scheduled = reference.optimizer.param_groups[0]["lr"]
        assert scheduled < 1e-3
        assert policy.worker.engine.lr_scheduler.get_last_lr()[0] == pytest.approx(scheduled)
        # the inference engine serves the very module verl updated
        assert engine.model is loaded.model
        plain = load_model("tiny").model
        plain.load_state_dict(after)
        served = _engine_logprobs(engine, [5, 6, 7, 8, 9])
        assert served == pytest.approx(_greedy(plain, [5, 6, 7, 8, 9]), abs=1e-4)
        # save / train / load restores the saved weights
        policy.save(tmp_path)
        policy.train(samples, advantages, loss)
        assert _max_diff(policy.state_dict(), after) > 0
        policy.load(tmp_path)
        assert _max_diff(policy.state_dict(), after) == 0.0
        assert policy.worker.engine.lr_scheduler.get_last_lr()[0] == pytest.approx(scheduled)
        policy.close()
    finally:
        engine.close()


def _engine(loaded: Any) -> Any:
    from agl.backends.inference.engine import Engine

    return Engine(loaded.model, loaded.tokenizer, max_batch_size=2, max_context=64, num_threads=1)


def _engine_logprobs(engine: Any, prompt: list[int]) -> tuple[int, float]:
    """One greedy token through the inference engine: (token, its logprob)."""
    from agl.backends.inference.engine import SamplingParams

    async def one() -> tuple[int, float]:
        generation = engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        choice = (await generation.wait())[0]
        return choice.token_ids[0], choice.logprobs[0]

    return asyncio.run(one())


def _greedy(model: Any, prompt: list[int]) -> tuple[int, float]:
    """The greedy next token of a plain model and its logprob."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    token = int(logp.argmax())
    return token, float(logp[token])
