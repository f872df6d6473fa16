"""The embedded training backend: PPO-clip on packed sequences, one HF model, AdamW.

One ``train()`` call is one training step. The step is cut by
:func:`agl.backends.training.schedule.schedule` into optimizer mini-batches (a rollout's samples
stay in one) and micro-batches (packed up to ``max_tokens_per_micro_batch`` tokens); each
mini-batch is one AdamW update, its gradient accumulated over its micro-batches.

Invariants:
  - **Exact accumulation.** The loss strategy's per-token weights are computed once per
    mini-batch, over that mini-batch's samples, so ``loss = Σ weight · token_loss`` summed
    over micro-batches equals the loss of the whole mini-batch, however it is packed.
  - **Exact packing.** A micro-batch is ONE row without padding: samples are concatenated,
    the 4D additive attention mask is block-diagonal (no token sees another sample), and
    position ids restart at 0 per sample. Tree samples bring their branch-aware ancestor
    block and their own position ids. So every token's logprob equals the one it gets when
    its sample runs alone (tested to 1e-5). A model with a layer that is not full
    attention (linear attention, a state-space layer, a sliding window) runs each sample
    of the micro-batch as its own forward instead (``packing.packable``), exact too.
  - A token's logprob is read at its parent's logits (linear: the previous token; tree:
    ``parents[i]``); a root token has no parent, so nothing predicts it and it is never
    trained.
  - Logits are computed only for the rows that predict trained tokens (action tokens with a
    nonzero weight), never for the whole ``[T, vocab]``.
  - The model is the caller's object, updated in place (the embedded inference engine
    shares it); its train/eval mode is restored after each step.
  - **fp32 master weights.** A bf16/fp16 model computes (forward, backward) in its dtype,
    but AdamW steps fp32 copies (``agl.backends.training.master``), copied back rounded
    after every update: at a small lr the update would otherwise round away. Checkpoints
    hold the copies.

Token loss (verl's ``compute_policy_loss``, vanilla PPO): with ``ratio = exp(logp_new -
logp_old)`` and the sample's advantage ``A``,
``token_loss = max(-A·ratio, -A·clip(ratio, 1 - clip_low, 1 + clip_high))``, then
``is_weight · token_loss - entropy_coef · H + kl_coef · KL(π || π_ref)``.

Every logprob (new, old, reference) and the entropy are of the distribution the token was
sampled from: each token's ``Sample.sampling`` (temperature, top-k, top-p) applied to the
logits (``agl.backends.sampling``), as the engine applied it. ``logp_old`` is the recorded
(behaviour) logprob; with a rollout correction on (``agl.backends.training.correction``) it is the
trainer's own logprob at the start of the step, and ``is_weight`` its truncated ratio to
the recorded one; tokens the rejection masks stop being actions before the loss strategy
computes the weights.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import transformers

from agl.backends.sampling import logprobs_under
from agl.backends.training.correction import correct
from agl.backends.training.inputs import check_train_inputs
from agl.backends.training.lr_schedule import LrSchedule, step_schedule
from agl.backends.training.master import MasterWeights, needs_master
from agl.backends.training.packing import (
    Packed,
    layer_kinds,
    model_device_dtype,
    pack,
    packable,
    parents_of,
    row_sampling,
    selected_logits,
)
from agl.backends.training.penalties import Guards, entropy_of, kl_penalty
from agl.backends.training.schedule import MiniBatch, schedule
from agl.core.contracts.samples import Sample
from agl.core.contracts.strategies import Loss

logger = logging.getLogger(__name__)


# verl clamps the log-ratio before exp: beyond e^±20 the token is clipped anyway (or its
# loss is hopeless), and an inf ratio would turn the whole step into NaN.
_MAX_LOG_RATIO = 20.0


@dataclass
class TorchBackendConfig(LrSchedule, Guards):
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0  # max grad norm; 0 = off
    clip_low: float = 0.2  # PPO ratio clip: [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    # Optimizer updates per train() call (one per rollout when a step has fewer rollouts
    # with samples); every one after the first is off-policy, which is what the ratio
    # clip is for.
    num_mini_batches: int = 1
    # Packing cap (memory); gradients accumulate over the micro-batches of a mini-batch.
    max_tokens_per_micro_batch: int = 4096
    device: str = "cpu"
    # A bf16/fp16 model: AdamW steps fp32 copies of its weights (False: the weights
    # themselves, which at lr ~1e-6 mostly round the update away; saves 4 bytes/weight).
    fp32_master_weights: bool = True


# --- the loss -----------------------------------------------------------------------------


def ppo_clip_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss, the ratio, and where the clip bound (the clipped term was
    selected and is strictly larger, so that token has no gradient)."""
    log_ratio = (logp_new - logp_old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), ratio, clipped > unclipped


