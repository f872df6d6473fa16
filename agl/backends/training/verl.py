"""verl (0.9.1) as agl's training backend: agl's samples, advantages and loss weights
handed to verl's own actor update (``TrainingWorker.train_mini_batch`` on verl's FSDP
engine, the code ``ActorRolloutRefWorker.update_actor`` runs on every GPU worker). It
trains what ``TorchBackend`` trains, gradient for gradient (``tests/test_verl_backend.py``,
``tests/test_verl_sampling.py``: equal to ~1e-6 of the gradient's scale).

The path of one ``train()`` (:class:`VerlPolicy`):

1. agl's scheduler cuts the step into optimizer mini-batches (a rollout's samples stay in
   one).
2. Before any update, verl's engine runs forward-only (``infer_batch``, as verl's
   ``compute_log_prob``/``compute_ref_log_prob``) where the step needs it: the KL
   reference's logprobs (``kl_coef``), and under a rollout correction (``rollout_is``/
   ``rollout_rs``) π_old, the current weights' own logprobs. The correction
   (``agl.core.trainer.correction``, as ``TorchBackend`` applies it) gives each action token its
   IS weight and makes the rejected tokens context, all before the loss strategy sees
   the samples.
3. The loss strategy's weights are computed once per mini-batch, exactly as in
   ``TorchBackend``.
4. Each mini-batch becomes one ``DataProto`` (:func:`to_dataproto`, verl's field names:
   ``input_ids``, ``attention_mask``, ``position_ids``, ``prompts``, ``responses``,
   ``response_mask``, ``rollout_log_probs`` (recorded), ``old_log_probs`` (the recorded
   ones, or π_old under a correction: verl's decoupled PPO), ``rollout_is_weights``,
   ``ref_log_prob``, ``advantages``, plus ``agl_loss_weights``, ``agl_advantages`` and
   the per-token sampling :data:`SAMPLING_KEYS`), and is handed to verl as ONE verl
   mini-batch (``mini_batch_size`` = the whole hand-off), so whatever verl reorders or
   balances inside it, no rollout is split across updates.
5. verl runs its micro-batches, its ``ppo_loss``/``compute_policy_loss_vanilla`` (inside
   :func:`agl_ppo_loss`), FSDP's gradient reduction, grad clipping and AdamW step.

**Sampling, exact.** Each action token is scored under the transform it was sampled
from (``Sample.sampling``: ``logits / temperature``, top-k, top-p, renormalised; the one
rule of ``agl.backends.sampling``). verl knows a per-*sample* temperature and no
truncation, so agl carries one transform per response column and its engine
(:func:`sampling_engine`: verl's ``FSDPEngineWithLMHead`` with ``prepare_model_outputs``
overridden for batches that carry them) applies ``transformed_logprobs`` exactly where
verl turns logits into logprobs — the update, π_old and the reference alike, in this
process and on every Ray worker. verl's own temperature stays 1. What cannot be made
exact is refused with a ValueError: fused kernels (no logits), Ulysses sequence
parallelism, distillation outputs (:func:`sampled_model_outputs`).

**The loss, exact.** The per-token weight ``w ≥ 0`` is folded into the advantage
(``advantages = w · A``) and verl aggregates with ``loss_agg_mode="token-sum"``:

- PPO-clip is positively homogeneous in ``A``: for ``w ≥ 0``,
  ``w · max(-A·r, -A·clip(r)) = max(-(wA)·r, -(wA)·clip(r))``, and the same holds for
  verl's dual-clip ``min(·, -A·c)`` branch (its ``A < 0`` test keeps its sign; ``w = 0``
  gives 0 on both branches). So verl's per-token loss is exactly ``w ·`` agl's; verl
  multiplies it by ``rollout_is_weights``, agl's IS weight.
- The entropy bonus and the KL penalty are not homogeneous in ``A``: verl's own terms
  (``entropy_coeff``, ``use_kl_loss``) are off, and :func:`agl_ppo_loss` adds
  ``Σ w · (kl_coef · KL - entropy_coef · H)`` itself, from ``agl_loss_weights``, the
  transformed logprobs and entropy, and ``ref_log_prob`` (agl's ``kl_penalty``: verl's
  estimators). The reference is a frozen copy of the policy as it was built (a second
  ``TrainingWorker``, as verl's ``ActorRolloutRefWorker`` holds ``ref``), saved and
  loaded with the checkpoint.
- ``token-sum`` is ``Σ_mb loss · dp_size`` per micro-batch: no division by a micro-batch
  count or token count (verl's FSDP engine calls ``loss.backward()`` per micro-batch
  unscaled), and FSDP *averages* gradients over ``dp_size`` ranks, so the update's
  gradient is ``(1/dp) Σ_ranks dp · Σ_rank w·loss = Σ_minibatch w·loss`` — agl's loss,
  however verl cuts micro-batches or ranks. (``token-mean``/``seq-mean-*`` would put
  verl's own normalization on top of agl's.)
- agl's ``TorchBackend`` has no dual clip; ``clip_ratio_c`` defaults here to a bound the
  ratio never reaches (verl clamps ``log r`` to ±20, ``e^20 < 1e9``), so both backends
  train the same objective. Set it to 3.0 for verl's default dual-clip PPO.

**CPU.** verl 0.9.1 knows CUDA, NPU and ROCm platforms only; on a machine without them
:func:`ensure_cpu_platform` registers a CPU platform through verl's own plugin registry
(``verl.plugin.platform.PlatformRegistry``/``set_platform``: device ``cpu``, collective
backend ``gloo``), and :func:`ensure_process_group` starts a 1-process gloo group, so
verl's FSDP2 engine runs in-process. The engine's module is the caller's ``nn.Module``
(:func:`_shared_module_engine` overrides ``_build_module``, which would otherwise load a
fresh copy from disk): FSDP2's ``fully_shard`` converts it in place, so the embedded
inference engine keeps serving the very object verl updates.

**Many ranks.** ``backend.ranks > 1`` runs the same hand-offs on verl's ``RayWorkerGroup``
of FSDP workers instead (``agl/backends/training/verl_ray.py``): :class:`VerlPolicy`'s
``_updating``/``_update``/``_infer``/``_refresh``/``_dp_size`` (and checkpoints) are the
only steps that differ.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import shutil
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.backends.training.lr_schedule import LrSchedule
from agl.backends.training.penalties import Guards
from agl.backends.training.verl_layout import (
    Padded,
    TokenTargets,
    TreeSampleError,
    VerlRow,
    pad,
    pad_to_multiple,
    split,
    unpad,
)
from agl.core.contracts.samples import Sample
from agl.core.contracts.strategies import Loss
from agl.core.run.services import free_port
from agl.core.trainer.correction import CorrectionConfig, correct
from agl.core.trainer.schedule import schedule

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict
    from verl.protocol import DataProto

logger = logging.getLogger(__name__)


# Above e^20 (verl clamps the log-ratio to ±20), so verl's dual clip never binds and the
# objective is agl's plain PPO-clip.
NO_DUAL_CLIP = 1.0e9

# The engine key (``VERL_ENGINE_DEVICE``) of verl's FSDP engine with agl's sampling
# transform (:func:`sampling_engine`), on every device.
SAMPLING_ENGINE = "agl-sampling"
# Per response column: each token's sampling transform (``agl.core.contracts.samples.Sampling``).
SAMPLING_KEYS = ("agl_temperature", "agl_top_k", "agl_top_p")

__all__ = [
    "NO_DUAL_CLIP",
    "SAMPLING_ENGINE",
    "SAMPLING_KEYS",
    "Penalties",
    "TreeSampleError",
    "VerlBackendConfig",
    "VerlPolicy",
    "actor_config",
    "agl_ppo_loss",
    "build_worker",
    "ensure_cpu_platform",
    "ensure_process_group",
    "from_dataproto",
    "loss_fn",
    "mini_batch_rows",
    "register_sampling_engine",
    "response_logprobs",
    "sampled_model_outputs",
    "sampling_engine",
    "score_rows",
    "to_dataproto",
    "to_infer_tensordict",
    "to_train_tensordict",
    "worker_config",
]


# --- configuration ------------------------------------------------------------------------


@dataclass
class VerlBackendConfig(LrSchedule, Guards):
    """``conf/backend/verl.yaml``: torch.yaml's options plus verl's own."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0  # verl requires one (optim.clip_grad); a huge value = off
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float = NO_DUAL_CLIP  # 3.0 = verl's dual-clip PPO
    num_mini_batches: int = 1  # agl mini-batches (optimizer updates) per train()
    ppo_epochs: int = 1  # verl passes over each hand-off; each pass is one update
    # Micro-batching inside verl: a token cap (use_dynamic_bsz) or a fixed row count.
    use_dynamic_bsz: bool = True
    max_tokens_per_micro_batch: int = 4096  # verl: ppo_max_token_len_per_gpu
    ppo_micro_batch_size_per_gpu: int = 4  # used when use_dynamic_bsz is false
    strategy: str = "fsdp2"  # verl engine: fsdp (FSDP1) | fsdp2
    param_dtype: str = "fp32"  # FSDP mixed precision; bf16 on GPU for speed
    use_remove_padding: bool = False  # True needs flash-attn (GPU)
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    device: str = "auto"  # auto: verl's platform (cuda/npu) if any, else the CPU plugin
    # Where the update runs: 1 rank in this process (VerlPolicy), or a Ray worker group
    # of `ranks` FSDP workers (verl_ray.RayVerlPolicy; `ray: true` forces it for 1 rank).
    ranks: int = 1
    ray: bool = False
    ray_address: str | None = None  # None: start a local Ray; "auto"/"host:port": join one
    # Carried over from torch.yaml so one override line serves both backends.
    torch_threads: int = 2

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.entropy_coef, self.kl_coef, self.kl_type)

    @property
    def on_ray(self) -> bool:
        """Whether the update runs on a Ray worker group (``verl_ray``)."""
        return self.ray or self.ranks > 1 or self.ray_address is not None

    def __post_init__(self) -> None:
        if self.strategy not in ("fsdp", "fsdp2"):
            raise ValueError(f"backend.strategy must be fsdp or fsdp2, not {self.strategy!r}")
        for name in ("num_mini_batches", "ppo_epochs", "max_tokens_per_micro_batch", "ranks"):
            if getattr(self, name) < 1:
                raise ValueError(f"backend.{name} must be at least 1")
        if not self.clip_ratio_c > 1.0:
            raise ValueError("backend.clip_ratio_c must be > 1 (verl's dual-clip bound)")
        super().__post_init__()


