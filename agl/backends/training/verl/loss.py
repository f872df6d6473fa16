"""agl's loss on verl's actor update, exactly: verl's ``FSDPActorConfig``
(:func:`actor_config`) and its ``ppo_loss`` plus agl's weighted penalties
(:func:`agl_ppo_loss`, bound by :func:`loss_fn` for ``TrainingWorker.set_loss_fn``).

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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agl.backends.training.verl.config import Penalties, VerlBackendConfig

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

__all__ = ["actor_config", "agl_ppo_loss", "loss_fn"]


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
    cancels). KL is agl's ``kl_penalty`` (verl's formulas,
    ``tests/backends/training/test_verl_crosscheck``)
    against the batch's ``ref_log_prob``; both logprobs and the entropy are of each token's
    sampling transform (``sampling.sampled_model_outputs``).
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
    term: float | torch.Tensor = 0.0
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


def loss_fn(config: VerlBackendConfig) -> Callable[..., Any]:
    """:func:`agl_ppo_loss` bound to agl's exact-loss actor config and the penalties
    (``set_loss_fn``; a partial of module-level names, so Ray can ship it)."""
    return functools.partial(agl_ppo_loss, actor_config(config), config.penalties)
