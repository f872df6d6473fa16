"""agl's per-token sampling transform inside verl's engine: :func:`sampling_engine`,
verl's FSDP engine scoring each token under the transform it was sampled from, and its
registration under :data:`SAMPLING_ENGINE` (:func:`register_sampling_engine`).

**Sampling, exact.** Each action token is scored under the transform it was sampled
from (``Sample.sampling``: ``logits / temperature``, top-k, top-p, renormalised; the one
rule of ``agl.backends.sampling``). verl knows a per-*sample* temperature and no
truncation, so agl carries one transform per response column (:data:`SAMPLING_KEYS`)
and its engine (:func:`sampling_engine`: verl's ``FSDPEngineWithLMHead`` with
``prepare_model_outputs`` overridden for batches that carry them) applies
``transformed_logprobs`` exactly where verl turns logits into logprobs — the update,
π_old and the reference alike, in this process and on every Ray worker. verl's own
temperature stays 1. What cannot be made exact is refused with a ValueError: fused
kernels (no logits), Ulysses sequence parallelism, distillation outputs
(:func:`sampled_model_outputs`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

__all__ = [
    "SAMPLING_ENGINE",
    "SAMPLING_KEYS",
    "register_sampling_engine",
    "sampled_model_outputs",
    "sampling_engine",
    "score_rows",
]


# The engine key (``VERL_ENGINE_DEVICE``) of verl's FSDP engine with agl's sampling
# transform (:func:`sampling_engine`), on every device.
SAMPLING_ENGINE = "agl-sampling"
# Per response column: each token's sampling transform (``agl.core.contracts.samples.Sampling``).
SAMPLING_KEYS = ("agl_temperature", "agl_top_k", "agl_top_p")


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
