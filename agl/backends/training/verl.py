"""verl (0.9.1) as agl's training backend: agl's samples, advantages and loss weights
handed to verl's own actor update (``TrainingWorker.train_mini_batch`` on verl's FSDP
engine, the code ``ActorRolloutRefWorker.update_actor`` runs on every GPU worker).

The path of one ``train()`` (:class:`VerlPolicy`):

1. agl's scheduler cuts the step into optimizer mini-batches (a rollout's samples stay in
   one); the loss strategy's weights are computed once per mini-batch, exactly as in
   ``TorchBackend``.
2. Each mini-batch becomes one ``DataProto`` (:func:`to_dataproto`, verl's field names:
   ``input_ids``, ``attention_mask``, ``position_ids``, ``prompts``, ``responses``,
   ``response_mask``, ``old_log_probs``/``rollout_log_probs`` (the recorded behaviour
   logprobs), ``advantages``, plus ``agl_loss_weights`` and ``agl_advantages``), and is
   handed to verl as ONE verl mini-batch (``mini_batch_size`` = the whole hand-off), so
   whatever verl reorders or balances inside it, no rollout is split across updates.
3. verl runs its micro-batches, its ``ppo_loss``/``compute_policy_loss_vanilla``, FSDP's
   gradient reduction, grad clipping and AdamW step.

**The loss, exact.** The per-token weight ``w ≥ 0`` is folded into the advantage
(``advantages = w · A``) and verl aggregates with ``loss_agg_mode="token-sum"``:

- PPO-clip is positively homogeneous in ``A``: for ``w ≥ 0``,
  ``w · max(-A·r, -A·clip(r)) = max(-(wA)·r, -(wA)·clip(r))``, and the same holds for
  verl's dual-clip ``min(·, -A·c)`` branch (its ``A < 0`` test keeps its sign; ``w = 0``
  gives 0 on both branches). So verl's per-token loss is exactly ``w ·`` agl's.
- ``token-sum`` is ``Σ_mb loss · dp_size`` per micro-batch: no division by a micro-batch
  count or token count (verl's FSDP engine calls ``loss.backward()`` per micro-batch
  unscaled), and FSDP *averages* gradients over ``dp_size`` ranks, so the update's
  gradient is ``(1/dp) Σ_ranks dp · Σ_rank w·loss = Σ_minibatch w·loss`` — agl's loss,
  however verl cuts micro-batches or ranks. (``token-mean``/``seq-mean-*`` would put
  verl's own normalization on top of agl's.)
- agl's ``TorchBackend`` has no dual clip; ``clip_ratio_c`` defaults here to a bound the
  ratio never reaches (verl clamps ``log r`` to ±20, ``e^20 < 1e9``), so both backends
  train the same objective. Set it to 3.0 for verl's default dual-clip PPO.
- Entropy bonus and KL loss are refused: verl would add them token-summed, unweighted.

**CPU.** verl 0.9.1 knows CUDA, NPU and ROCm platforms only; on a machine without them
:func:`ensure_cpu_platform` registers a CPU platform through verl's own plugin registry
(``verl.plugin.platform.PlatformRegistry``/``set_platform``: device ``cpu``, collective
backend ``gloo``), and :func:`ensure_process_group` starts a 1-process gloo group, so
verl's FSDP2 engine runs unchanged in-process. The engine's module is the caller's
``nn.Module`` (:func:`_shared_module_engine` overrides only ``_build_module``, which
would otherwise load a fresh copy from disk): FSDP2's ``fully_shard`` converts it in
place, so the embedded inference engine keeps serving the very object verl updates.

**Many ranks.** ``backend.ranks > 1`` runs the same hand-offs on verl's ``RayWorkerGroup``
of FSDP workers instead (``agl/backends/training/verl_ray.py``): :class:`VerlPolicy`'s
``_updating``/``_update``/``_refresh``/``_dp_size`` are the only steps that differ.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import shutil
import socket
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.backends.training.penalties import KL_KINDS
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
from agl.core.correction import CorrectionConfig, correct
from agl.core.schedule import schedule
from agl.core.types import Sample

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict
    from verl.protocol import DataProto

logger = logging.getLogger(__name__)

LossFn = Callable[[list[Sample]], list[list[float]]]

# Above e^20 (verl clamps the log-ratio to ±20), so verl's dual clip never binds and the
# objective is agl's plain PPO-clip.
NO_DUAL_CLIP = 1.0e9

# The engine key (``VERL_ENGINE_DEVICE``) of verl's FSDP engine with agl's sampling
# transform (:func:`sampling_engine`), on every device.
SAMPLING_ENGINE = "agl-sampling"
# Per response column: each token's sampling transform (``agl.core.types.Sampling``).
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
class VerlBackendConfig:
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
    # As torch.yaml (verl's names): loss -= entropy_coef · H, loss += kl_coef · KL(π ||
    # π_ref) by kl_type, each token's term times its loss weight; π_ref is the policy as
    # this backend was built (a frozen copy, kept in checkpoints).
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    # Train-inference mismatch (agl.core.correction, verl's rollout correction); null: off.
    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None

    @property
    def correction(self) -> CorrectionConfig:
        return CorrectionConfig(
            self.rollout_is, self.rollout_is_threshold, self.rollout_rs, self.rollout_rs_threshold
        )

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
        if self.kl_type.removesuffix("+") not in KL_KINDS:
            raise ValueError(f"kl_type must be one of {', '.join(KL_KINDS)}, not {self.kl_type!r}")
        self.correction  # noqa: B018 - checks the correction options


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
) -> list[VerlRow]:
    """One verl row per sample (in order); ``weights[i]`` aligned with sample i's tokens."""
    if not (len(samples) == len(advantages) == len(weights)):
        raise ValueError(
            f"{len(samples)} samples, {len(advantages)} advantages, {len(weights)} weight lists"
        )
    return [split(s, w, a) for s, w, a in zip(samples, weights, advantages, strict=True)]


