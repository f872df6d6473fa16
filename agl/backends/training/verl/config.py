"""``backend=verl``'s options (``conf/backend/verl.yaml``): :class:`VerlBackendConfig`,
torch.yaml's options plus verl's own, and the :class:`Penalties` agl adds to verl's loss.

Plain dataclasses, no verl: ``agl.core.run.build`` reads a run's config from here before
anything of verl is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from agl.backends.training.lr_schedule import LrSchedule
from agl.backends.training.penalties import Guards

__all__ = ["NO_DUAL_CLIP", "Penalties", "VerlBackendConfig"]


# Above e^20 (verl clamps the log-ratio to ±20), so verl's dual clip never binds and the
# objective is agl's plain PPO-clip.
NO_DUAL_CLIP = 1.0e9


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
    num_mini_batches: int = 1  # agl mini-batches (updates) per train(); at most one per rollout
    ppo_epochs: int = 1  # verl passes over each hand-off; each pass is one update
    # Micro-batching inside verl: a token cap (use_dynamic_bsz) or a fixed row count.
    use_dynamic_bsz: bool = True
    max_tokens_per_micro_batch: int = 4096  # verl: ppo_max_token_len_per_gpu
    ppo_micro_batch_size_per_gpu: int = 4  # used when use_dynamic_bsz is false
    strategy: str = "fsdp2"  # verl engine: fsdp (FSDP1) | fsdp2
    param_dtype: str = "fp32"  # FSDP mixed precision; bf16 on GPU for speed
    use_remove_padding: bool = False  # True needs flash-attn (GPU)
    gradient_checkpointing: bool = False
    # verl's FSDP offload (engine param_offload / optimizer_offload): between updates a
    # rank keeps its parameter and gradient shards (param) or its AdamW state (optimizer)
    # in CPU memory, moved to the GPU only while it trains; for training collocated with
    # vLLM on the same GPUs (inference.sleep_mode), which then has their memory.
    param_offload: bool = False
    optimizer_offload: bool = False
    attn_implementation: str = "sdpa"
    device: str = "auto"  # auto: verl's platform (cuda/npu) if any, else the CPU plugin
    # Where the update runs: 1 rank in this process (VerlPolicy), or a Ray worker group
    # of `ranks` FSDP workers (ray.RayVerlPolicy; `ray: true` forces it for 1 rank).
    ranks: int = 1
    # Ranks per node (verl's trainer.n_gpus_per_node): ranks / gpus_per_node nodes, each
    # one placement group packed on one node. None: all ranks on one node.
    gpus_per_node: int | None = None
    ray: bool = False
    ray_address: str | None = None  # None: start a local Ray; "auto"/"host:port": join one
    # Carried over from torch.yaml so one override line serves both backends.
    torch_threads: int = 2

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.entropy_coef, self.kl_coef, self.kl_type)

    @property
    def process_on_nodes(self) -> list[int]:
        """Ranks per node, verl's ``RayResourcePool(process_on_nodes=...)`` (as verl's
        trainer: ``[n_gpus_per_node] * nnodes``); they sum to ``ranks``."""
        per_node = self.gpus_per_node or self.ranks
        return [per_node] * (self.ranks // per_node)

    @property
    def on_ray(self) -> bool:
        """Whether the update runs on a Ray worker group (:mod:`agl.backends.training.verl.ray`)."""
        return self.ray or self.ranks > 1 or self.ray_address is not None

    def __post_init__(self) -> None:
        if self.strategy not in ("fsdp", "fsdp2"):
            raise ValueError(f"backend.strategy must be fsdp or fsdp2, not {self.strategy!r}")
        for name in ("num_mini_batches", "ppo_epochs", "max_tokens_per_micro_batch", "ranks"):
            if getattr(self, name) < 1:
                raise ValueError(f"backend.{name} must be at least 1")
        if self.gpus_per_node is not None:
            if self.gpus_per_node < 1 or self.ranks % self.gpus_per_node:
                raise ValueError(
                    f"backend.gpus_per_node={self.gpus_per_node} must divide "
                    f"backend.ranks={self.ranks} (ranks = gpus_per_node x nodes)"
                )
            if self.ray_address is None and self.gpus_per_node != self.ranks:
                raise ValueError(
                    f"backend.gpus_per_node={self.gpus_per_node} < backend.ranks={self.ranks} "
                    "spans nodes: set backend.ray_address (a Ray cluster); agl's own Ray "
                    "is this one node"
                )
        if not self.clip_ratio_c > 1.0:
            raise ValueError("backend.clip_ratio_c must be > 1 (verl's dual-clip bound)")
        super().__post_init__()


@dataclass(frozen=True)
class Penalties:
    """The per-token terms agl adds to verl's PPO loss (see ``loss.agl_ppo_loss``)."""

    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"

    @property
    def active(self) -> bool:
        return bool(self.entropy_coef or self.kl_coef)