def k3(logp_new: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(behaviour || current) on tokens sampled from the
    behaviour policy: with ``r = p_current / p_behaviour``, ``(r - 1) - log r`` ≥ 0.
    (The other orientation, ``p_behaviour / p_current``, is heavy-tailed here: one token
    the update made unlikely dominates the mean.)"""
    log_r = (logp_new - logp_old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_r) - log_r - 1.0


# --- metrics ------------------------------------------------------------------------------


@dataclass
class _Stats:
    """Running sums over trained tokens and mini-batches of one step."""

    tokens_trained: int = 0
    tokens_computed: int = 0
    micro_batches: int = 0
    entropy: float = 0.0
    clipped: float = 0.0
    kl: float = 0.0
    kl_ref: float = 0.0
    ratio: float = 0.0
    mismatch: float = 0.0
    mismatch_tokens: int = 0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)

    def metrics(self, mini_batches: int, train_s: float) -> dict[str, float]:
        per_token = max(self.tokens_trained, 1)  # no trained token: report 0, not NaN
        return {
            "loss": _mean(self.losses),
            "entropy": self.entropy / per_token,
            "clip_fraction": self.clipped / per_token,
            "kl_behaviour": self.kl / per_token,
            "kl_reference": self.kl_ref / per_token,
            "logprob_mismatch": self.mismatch / max(self.mismatch_tokens, 1),
            "ratio_mean": self.ratio / per_token,
            "grad_norm": _mean(self.grad_norms),
            "tokens_computed": float(self.tokens_computed),
            "tokens_trained": float(self.tokens_trained),
            "micro_batches": float(self.micro_batches),
            "mini_batches": float(mini_batches),
            "train_s": train_s,
            **self.extra,
        }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# --- the backend --------------------------------------------------------------------------


@dataclass
class _Targets:
    """Per sample, per token: the logprob the PPO ratio is taken against, and the IS
    weight of the token's loss (1 without a rollout correction)."""

    logp_old: list[list[float]]
    is_weight: list[list[float]]


class TorchBackend:
    """PPO-clip training of ``model`` in place (see the module doc for the invariants)."""

    def __init__(self, model: transformers.PreTrainedModel, config: TorchBackendConfig) -> None:
        self.config = config
        # nn.Module.to moves in place and returns the same object, so the reference the
        # inference engine holds stays the trained model.
        # (transformers types PreTrainedModel.to through a decorator that loses its signature)
        self.model = model.to(config.device)  # type: ignore[arg-type]
        self.master = (
            MasterWeights(model) if config.fp32_master_weights and needs_master(model) else None
        )
        self.optimizer = torch.optim.AdamW(
            self.master.params if self.master is not None else model.parameters(),
            lr=config.lr,
            betas=(config.betas[0], config.betas[1]),  # a Hydra ListConfig arrives as a list
            weight_decay=config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: config.lr_factor(step)
        )
        if not packable(model):
            logger.info(
                "%s layers: each sample of a micro-batch runs as its own forward (packing "
                "would carry state across samples)",
                ", ".join(layer_kinds(model)),
            )
        # The KL penalty's anchor: the weights as they are now (after any warm-up).
        self.reference = _frozen_copy(model) if config.kl_coef else None

    # -- public API

    def train(self, samples: list[Sample], advantages: list[float], loss: Loss) -> dict[str, float]:
        """One step: one AdamW update per mini-batch; answers the step's metrics.

        ``loss`` (a loss strategy) is called once per mini-batch with that mini-batch's
        samples (after the rejection masks, if any, took tokens out).
        """
        start = time.perf_counter()
        vocab = self.model.get_input_embeddings().num_embeddings
        check_train_inputs(samples, advantages, vocab)
        plan = schedule(
            samples,
            num_mini_batches=self.config.num_mini_batches,
            ranks=1,
            max_tokens_per_micro_batch=self.config.max_tokens_per_micro_batch,
        )
        if plan.oversize_samples:
            logger.warning(
                "%d samples exceed max_tokens_per_micro_batch=%d and ran alone",
                len(plan.oversize_samples),
                self.config.max_tokens_per_micro_batch,
            )
        stats = _Stats()
        was_training = self.model.training
        self.model.train()
        try:
            samples, targets = self._targets(samples, plan, stats)
            for m, mini in enumerate(plan.mini_batches):
                weights = self._weights(samples, mini, loss)
                self._update(samples, advantages, targets, weights, mini, stats, first=m == 0)
        finally:
            self.model.train(was_training)
            # Gradients are as big as the model; the engine gets that memory back.
            self._zero_grad()
        lr = float(self.scheduler.get_last_lr()[0])
        step_schedule(self.scheduler)  # once per step, as verl's train_batch
        return stats.metrics(len(plan.mini_batches), time.perf_counter() - start) | {"lr": lr}

    def state_dict(self) -> dict[str, Any]:
        """A snapshot (CPU copies, so later steps do not change it) of model and optimizer
        (and of the fp32 master weights and the KL reference, which a resumed run must
        keep)."""
        state = {
            "model": _to_cpu_copy(self.model.state_dict()),
            "optimizer": _to_cpu_copy(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
        }
        if self.master is not None:
            state["master"] = self.master.state_dict()
        if self.reference is not None:
            state["reference"] = _to_cpu_copy(self.reference.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Both copy into the existing tensors/device: the model object stays the same.
        self.model.load_state_dict(state["model"])
        if self.master is not None:
            if "master" in state:
                self.master.load_state_dict(state["master"])
            else:  # saved without masters (an fp32 run, or masters off): start from the model
                self.master.reset_from_model()
        self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:  # checkpoints from before the schedule ran at constant lr
            self.scheduler.load_state_dict(state["scheduler"])
        if self.reference is not None and "reference" in state:
            self.reference.load_state_dict(state["reference"])

    # -- the step's targets

    def _targets(
        self, samples: list[Sample], plan: Any, stats: _Stats
    ) -> tuple[list[Sample], _Targets]:
        """``logp_old`` and IS weights; with a correction, the rejected tokens made context."""
        recorded = _Targets(
            [list(s.logprobs) for s in samples], [[1.0] * len(s.tokens) for s in samples]
        )
        correction = self.config.correction
        if not correction.enabled:
            return samples, recorded
        old = self._score(
            samples, [m for mini in plan.mini_batches for m in mini.ranks[0].micro_batches]
        )
        actions = [[i for i, a in enumerate(s.action_mask) if a] for s in samples]
        log_ratios = [
            [old[j][i] - samples[j].logprobs[i] for i in positions]
            for j, positions in enumerate(actions)
        ]
        result = correct(log_ratios, correction)
        stats.extra |= result.metrics
        out: list[Sample] = []
        for j, s in enumerate(samples):
            mask = list(s.action_mask)
            for i, w, keep in zip(actions[j], result.weights[j], result.keep[j], strict=True):
                recorded.is_weight[j][i] = w
                recorded.logp_old[j][i] = old[j][i]
                mask[i] = int(keep)
            out.append(s if mask == s.action_mask else replace(s, action_mask=mask))
        return out, recorded

    @torch.no_grad()
    def _score(
        self, samples: list[Sample], micro_batches: Sequence[list[int]]
    ) -> list[list[float]]:
        """The current weights' logprob of every action token (0 elsewhere), packed as the
        step's micro-batches are."""
        out = [[0.0] * len(s.tokens) for s in samples]
        for micro in micro_batches:
            batch = [samples[i] for i in micro]
            selected = [_scorable(s) for s in batch]
            if not any(selected):
                continue
            _, logp, packed = _forward(self.model, batch, selected)
            for j, i, value in zip(
                packed.sample_index, packed.token_index, logp.tolist(), strict=True
            ):
                out[micro[j]][i] = value
        return out

    # -- one mini-batch

    def _weights(
        self, samples: list[Sample], mini: MiniBatch, loss: Loss
    ) -> dict[int, list[float]]:
        """Loss weights of the mini-batch's samples (by index in ``samples``)."""
        indices = mini.sample_indices
        computed = loss([samples[i] for i in indices])
        if len(computed) != len(indices):
            raise ValueError(
                f"the loss strategy returned weights for {len(computed)} samples, "
                f"expected {len(indices)}"
            )
        weights: dict[int, list[float]] = {}
        for i, w in zip(indices, computed, strict=True):
            if len(w) != len(samples[i].tokens):
                raise ValueError(
                    f"the loss strategy returned {len(w)} weights for sample {i} of "
                    f"{len(samples[i].tokens)} tokens"
                )
            row = [float(x) for x in w]
            if not all(math.isfinite(x) for x in row):
                raise ValueError(f"sample {i} has a non-finite loss weight")
            weights[i] = row
        return weights

    def _update(
        self,
        samples: list[Sample],
        advantages: list[float],
        targets: _Targets,
        weights: dict[int, list[float]],
        mini: MiniBatch,
        stats: _Stats,
        first: bool,
    ) -> None:
        self._zero_grad()
        trained_before = stats.tokens_trained
        mini_loss = 0.0
        for micro in mini.ranks[0].micro_batches:
            mini_loss += self._micro_step(
                samples, advantages, targets, weights, micro, stats, first
            )
        if stats.tokens_trained == trained_before:
            # Nothing to learn from (e.g. every token masked): no step, so weight decay
            # does not move the weights either.
            stats.losses.append(0.0)
            stats.grad_norms.append(0.0)
            return
        stats.losses.append(mini_loss)
        stats.grad_norms.append(self._clip_and_step())

    def _micro_step(
        self,
        samples: list[Sample],
        advantages: list[float],
        targets: _Targets,
        weights: dict[int, list[float]],
        micro: list[int],
        stats: _Stats,
        first: bool,
    ) -> float:
        """Forward and backward one packed micro-batch; answers its share of the loss."""
        batch = [samples[i] for i in micro]
        selected = [_trainable(samples[i], weights[i]) for i in micro]
        if not any(selected):
            return 0.0  # no token would get a gradient: skip the forward too
        logprobs, logp_new, packed = _forward(self.model, batch, selected)
        device = logp_new.device

        def per_token(values: Callable[[int, int], float]) -> torch.Tensor:
            data = [
                values(micro[j], i)
                for j, i in zip(packed.sample_index, packed.token_index, strict=True)
            ]
            return torch.tensor(data, dtype=logp_new.dtype, device=device)

        recorded = per_token(lambda s, i: samples[s].logprobs[i])
        logp_old = per_token(lambda s, i: targets.logp_old[s][i])
        is_weight = per_token(lambda s, i: targets.is_weight[s][i])
        advantage = per_token(lambda s, _: advantages[s])
        weight = per_token(lambda s, i: weights[s][i])
        token_loss, ratio, clipped = ppo_clip_loss(
            logp_new, logp_old, advantage, self.config.clip_low, self.config.clip_high
        )
        token_loss = token_loss * is_weight
        entropy = entropy_of(logprobs)
        if self.config.entropy_coef:
            token_loss = token_loss - self.config.entropy_coef * entropy
        kl_ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logprobs = logprobs_under(
                    selected_logits(self.reference, packed), row_sampling(batch, packed)
                )
                ref = ref_logprobs.gather(-1, packed.targets[:, None]).squeeze(-1)
            kl_ref = kl_penalty(logp_new, ref, self.config.kl_type)
            token_loss = token_loss + self.config.kl_coef * kl_ref
        micro_loss = (weight * token_loss).sum()
        micro_loss.backward()

        with torch.no_grad():
            new = logp_new.detach()
            stats.entropy += entropy.detach().sum().item()
            stats.clipped += clipped.sum().item()
            stats.kl += k3(new, recorded).sum().item()
            stats.ratio += ratio.detach().sum().item()
            if kl_ref is not None:
                stats.kl_ref += kl_ref.detach().sum().item()
            if first:
                stats.mismatch += (new - recorded).abs().sum().item()
                stats.mismatch_tokens += len(packed.token_index)
        stats.tokens_trained += len(packed.token_index)
        stats.tokens_computed += packed.num_tokens
        stats.micro_batches += 1
        return micro_loss.item()

    def _clip_and_step(self) -> float:
        """Clip the accumulated gradient and step; answers its norm before clipping."""
        if self.master is not None:
            self.master.take_grads()
            stepped = self.master.params
        else:
            stepped = list(self.model.parameters())
        params = [p for p in stepped if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in stepped if p.grad is not None])
        if not torch.isfinite(norm):
            # One bad batch must not destroy the weights the engine serves (verl does the
            # same); the NaN/inf norm in the metrics says it happened.
            logger.warning("non-finite grad norm %s: update skipped", norm.item())
            self._zero_grad()
            return norm.item()
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.config.grad_clip, norm)
        self.optimizer.step()
        if self.master is not None:
            self.master.step_done()
        return norm.item()

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)  # with masters, the backward's own grads