@dataclass(frozen=True)
class Penalties:
    """The per-token terms agl adds to verl's PPO loss (see :func:`agl_ppo_loss`)."""

    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"

    @property
    def active(self) -> bool:
        return bool(self.entropy_coef or self.kl_coef)


def actor_config(config: VerlBackendConfig) -> Any:
    """verl's ``FSDPActorConfig`` for agl's exact loss (see the module doc)."""
    from verl.workers.config.actor import FSDPActorConfig, PolicyLossConfig

    return FSDPActorConfig(
        strategy=config.strategy,
        rollout_n=1,  # agl's groups are formed before verl; verl never repeats prompts
        ppo_mini_batch_size=1,  # unused: each train_mini_batch call gets its size
        ppo_micro_batch_size_per_gpu=config.ppo_micro_batch_size_per_gpu,
        use_dynamic_bsz=config.use_dynamic_bsz,
        ppo_max_token_len_per_gpu=config.max_tokens_per_micro_batch,
        clip_ratio=config.clip_low,
        clip_ratio_low=config.clip_low,
        clip_ratio_high=config.clip_high,
        clip_ratio_c=config.clip_ratio_c,
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
        loss_agg_mode="token-sum",
        # verl would add these token-summed but unweighted; agl_ppo_loss adds them weighted.
        entropy_coeff=0.0,
        use_kl_loss=False,
        ppo_epochs=config.ppo_epochs,
        shuffle=False,
        use_torch_compile=False,
    )


# --- samples -> rows -> DataProto ---------------------------------------------------------