def to_dataproto(rows: Sequence[VerlRow], pad_id: int, temperature: float = 1.0) -> DataProto:
    """``rows`` as verl's actor-update ``DataProto`` (left-padded prompts, right-padded
    responses). ``advantages`` is the folded ``w · A`` verl's loss reads; the raw scalar
    advantage and the weights travel as ``agl_advantages``/``agl_loss_weights``;
    ``uid`` (verl's group key) is agl's ``group_id``, ``rollout_id`` is kept."""
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
    logprobs = torch.tensor(p.logprobs, dtype=torch.float32)
    weights = torch.tensor(p.weights, dtype=torch.float32)
    raw = torch.tensor(p.advantages, dtype=torch.float32)
    tensors |= {
        "old_log_probs": logprobs,
        # agl trains against the recorded behaviour logprobs (no recompute pass), so the
        # "old" policy of the PPO ratio is the rollout policy itself.
        "rollout_log_probs": logprobs.clone(),
        "advantages": raw * weights,
        "agl_advantages": raw,
        "agl_loss_weights": weights,
    }
    non_tensors = {
        "uid": np.array([r.group_id for r in rows], dtype=object),
        "rollout_id": np.array([r.rollout_id for r in rows], dtype=object),
        "agl_advantage": np.array([r.advantage for r in rows], dtype=np.float64),
    }
    return DataProto.from_dict(
        tensors=tensors, non_tensors=non_tensors, meta_info={"temperature": temperature}
    )


def from_dataproto(data: DataProto) -> list[VerlRow]:
    """The rows a :func:`to_dataproto` batch holds, in its current row order."""
    batch = data.batch

    def rows_of(key: str) -> list[list[Any]]:
        return batch[key].tolist()

    padded = Padded(
        prompts=rows_of("prompts"),
        responses=rows_of("responses"),
        input_ids=rows_of("input_ids"),
        attention_mask=rows_of("attention_mask"),
        position_ids=rows_of("position_ids"),
        response_mask=rows_of("response_mask"),
        logprobs=rows_of("old_log_probs"),
        weights=rows_of("agl_loss_weights"),
        advantages=rows_of("agl_advantages"),
    )
    nt = data.non_tensor_batch
    return unpad(
        padded,
        [float(a) for a in nt["agl_advantage"]],
        [str(r) for r in nt["rollout_id"]],
        [str(g) for g in nt["uid"]],
    )


def to_train_tensordict(data: DataProto, ppo_epochs: int = 1) -> TensorDict:
    """The ``TensorDict`` verl's ``train_mini_batch`` takes, made as
    ``RayPPOTrainer._update_actor`` makes it, with ONE verl mini-batch: the whole batch."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(data.to_tensordict())
    n = len(data)
    tu.assign_non_tensor(
        td,
        calculate_entropy=False,
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


_engine_serial = [0]


def _shared_module_engine(module: torch.nn.Module) -> str:
    """Register verl's FSDP engine class, building on ``module`` instead of loading one
    from disk, under a fresh device key; answers the key (for ``VERL_ENGINE_DEVICE``).

    Only ``_build_module`` differs from ``FSDPEngineWithLMHead``: verl's own steps there
    that touch an existing model (monkey patches for remove-padding, dtype, gradient
    checkpointing) are kept; the FSDP wrap, optimizer, forward/backward, loss, step and
    checkpointing are verl's, unchanged.
    """
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.torch_dtypes import PrecisionType
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    class SharedModuleEngine(FSDPEngineWithLMHead):
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


def worker_config(config: VerlBackendConfig, model_path: Path) -> Any:
    """verl's ``TrainingWorkerConfig`` (FSDP engine, AdamW, constant lr) for the HF folder
    ``model_path``: the config only (in-process, the engine is built on the caller's
    module) or config plus weights (Ray workers load them, see ``verl_ray``)."""
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
        # Keep the full parameters between forwards: the inference engine shares them
        # in-process (harmless on Ray workers, whose modules nothing else reads).
        reshard_after_forward=False,
    )
    optimizer_config = FSDPOptimizerConfig(
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=tuple(config.betas),
        clip_grad=config.grad_clip,
        total_training_steps=1,  # constant schedule: the count does not matter
        lr_scheduler_type="constant",
    )
    return TrainingWorkerConfig(
        model_type="language_model",
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
    )


def loss_fn(config: VerlBackendConfig) -> Callable[..., Any]:
    """verl's ``ppo_loss`` bound to agl's exact-loss actor config (``set_loss_fn``)."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=actor_config(config))