def _forward(
    model: transformers.PreTrainedModel, batch: Sequence[Sample], selected: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor, Packed]:
    """One packed forward: the transformed ``[K, V]`` logprobs at the selected tokens'
    rows, the selected tokens' logprobs ``[K]``, and the packing."""
    device, dtype = model_device_dtype(model)
    packed = pack(batch, selected, device, dtype)
    logprobs = logprobs_under(selected_logits(model, packed), row_sampling(batch, packed))
    return logprobs, logprobs.gather(-1, packed.targets[:, None]).squeeze(-1), packed


def _frozen_copy(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    reference.eval()
    return reference


def _scorable(sample: Sample) -> list[int]:
    """Action tokens with a parent to be predicted from."""
    parents = parents_of(sample)
    return [
        i for i, (a, p) in enumerate(zip(sample.action_mask, parents, strict=True)) if a and p >= 0
    ]


def _trainable(sample: Sample, weights: list[float]) -> list[int]:
    """Action tokens with a nonzero weight and a parent to be predicted from."""
    parents = parents_of(sample)
    return [
        i
        for i, (action, w, p) in enumerate(zip(sample.action_mask, weights, parents, strict=True))
        if action and w != 0.0 and p >= 0
    ]


def _to_cpu_copy(value: Any) -> Any:
    """Deep copy with every tensor cloned to CPU (nested dicts/lists as in state dicts)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu_copy(v) for v in value)
    return value