def mini_batch_rows(
    samples: Sequence[Sample],
    advantages: Sequence[float],
    weights: Sequence[Sequence[float]],
    targets: Sequence[TokenTargets] | None = None,
) -> list[VerlRow]:
    """One verl row per sample (in order); ``weights[i]`` (and ``targets[i]``) aligned
    with sample i's tokens."""
    targets = targets if targets is not None else [TokenTargets()] * len(samples)
    if not (len(samples) == len(advantages) == len(weights) == len(targets)):
        raise ValueError(
            f"{len(samples)} samples, {len(advantages)} advantages, {len(weights)} weight "
            f"lists, {len(targets)} targets"
        )
    return [
        split(s, w, a, t) for s, w, a, t in zip(samples, weights, advantages, targets, strict=True)
    ]


def to_dataproto(rows: Sequence[VerlRow], pad_id: int) -> DataProto:
    """``rows`` as verl's actor-update ``DataProto`` (left-padded prompts, right-padded
    responses). ``advantages`` is the folded ``w · A`` verl's loss reads; the raw scalar
    advantage and the weights travel as ``agl_advantages``/``agl_loss_weights``;
    ``uid`` (verl's group key) is agl's ``group_id``, ``rollout_id`` is kept.

    verl's names for the rest: ``rollout_log_probs`` (recorded, the behaviour policy),
    ``old_log_probs`` (the PPO ratio's π_old: the recorded logprobs, or the trainer's own
    under a rollout correction), ``rollout_is_weights``, ``ref_log_prob``; each only
    when a row has it, as the per-column sampling transform (:data:`SAMPLING_KEYS`). verl's
    own (per-sample) ``temperature`` stays 1: agl's transform replaces it.
    """
    import numpy as np
    import torch
    from verl.protocol import DataProto

    p = pad(rows, pad_id)
    long = {
        "input_ids": p.input_ids,
        "attention_mask": p.attention_mask,
        "position_ids": p.position_ids,
        "prompts": p.prompts,
        "responses": p.responses,
        "response_mask": p.response_mask,
    }
    tensors: dict[str, torch.Tensor] = {
        k: torch.tensor(v, dtype=torch.long) for k, v in long.items()
    }
    recorded = torch.tensor(p.logprobs, dtype=torch.float32)
    weights = torch.tensor(p.weights, dtype=torch.float32)
    raw = torch.tensor(p.advantages, dtype=torch.float32)
    old = recorded if p.old_logprobs is None else torch.tensor(p.old_logprobs)
    tensors |= {
        "old_log_probs": old.float(),
        "rollout_log_probs": recorded.clone(),
        "advantages": raw * weights,
        "agl_advantages": raw,
        "agl_loss_weights": weights,
    }
    if p.is_weights is not None:
        tensors["rollout_is_weights"] = torch.tensor(p.is_weights, dtype=torch.float32)
    if p.ref_logprobs is not None:
        tensors["ref_log_prob"] = torch.tensor(p.ref_logprobs, dtype=torch.float32)
    if p.temperature is not None:
        # float64 carries the config's floats exactly; the engine rounds them to float32
        # as agl.backends.sampling.sampling_tensors does.
        tensors |= {
            "agl_temperature": torch.tensor(p.temperature, dtype=torch.float64),
            "agl_top_k": torch.tensor(p.top_k, dtype=torch.long),
            "agl_top_p": torch.tensor(p.top_p, dtype=torch.float64),
        }
    non_tensors = {
        "uid": np.array([r.group_id for r in rows], dtype=object),
        "rollout_id": np.array([r.rollout_id for r in rows], dtype=object),
        "agl_advantage": np.array([r.advantage for r in rows], dtype=np.float64),
    }
    return DataProto.from_dict(
        tensors=tensors, non_tensors=non_tensors, meta_info={"temperature": 1.0}
    )


def from_dataproto(data: DataProto) -> list[VerlRow]:
    """The rows a :func:`to_dataproto` batch holds, in its current row order (a batch
    whose ``old_log_probs`` are its recorded ones gives rows without ``old_logprobs``)."""
    import torch

    batch = data.batch
    keys = set(batch.keys())

    def rows_of(key: str) -> list[list[Any]]:
        return batch[key].tolist()

    def optional(key: str) -> list[list[Any]] | None:
        return rows_of(key) if key in keys else None

    same_old = torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    padded = Padded(
        prompts=rows_of("prompts"),
        responses=rows_of("responses"),
        input_ids=rows_of("input_ids"),
        attention_mask=rows_of("attention_mask"),
        position_ids=rows_of("position_ids"),
        response_mask=rows_of("response_mask"),
        logprobs=rows_of("rollout_log_probs"),
        weights=rows_of("agl_loss_weights"),
        advantages=rows_of("agl_advantages"),
        temperature=optional("agl_temperature"),
        top_k=optional("agl_top_k"),
        top_p=optional("agl_top_p"),
        old_logprobs=None if same_old else rows_of("old_log_probs"),
        is_weights=optional("rollout_is_weights"),
        ref_logprobs=optional("ref_log_prob"),
    )
    nt = data.non_tensor_batch
    return unpad(
        padded,
        [float(a) for a in nt["agl_advantage"]],
        [str(r) for r in nt["rollout_id"]],
        [str(g) for g in nt["uid"]],
    )


def to_train_tensordict(
    data: DataProto, ppo_epochs: int = 1, calculate_entropy: bool = False
) -> TensorDict:
    """The ``TensorDict`` verl's ``train_mini_batch`` takes, made as
    ``RayPPOTrainer._update_actor`` makes it, with ONE verl mini-batch: the whole batch.
    ``calculate_entropy``: the engine also answers each token's entropy (for the bonus)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(data.to_tensordict())
    n = len(data)
    tu.assign_non_tensor(
        td,
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=n,
        mini_batch_size=n,  # the rollout-boundary guarantee: one update per hand-off
        epochs=ppo_epochs,
        seed=0,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    return td


def to_infer_tensordict(data: DataProto) -> TensorDict:
    """The ``TensorDict`` of a forward-only pass (``infer_batch``: logprobs, no loss), made
    as ``RayPPOTrainer._compute_old_log_prob`` makes it."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        compute_loss=False,
    )
    return td