def build_worker(
    model: torch.nn.Module, tokenizer: Any, config: VerlBackendConfig, folder: Path
) -> Any:
    """verl's ``TrainingWorker`` (FSDP engine, optimizer, ``ppo_loss``) on ``model``."""
    from verl.workers.engine_workers import TrainingWorker

    if config.device in ("auto", "cpu"):
        ensure_cpu_platform()
    ensure_process_group()
    settings = worker_config(config, _config_folder(model, tokenizer, folder))
    with _env("VERL_ENGINE_DEVICE", _shared_module_engine(model)):
        worker = TrainingWorker(settings)
    worker.reset()  # builds the engine: FSDP-wraps model in place, makes the optimizer
    worker.set_loss_fn(loss_fn(config))
    return worker


# --- the policy ---------------------------------------------------------------------------


@dataclass
class _Totals:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    clip: list[float] = field(default_factory=list)
    ppo_kl: list[float] = field(default_factory=list)
    tokens_trained: int = 0
    tokens_computed: int = 0


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


class VerlPolicy:
    """agl's ``Policy`` on verl's actor update (see the module doc).

    ``model`` is updated in place and may be shared with an embedded inference engine:
    ``paused`` (e.g. ``EmbeddedServer.paused``) then gives the block in which nothing
    generates, as for ``EmbeddedPolicy``; without one (vLLM serves), the caller publishes
    weights from :meth:`state_dict`.
    """

    CHECKPOINT = "verl"

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
            self.worker = build_worker(model, tokenizer, config, self.work_dir / "hf_config")
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
        loss: LossFn,
    ) -> dict[str, float]:
        """One step: one verl update per agl mini-batch; answers the step's metrics."""
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
                for mini in plan.mini_batches:
                    index = mini.sample_indices
                    weights = _weights([samples[i] for i in index], loss)
                    rows = mini_batch_rows(
                        [samples[i] for i in index], [advantages[i] for i in index], weights
                    )
                    rows = pad_to_multiple(rows, dp)
                    trained = sum(1 for r in rows for w in r.weights if w != 0.0)
                    if not trained:
                        totals.losses.append(0.0)
                        totals.grad_norms.append(0.0)
                        continue  # nothing to learn: no step (weight decay stays put too)
                    data = to_dataproto(rows, self.pad_id)
                    td = to_train_tensordict(data, self.config.ppo_epochs)
                    out = self._update(td)
                    self._collect(out, totals)
                    totals.tokens_trained += trained
                    totals.tokens_computed += sum(r.length for r in rows)
        finally:
            self.model.train(was_training)
            self._refresh()
        return {
            "loss": _mean(totals.losses),
            "grad_norm": _mean(totals.grad_norms),
            "clip_fraction": _mean(totals.clip),
            "ppo_kl": _mean(totals.ppo_kl),
            "tokens_trained": float(totals.tokens_trained),
            "tokens_computed": float(totals.tokens_computed),
            "mini_batches": float(len(plan.mini_batches)),
            "train_s": time.perf_counter() - start,
        }

    def _collect(self, out: Any, totals: _Totals) -> None:
        from verl.utils import tensordict_utils as tu

        metrics = tu.get(out, "metrics") if out is not None else {}
        totals.losses.append(sum(_scalars(metrics.get("loss", []))))
        totals.grad_norms.extend(_scalars(metrics.get("grad_norm", [])))
        totals.clip.extend(_scalars(metrics.get("actor/pg_clipfrac", [])))
        totals.ppo_kl.extend(_scalars(metrics.get("actor/ppo_kl", [])))

    # -- what differs between verl in this process and verl on Ray (``verl_ray``)

    def _updating(self) -> AbstractContextManager[None]:
        """Held around a step's updates: here FSDP steps the served module itself."""
        return self.paused()

    def _update(self, td: TensorDict) -> Any:
        """One verl mini-batch (``train_mini_batch``); answers its output (metrics)."""
        return self.worker.train_mini_batch(td)

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
        """verl's own FSDP checkpoint (model, optimizer, lr scheduler) under ``folder``."""
        self.worker.save_checkpoint(str(folder / self.CHECKPOINT))

    def load(self, folder: Path) -> None:
        with self.paused():
            self.worker.load_checkpoint(str(folder / self.CHECKPOINT), del_local_after_load=False)
            self._unshard()

    def close(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


def _weights(samples: list[Sample], loss: LossFn) -> list[list[float]]:
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
