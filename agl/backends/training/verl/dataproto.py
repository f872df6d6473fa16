"""verl rows (:mod:`agl.backends.training.verl.layout`) as verl's own batch types, and
back: a mini-batch's samples as rows (:func:`mini_batch_rows`), rows as the actor-update
``DataProto`` (:func:`to_dataproto`, :func:`from_dataproto`), and that ``DataProto`` as
the ``TensorDict`` verl's ``TrainingWorker`` takes for an update
(:func:`to_train_tensordict`) or a forward-only pass (:func:`to_infer_tensordict`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agl.backends.training.verl.layout import (
    Padded,
    TokenTargets,
    VerlRow,
    pad,
    split,
    unpad,
)
from agl.core.contracts.samples import Sample

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict
    from verl.protocol import DataProto

__all__ = [
    "from_dataproto",
    "mini_batch_rows",
    "to_dataproto",
    "to_infer_tensordict",
    "to_train_tensordict",
]


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
    when a row has it, as the per-column sampling transform (``sampling.SAMPLING_KEYS``). verl's
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