def response_logprobs(worker: Any, td: TensorDict) -> TensorDict | None:
    """``worker.infer_batch`` (verl's ``TrainingWorker``) on ``td``: the logprob of every
    response column, ``[rows, R]`` (None on a rank that answers nothing)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    output = worker.infer_batch(td)
    if output is None:
        return None
    logprobs = no_padding_2_padding(tu.get(output, "log_probs"), td).float().cpu()
    return tu.get_tensordict({"log_probs": logprobs})


# --- the loss ------------------------------------------------------------------------------


def agl_ppo_loss(
    config: Any,
    penalties: Penalties,
    model_output: dict[str, Any],
    data: TensorDict,
    dp_group: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """verl's ``ppo_loss`` (PPO-clip on the folded ``w · A``, times ``rollout_is_weights``
    when the batch has them) plus ``Σ w · (kl_coef · KL(π || π_ref) - entropy_coef · H)``.

    The entropy and KL terms are not homogeneous in ``A``, so they cannot ride in the
    folded advantage: they are weighted by ``agl_loss_weights`` here, and aggregated as
    verl aggregates ``token-sum`` (``Σ · dp_size``, which FSDP's average over ranks
    cancels). KL is agl's ``kl_penalty`` (verl's formulas, ``tests/test_verl_crosscheck``)
    against the batch's ``ref_log_prob``; both logprobs and the entropy are of each token's
    sampling transform (:func:`sampled_model_outputs`).
    """
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from agl.backends.training.penalties import kl_penalty

    # verl's own entropy term is off (entropy_coeff 0); keep it from computing one.
    policy_output = {k: v for k, v in model_output.items() if k != "entropy"}
    loss, metrics = ppo_loss(config, policy_output, data, dp_group)
    if not penalties.active:
        return loss, metrics
    weights = data["agl_loss_weights"]
    mask = data["response_mask"].bool()
    trained = mask & (weights != 0)
    metrics["agl/trained_tokens"] = float(trained.sum())
    term = 0.0
    if penalties.entropy_coef:
        entropy = no_padding_2_padding(model_output["entropy"], data)
        term = term - penalties.entropy_coef * entropy
        metrics["agl/entropy_sum"] = float(entropy.detach()[trained].sum())
    if penalties.kl_coef:
        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        kl = kl_penalty(log_prob, data["ref_log_prob"], penalties.kl_type)
        term = term + penalties.kl_coef * kl
        metrics["agl/kl_reference_sum"] = float(kl.detach()[trained].sum())
    extra = agg_loss(
        loss_mat=weights * term,
        loss_mask=mask,
        loss_agg_mode="token-sum",
        dp_size=data["dp_size"],
    )
    return loss + extra, metrics


# --- the sampling transform in verl's engine -----------------------------------------------


def score_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row of ``[T, V]`` logits: the logprob of ``labels`` under the row's transform
    (``agl.backends.sampling.transformed_logprobs``), and its entropy if asked.

    Only rows with a transform go through it (a sort per row for top-k/top-p); the rest
    are plain ``log_softmax``, which is what the transform is for them, bit for bit.
    """
    import torch

    from agl.backends.sampling import transformed_logprobs
    from agl.backends.training.penalties import entropy_of

    logprobs = torch.log_softmax(logits, dim=-1)
    changed = ((temperature != 1.0) | (top_k > 0) | (top_p < 1.0)).nonzero().squeeze(-1)
    if changed.numel():
        rows = transformed_logprobs(
            logits[changed], temperature[changed], top_k[changed], top_p[changed]
        )
        logprobs = logprobs.index_copy(0, changed, rows)
    picked = logprobs.gather(-1, labels[:, None]).squeeze(-1)
    return picked, entropy_of(logprobs) if entropy else None


def _packed_sampling(
    micro_batch: TensorDict, total: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-column sampling of ``micro_batch`` at the packed rows whose logits predict
    those columns (untransformed elsewhere): ``[total]`` each.

    Column ``j`` of row ``i`` is predicted by packed row ``end_i - R_i - 1 + j`` (``end_i``
    the row's end, ``R_i`` its response length), where verl's ``no_padding_2_padding``
    reads its logprob.
    """
    import torch

    attention = micro_batch["attention_mask"]
    width_p = micro_batch["prompts"].shape[1]
    response_len = attention[:, width_p:].sum(dim=1)
    ends = attention.sum(dim=1).cumsum(dim=0)
    temperature, top_k, top_p = (micro_batch[k] for k in SAMPLING_KEYS)
    columns = torch.arange(temperature.shape[1], device=temperature.device)
    valid = columns[None, :] < response_len[:, None]
    rows = ((ends - response_len - 1)[:, None] + columns[None, :])[valid]
    device = temperature.device
    out_t = torch.ones(total, dtype=torch.float32, device=device)
    out_k = torch.zeros(total, dtype=torch.long, device=device)
    out_p = torch.ones(total, dtype=torch.float32, device=device)
    out_t[rows] = temperature[valid].to(torch.float32)
    out_k[rows] = top_k[valid]
    out_p[rows] = top_p[valid].to(torch.float32)
    return out_t, out_k, out_p


def sampled_model_outputs(
    engine: Any, output: Any, output_args: dict[str, Any], micro_batch: TensorDict
) -> dict[str, Any]:
    """``FSDPEngineWithLMHead.prepare_model_outputs`` for a batch carrying agl's per-token
    sampling: each token's logprob (and entropy) under its own transform, as nested
    tensors over the packed sequence exactly as verl answers them.

    Refuses, with a ValueError, what would not be exact: fused kernels (no logits to
    transform), Ulysses sequence parallelism (sharded rows) and distillation outputs.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from verl.utils import tensordict_utils as tu

    def flag(key: str, default: bool = False) -> bool:
        return bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=default))

    if flag("use_fused_kernels"):
        raise ValueError(
            "agl's per-token sampling transform needs the logits: use_fused_kernels computes "
            "logprobs without them (turn fused kernels off)"
        )
    if getattr(engine, "use_ulysses_sp", False):
        raise ValueError(
            "agl's per-token sampling transform is not implemented for Ulysses sequence "
            "parallelism (ulysses_sequence_parallel_size > 1)"
        )
    if (
        flag("distillation_use_topk")
        or flag("distillation_only")
        or flag("calculate_sum_pi_squared")
    ):
        raise ValueError("agl's sampling transform does not produce distillation outputs")
    offsets = micro_batch["input_ids"].offsets()
    total = int(offsets[-1])
    logits = output.logits
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if flag("use_remove_padding", True):
        # (1, total + pad, V); verl's packed pad is a suffix
        logits = logits.squeeze(0)[:total]
        labels = output_args["input_ids_rmpad_rolled"][:total]
    else:
        # (bsz, max_len, V): each row's real tokens, in order, is the packed sequence
        lengths = offsets.diff()
        keep = torch.arange(logits.shape[1], device=logits.device)[None, :] < lengths[:, None]
        logits = logits[keep]
        labels = output_args["input_ids_rmpad_rolled"]
    # log_softmax in fp32 at least, as TorchBackend (a bf16 model's logits included)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_probs, entropy = score_rows(
        logits, labels, *_packed_sampling(micro_batch, total), entropy=flag("calculate_entropy")
    )
    out = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, offsets)}
    if entropy is not None:
        out["entropy"] = torch.nested.nested_tensor_from_jagged(entropy, offsets)
    return out


