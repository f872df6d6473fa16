"""verl's ``TrainingWorker`` as agl builds and drives it: its config
(:func:`worker_config`), built on the caller's module (:func:`build_worker`), its lr
schedule following agl's steps (:func:`follow_schedule`, :func:`lr_step`), and its
forward-only pass (:func:`response_logprobs`). :mod:`agl.backends.training.verl.ray`
runs the same worker on Ray ranks.

The in-process engine's module is the caller's ``nn.Module`` (:func:`_shared_module_engine`
overrides ``_build_module``, which would otherwise load a fresh copy from disk): FSDP2's
``fully_shard`` converts it in place, so the embedded inference engine keeps serving the
very object verl updates.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from agl.backends.training.lr_schedule import LrSchedule, step_schedule
from agl.backends.training.verl.config import VerlBackendConfig
from agl.backends.training.verl.loss import loss_fn
from agl.backends.training.verl.platform import (
    ensure_cpu_platform,
    ensure_process_group,
    override_env,
)
from agl.backends.training.verl.sampling import sampling_engine

if TYPE_CHECKING:
    import torch
    import transformers
    from tensordict import TensorDict

__all__ = ["build_worker", "follow_schedule", "lr_step", "response_logprobs", "worker_config"]


_engine_serial = [0]


def _shared_module_engine(module: transformers.PreTrainedModel) -> str:
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

    # a base class made at runtime (verl is imported lazily): mypy cannot check it
    class SharedModuleEngine(sampling_engine()):  # type: ignore[misc]
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


def worker_config(
    config: VerlBackendConfig,
    model_path: str | Path,
    reference: bool = False,
    trust_remote_code: bool = False,
) -> Any:
    """verl's ``TrainingWorkerConfig`` (FSDP engine, AdamW, constant lr) for the HF folder
    ``model_path``: the config only (in-process, the engine is built on the caller's
    module) or config plus weights (Ray workers load them, see ``verl.ray``).

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
        trust_remote_code=trust_remote_code,
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
        param_offload=config.param_offload,  # CPU between updates (collocated with vLLM)
        optimizer_offload=config.optimizer_offload,
    )
    optimizer_config = FSDPOptimizerConfig(
        lr=config.lr,
        weight_decay=config.weight_decay,
        # a Hydra ListConfig arrives as a list; the config's type says it has two items
        betas=cast("tuple[float, float]", tuple(config.betas)),
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


def build_worker(
    model: transformers.PreTrainedModel,
    tokenizer: Any,
    config: VerlBackendConfig,
    folder: Path,
    reference: bool = False,
) -> Any:
    """verl's ``TrainingWorker`` (FSDP engine, optimizer, ``loss.agl_ppo_loss``) on
    ``model``; ``reference``: the KL reference's (see :func:`worker_config`)."""
    from verl.workers.engine_workers import TrainingWorker

    if config.device in ("auto", "cpu"):
        ensure_cpu_platform()
    ensure_process_group()
    settings = worker_config(config, _config_folder(model, tokenizer, folder), reference)
    with override_env("VERL_ENGINE_DEVICE", _shared_module_engine(model)):
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
    step_schedule(scheduler)  # the factor of step 0 (a warm-up starts at 0)


def lr_step(worker: Any) -> float:
    """Advance ``worker``'s lr schedule (:func:`follow_schedule`) by one agl step;
    answers the lr the step used."""
    scheduler = worker.engine.lr_scheduler
    lr = float(scheduler.get_last_lr()[0])
    scheduler.agl_step += 1
    step_schedule(scheduler)
    return lr


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