@functools.cache
def sampling_engine() -> type:
    """verl's ``FSDPEngineWithLMHead`` scoring a batch with :data:`SAMPLING_KEYS` under
    them (:func:`sampled_model_outputs`); any other batch goes through verl unchanged."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    class SamplingEngine(FSDPEngineWithLMHead):
        def prepare_model_outputs(
            self,
            output: Any,
            output_args: dict[str, Any],
            micro_batch: TensorDict,
            logits_processor_func: Any,
        ) -> dict[str, Any]:
            if SAMPLING_KEYS[0] not in micro_batch:
                return super().prepare_model_outputs(
                    output, output_args, micro_batch, logits_processor_func
                )
            return sampled_model_outputs(self, output, output_args, micro_batch)

    return SamplingEngine


def register_sampling_engine() -> str:
    """Register :func:`sampling_engine` under :data:`SAMPLING_ENGINE` (once per process);
    answers the key to put in ``VERL_ENGINE_DEVICE``, which verl's registry honours on
    any platform (CPU, CUDA, NPU)."""
    from verl.workers.engine import EngineRegistry

    registry = EngineRegistry._engines.get("language_model", {})
    if all(SAMPLING_ENGINE in registry.get(b, {}) for b in ("fsdp", "fsdp2")):
        return SAMPLING_ENGINE
    EngineRegistry.register(
        model_type="language_model", backend=["fsdp", "fsdp2"], device=SAMPLING_ENGINE
    )(sampling_engine())
    return SAMPLING_ENGINE


# --- verl on this machine -----------------------------------------------------------------


def ensure_cpu_platform() -> str:
    """verl's platform name here; registers and selects a CPU platform if verl has none.

    verl falls back to CUDA when it detects no accelerator, and then fails at the first
    ``torch.cuda`` call; the plugin registry is verl's own way to add a device.
    """
    import torch
    from verl.plugin.platform import (
        PlatformBase,
        PlatformRegistry,
        get_platform,
        platform_manager,
        set_platform,
    )

    current = platform_manager._current_platform
    if current is not None and current.is_available():
        return current.device_name
    if current is None:
        try:
            platform = get_platform()
            if platform.is_available():
                return platform.device_name
        except Exception:
            pass

    class CPUPlatform(PlatformBase):
        """Plain CPU: device ``cpu``, gloo collectives, no profiler, no IPC."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> Any:
            return _CPU_DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"  # verl passes it to .to(): a device, not a CUDA index

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    PlatformRegistry.register(platform="cpu")(CPUPlatform)
    set_platform(CPUPlatform())
    return "cpu"


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the CUDA-style memory counters verl's worker logs (0 here)."""

    def __getattr__(self, name: str) -> Any:
        import torch

        if name == "get_device_name":
            return lambda *args, **kwargs: "CPU"  # verl's flops table: unknown = inf
        if name in ("get_rng_state", "set_rng_state"):
            return getattr(torch, name)  # checkpoints save "the device's" RNG: the CPU's
        if name == "mem_get_info":
            return lambda *args, **kwargs: (0, 0)
        if name.startswith(("max_memory_", "memory_", "reset_peak_memory")):
            return lambda *args, **kwargs: 0
        return getattr(torch.cpu, name)


_CPU_DEVICE_MODULE = _CPUDeviceModule("agl_verl_cpu")


def ensure_process_group() -> None:
    """A 1-process group (gloo on CPU) unless one is running; sets the env verl's
    ``Worker`` reads (RANK, WORLD_SIZE, MASTER_ADDR/PORT) where unset."""
    import torch.distributed as dist
    from verl.utils.device import get_device_name

    if not dist.is_initialized():
        backend = "gloo" if get_device_name() == "cpu" else f"cpu:gloo,{get_device_name()}:nccl"
        rank = int(os.environ.get("RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        if world_size == 1:
            # One process needs no rendezvous: an in-memory store, no port to race for
            # (a port picked free and bound later was taken meanwhile in agl.train runs).
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


_engine_serial = [0]


def _shared_module_engine(module: torch.nn.Module) -> str:
    """Register :func:`sampling_engine`'s class, building on ``module`` instead of loading
    one from disk, under a fresh device key; answers the key (for ``VERL_ENGINE_DEVICE``).

    Only ``_build_module`` differs (and, for batches with per-token sampling, the logprob
    read-out): verl's own steps there that touch an existing model (monkey patches for
    remove-padding, dtype, gradient checkpointing) are kept; the FSDP wrap, optimizer,
    forward/backward, loss, step and checkpointing are verl's, unchanged.
    """
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.torch_dtypes import PrecisionType
    from verl.workers.engine import EngineRegistry

    class SharedModuleEngine(sampling_engine()):  # type: ignore[misc, valid-type]
        def _build_module(self) -> torch.nn.Module:
            dtype = PrecisionType.to_dtype(self.engine_config.model_dtype or "fp32")
            apply_monkey_patch(
                model=module,
                use_remove_padding=self.use_remove_padding,
                ulysses_sp_size=self.ulysses_sequence_parallel_size,
                use_fused_kernels=self.model_config.use_fused_kernels,
            )
            module.to(dtype)  # in place: the caller's object stays the module
            if self.model_config.enable_gradient_checkpointing:
                module.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
            return module

    _engine_serial[0] += 1
    key = f"agl-shared-{os.getpid()}-{_engine_serial[0]}"
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=key)(
        SharedModuleEngine
    )
    return key


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _config_folder(model: Any, tokenizer: Any, folder: Path) -> Path:
    """The HF config (+ tokenizer) verl's ``HFModelConfig`` reads; no weights."""
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]  # verl asserts exactly one
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def worker_config(config: VerlBackendConfig, model_path: Path, reference: bool = False) -> Any:
    """verl's ``TrainingWorkerConfig`` (FSDP engine, AdamW, constant lr) for the HF folder
    ``model_path``: the config only (in-process, the engine is built on the caller's
    module) or config plus weights (Ray workers load them, see ``verl_ray``).

    ``reference``: the KL reference's worker, only ever run forward (``infer_batch``); it
    reshards after each forward (nothing serves it) and checkpoints its weights only. Not
    verl's ``forward_only`` engine: that one defaults to bf16 weights and pinned CPU
    offload, and the reference must score exactly as the policy did when it was built.
    """
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )

    model_config = HFModelConfig(
        path=str(model_path),
        override_config={"attn_implementation": config.attn_implementation},
        use_remove_padding=config.use_remove_padding,
        enable_gradient_checkpointing=config.gradient_checkpointing,
    )
    precision = {"param_dtype": config.param_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine_config = FSDPEngineConfig(
        strategy=config.strategy,
        mixed_precision=precision,
        model_dtype="fp32",
        use_torch_compile=False,
        use_dynamic_bsz=config.use_dynamic_bsz,
        max_token_len_per_gpu=config.max_tokens_per_micro_batch,
        micro_batch_size_per_gpu=config.ppo_micro_batch_size_per_gpu,
        # forward-only passes (π_old, the reference) micro-batch as the update does
        infer_max_token_len_per_gpu=config.max_tokens_per_micro_batch,
        infer_micro_batch_size_per_gpu=config.ppo_micro_batch_size_per_gpu,
        # Keep the full parameters between forwards: the inference engine shares them
        # in-process (harmless on Ray workers, whose modules nothing else reads).
        reshard_after_forward=reference,
    )
    optimizer_config = FSDPOptimizerConfig(
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=tuple(config.betas),
        clip_grad=config.grad_clip,
        total_training_steps=1,  # agl's schedule replaces verl's (follow_schedule)
        lr_scheduler_type="constant",
    )
    contents = ["model"] if reference else ["model", "optimizer", "extra"]
    return TrainingWorkerConfig(
        model_type="language_model",
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(save_contents=contents, load_contents=contents),
    )


def loss_fn(config: VerlBackendConfig) -> Callable[..., Any]:
    """:func:`agl_ppo_loss` bound to agl's exact-loss actor config and the penalties
    (``set_loss_fn``; a partial of module-level names, so Ray can ship it)."""
    return functools.partial(agl_ppo_loss, actor_config(config), config.penalties)


def build_worker(
    model: torch.nn.Module,
    tokenizer: Any,
    config: VerlBackendConfig,
    folder: Path,
    reference: bool = False,
) -> Any:
    """verl's ``TrainingWorker`` (FSDP engine, optimizer, :func:`agl_ppo_loss`) on
    ``model``; ``reference``: the KL reference's (see :func:`worker_config`)."""
    from verl.workers.engine_workers import TrainingWorker

    if config.device in ("auto", "cpu"):
        ensure_cpu_platform()
    ensure_process_group()
    settings = worker_config(config, _config_folder(model, tokenizer, folder), reference)
    with _env("VERL_ENGINE_DEVICE", _shared_module_engine(model)):
        worker = TrainingWorker(settings)
    worker.reset()  # builds the engine: FSDP-wraps model in place, makes the optimizer
    worker.set_loss_fn(loss_fn(config))
    if not reference:
        follow_schedule(worker, config)
    return worker


def follow_schedule(worker: Any, schedule: LrSchedule) -> None:
    """Make ``worker``'s lr follow ``schedule`` one agl step at a time.

    verl advances its scheduler at the end of every ``train_mini_batch`` call, and agl
    makes one call per mini-batch: a verl schedule would advance ``num_mini_batches``
    times a step. The scheduler's factor is instead read from agl's own step count,
    ``agl_step``, an attribute of the scheduler, so that verl's checkpoint (which saves
    the scheduler's ``__dict__``) keeps it; verl's own steps then recompute the same lr.
    """
    scheduler = worker.engine.lr_scheduler
    scheduler.agl_step = 0
    scheduler.lr_lambdas = [lambda _verl_steps: schedule.lr_factor(scheduler.agl_step)]
    scheduler.step()  # the factor of step 0 (a warm-up starts at 0)


# --- the policy ---------------------------------------------------------------------------


@dataclass
class _Totals:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    clip: list[float] = field(default_factory=list)
    ppo_kl: list[float] = field(default_factory=list)
    tokens_trained: int = 0
    tokens_computed: int = 0
    # agl_ppo_loss's sums over trained tokens (entropy and KL only when penalised)
    penalty_tokens: float = 0.0
    entropy: float | None = None
    kl_reference: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def metrics(self, mini_batches: int, train_s: float) -> dict[str, float]:
        out = {
            "loss": _mean(self.losses),
            "grad_norm": _mean(self.grad_norms),
            "clip_fraction": _mean(self.clip),
            "ppo_kl": _mean(self.ppo_kl),
            "tokens_trained": float(self.tokens_trained),
            "tokens_computed": float(self.tokens_computed),
            "mini_batches": float(mini_batches),
            "train_s": train_s,
        }
        per_token = max(self.penalty_tokens, 1.0)  # no trained token: 0, not NaN
        if self.entropy is not None:
            out["entropy"] = self.entropy / per_token
        if self.kl_reference is not None:
            out["kl_reference"] = self.kl_reference / per_token
        return out | self.extra


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _scalars(value: Any) -> list[float]:
    """verl's metric values (a float, a Metric, or lists of them) as floats."""
    if isinstance(value, list | tuple):
        return [x for v in value for x in _scalars(v)]
    inner = getattr(value, "value", value)
    if isinstance(inner, list | tuple):
        return _scalars(list(inner))
    try:
        return [float(inner)]
    except (TypeError, ValueError):
        return []


def corrected(
    samples: Sequence[Sample], old: Sequence[Sequence[float]], config: CorrectionConfig
) -> tuple[list[Sample], list[list[float]], dict[str, float]]:
    """The rollout correction as ``TorchBackend`` applies it: from ``old`` (π_old per
    token, 0 where nothing predicts it) and the recorded logprobs of every action token,
    the samples with the rejected tokens made context, each token's IS weight (1 off the
    actions) and the correction's metrics."""
    actions = [[i for i, a in enumerate(s.action_mask) if a] for s in samples]
    log_ratios = [
        [old[j][i] - samples[j].logprobs[i] for i in positions]
        for j, positions in enumerate(actions)
    ]
    result = correct(log_ratios, config)
    out: list[Sample] = []
    weights: list[list[float]] = []
    for j, s in enumerate(samples):
        mask = list(s.action_mask)
        weight = [1.0] * len(s.tokens)
        for i, w, keep in zip(actions[j], result.weights[j], result.keep[j], strict=True):
            weight[i] = w
            mask[i] = int(keep)
        out.append(s if mask == list(s.action_mask) else replace(s, action_mask=mask))
        weights.append(weight)
    return out, weights, result.metrics


class VerlPolicy:
    """agl's ``Policy`` on verl's actor update (see the module doc).

    ``model`` is updated in place and may be shared with an embedded inference engine:
    ``paused`` (e.g. ``EmbeddedServer.paused``) then gives the block in which nothing
    generates, as for ``EmbeddedPolicy``; without one (vLLM serves), the caller publishes
    weights from :meth:`state_dict`. With ``kl_coef`` a second worker holds the KL
    reference, a frozen copy of ``model`` as it is now.
    """

    CHECKPOINT = "verl"
    REFERENCE = "verl_reference"

    def __init__(
        self,
        model: torch.nn.Module,
        config: VerlBackendConfig,
        tokenizer: Any = None,
        paused: Callable[[], AbstractContextManager[None]] | None = None,
        work_dir: Path | None = None,
    ) -> None:
        self._setup(model, config, tokenizer, paused, work_dir)
        with self.paused():
            # Copied before FSDP converts model in place: the reference's own module.
            frozen = copy.deepcopy(model) if config.kl_coef else None
            self.worker = build_worker(model, tokenizer, config, self.work_dir / "hf_config")
            self.reference = None
            if frozen is not None:
                self.reference = build_worker(
                    frozen, tokenizer, config, self.work_dir / "hf_config_reference", True
                )
            self._unshard()

    def _setup(
        self,
        model: torch.nn.Module,
        config: VerlBackendConfig,
        tokenizer: Any,
        paused: Callable[[], AbstractContextManager[None]] | None,
        work_dir: Path | None,
    ) -> None:
        """What every verl policy holds, wherever its update runs."""
        self.config = config
        self.model = model
        self.paused = paused or nullcontext
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="agl-verl-"))
        pad_id = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad_id) if pad_id is not None else 0
        self.vocab = model.get_input_embeddings().num_embeddings

    def _unshard(self) -> None:
        """Gather every FSDP2 unit's full parameters now, outside inference mode.

        The inference engine runs the shared module under ``torch.inference_mode``, where
        FSDP2's own all-gather fails ("Inference tensors do not track version counter").
        With ``reshard_after_forward=False`` (set by :func:`build_worker`) gathered
        parameters stay gathered, so the engine's forwards need no collective; training
        reshards in backward, so this runs again after every update (an all-gather
        copies the stepped shards into the full parameters the engine reads).
        """
        import torch
        from torch.distributed.fsdp import FSDPModule

        with torch.no_grad():
            for unit in self.worker.engine.module.modules():
                if isinstance(unit, FSDPModule):
                    unit.unshard()

    def train(
        self,
        samples: list[Sample],
        advantages: list[float],
        loss: Loss,
    ) -> dict[str, float]:
        """One step: one verl update per agl mini-batch; answers the step's metrics.

        ``loss`` is called once per mini-batch with its samples, after a rollout
        correction's rejection (if any) made tokens context, as in ``TorchBackend``.
        """
        start = time.perf_counter()
        self._check(samples, advantages)
        plan = schedule(
            samples,
            num_mini_batches=self.config.num_mini_batches,
            ranks=1,  # verl balances its own ranks; any cut of a hand-off is exact
            max_tokens_per_micro_batch=self.config.max_tokens_per_micro_batch,
        )
        dp = self._dp_size()
        totals = _Totals()
        was_training = self.model.training
        try:
            with self._updating():
                samples, targets = self._targets(samples, dp, totals)
                for mini in plan.mini_batches:
                    index = mini.sample_indices
                    chosen = [samples[i] for i in index]
                    rows = mini_batch_rows(
                        chosen,
                        [advantages[i] for i in index],
                        _weights(chosen, loss),
                        [targets[i] for i in index],
                    )
                    rows = pad_to_multiple(rows, dp)
                    trained = sum(1 for r in rows for w in r.weights if w != 0.0)
                    if not trained:
                        totals.losses.append(0.0)
                        totals.grad_norms.append(0.0)
                        continue  # nothing to learn: no step (weight decay stays put too)
                    data = to_dataproto(rows, self.pad_id)
                    td = to_train_tensordict(
                        data,
                        self.config.ppo_epochs,
                        calculate_entropy=bool(self.config.entropy_coef),
                    )
                    out = self._update(td)
                    self._collect(out, totals)
                    totals.tokens_trained += trained
                    totals.tokens_computed += sum(r.length for r in rows)
            lr = self._lr_step()
        finally:
            self.model.train(was_training)
            self._refresh()
        return totals.metrics(len(plan.mini_batches), time.perf_counter() - start) | {"lr": lr}

    def _targets(
        self, samples: list[Sample], dp: int, totals: _Totals
    ) -> tuple[list[Sample], list[TokenTargets]]:
        """Per token, before any update of the step: the reference's logprobs (KL), and
        under a rollout correction π_old (the current weights' own logprobs) and the IS
        weights, with the rejected tokens made context."""
        reference = self._logprobs(samples, dp, reference=True) if self.config.kl_coef else None
        refs: list[list[float] | None] = list(reference or [None] * len(samples))
        correction = self.config.correction
        if not correction.enabled:
            return samples, [TokenTargets(ref_logprobs=r) for r in refs]
        old = self._logprobs(samples, dp, reference=False)
        samples, is_weights, metrics = corrected(samples, old, correction)
        totals.extra |= metrics
        # rejection alone takes π_old as the ratio's anchor with weight 1 (as TorchBackend)
        use_is = correction.rollout_is is not None
        return samples, [
            TokenTargets(old_logprobs=o, is_weights=w if use_is else None, ref_logprobs=r)
            for o, w, r in zip(old, is_weights, refs, strict=True)
        ]

    def _logprobs(self, samples: list[Sample], dp: int, reference: bool) -> list[list[float]]:
        """Every token's logprob (under its sampling transform; 0 in a row's prompt, where
        nothing is trained) from one forward-only pass of verl's engine: the policy's
        (π_old) or the reference's."""
        rows = [split(s, [0.0] * len(s.tokens), 0.0) for s in samples]
        td = to_infer_tensordict(to_dataproto(pad_to_multiple(rows, dp), self.pad_id))
        values = self._infer(td, reference).tolist()
        # fillers come after the real rows, so zip stops at them
        return [
            [0.0] * len(row.prompt) + v[: len(row.response)]
            for row, v in zip(rows, values, strict=False)
        ]

    def _collect(self, out: Any, totals: _Totals) -> None:
        from verl.utils import tensordict_utils as tu

        metrics = tu.get(out, "metrics") if out is not None else {}
        totals.losses.append(sum(_scalars(metrics.get("loss", []))))
        totals.grad_norms.extend(_scalars(metrics.get("grad_norm", [])))
        totals.clip.extend(_scalars(metrics.get("actor/pg_clipfrac", [])))
        totals.ppo_kl.extend(_scalars(metrics.get("actor/ppo_kl", [])))
        totals.penalty_tokens += sum(_scalars(metrics.get("agl/trained_tokens", [])))
        for key, name in (("agl/entropy_sum", "entropy"), ("agl/kl_reference_sum", "kl_reference")):
            if key in metrics:
                setattr(totals, name, (getattr(totals, name) or 0.0) + sum(_scalars(metrics[key])))

    # -- what differs between verl in this process and verl on Ray (``verl_ray``)

    def _updating(self) -> AbstractContextManager[None]:
        """Held around a step's updates: here FSDP steps the served module itself."""
        return self.paused()

    def _update(self, td: TensorDict) -> Any:
        """One verl mini-batch (``train_mini_batch``); answers its output (metrics)."""
        return self.worker.train_mini_batch(td)

    def _lr_step(self) -> float:
        """After a step's updates: the lr they used; the schedule advances."""
        return lr_step(self.worker)

    def _infer(self, td: TensorDict, reference: bool) -> torch.Tensor:
        """A forward-only pass: ``[rows, R]`` logprobs of the response columns."""
        worker = self.reference if reference else self.worker
        return response_logprobs(worker, td)["log_probs"]

    def _refresh(self) -> None:
        """After a step: make the served module hold the updated weights."""
        with self.paused():
            self._unshard()

    def _dp_size(self) -> int:
        return int(self.worker.engine.get_data_parallel_size())

    def _check(self, samples: list[Sample], advantages: list[float]) -> None:
        from agl.backends.training.torch import check_train_inputs

        for s in samples:
            if s.parents is not None or s.position_ids is not None:
                split(s, [0.0] * len(s.tokens), 0.0)  # raises TreeSampleError
        check_train_inputs(samples, advantages, self.vocab)

    # -- weights and checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The model's full (unsharded) weights as CPU copies (later steps leave them be),
        keyed as the HF model's own ``state_dict``, e.g. for a vLLM weight reload."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.worker.engine.module, options=options)
        # On CPU "offload" is a no-op: the tensors would be the live parameters.
        return {k: v.detach().clone() for k, v in state.items()}

    def save(self, folder: Path) -> None:
        """verl's own FSDP checkpoint (model, optimizer, lr scheduler) under ``folder``,
        and the KL reference's weights (a resumed run keeps its anchor)."""
        self.worker.save_checkpoint(str(folder / self.CHECKPOINT))
        if self.reference is not None:
            self.reference.save_checkpoint(str(folder / self.REFERENCE))

    def load(self, folder: Path) -> None:
        with self.paused():
            self.worker.load_checkpoint(str(folder / self.CHECKPOINT), del_local_after_load=False)
            if self.reference is not None and (folder / self.REFERENCE).is_dir():
                self.reference.load_checkpoint(
                    str(folder / self.REFERENCE), del_local_after_load=False
                )
            self._unshard()

    def close(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


def lr_step(worker: Any) -> float:
    """Advance ``worker``'s lr schedule (:func:`follow_schedule`) by one agl step;
    answers the lr the step used."""
    scheduler = worker.engine.lr_scheduler
    lr = float(scheduler.get_last_lr()[0])
    scheduler.agl_step += 1
    scheduler.step()
    return lr


def _weights(samples: list[Sample], loss: Loss) -> list[list[float]]:
    """The loss strategy's weights over one mini-batch (as ``TorchBackend._weights``);
    negative weights are refused (folding needs ``w ≥ 0``)."""
    computed = loss(samples)
    if len(computed) != len(samples):
        raise ValueError(
            f"the loss strategy returned weights for {len(computed)} samples, "
            f"expected {len(samples)}"
        )
    out = []
    for s, w in zip(samples, computed, strict=True):
        if len(w) != len(s.tokens):
            raise ValueError(
                f"the loss strategy returned {len(w)} weights for a sample of "
                f"{len(s.tokens)} tokens"
            )
        row = [float(x) for x in w]
        if not all(math.isfinite(x) and x >= 0.0 for x in row):
            raise ValueError(
                "loss weights must be finite and >= 0 for verl (they are folded into the "
                "advantage, which is exact for w >= 0 only)"
            )
        out.append(row)
    return out
