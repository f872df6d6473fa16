"""Per-token regularisers of the policy loss, with verl's names and formulas so that
``backend=torch`` and ``backend=verl`` penalise alike (``verl.trainer.ppo.core_algos``).

- ``kl_penalty(logp, ref_logp, kind)``: an estimate of KL(current || reference) per token
  sampled from the current policy. ``kl``/``k1``: ``logp - ref``; ``abs``; ``mse``/``k2``:
  ``(logp - ref)² / 2``; ``low_var_kl``/``k3``: ``exp(ref - logp) - (ref - logp) - 1``
  (log ratio clamped to ±20, the value to [-10, 10]). A ``+`` suffix (``k3+``) keeps the
  value and takes k2's gradient, which is unbiased for the KL's.
- ``entropy_of(logprobs)``: each row's entropy; tokens a truncation removed (``-inf``)
  contribute 0 and no NaN to the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agl.backends.training.correction import CorrectionConfig

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


@dataclass
class Guards:
    """The collapse guards and the mismatch correction, with verl's names: the options
    ``backend=torch`` and ``backend=verl`` share (each backend's config extends this).

    loss -= entropy_coef · H; loss += kl_coef · KL(π || π_ref) by kl_type, π_ref the policy
    as the backend was built (frozen, kept in checkpoints); the rollout correction of
    ``agl.backends.training.correction`` (TIS, masked IS). Every default is off.
    """

    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None

    def __post_init__(self) -> None:
        if self.kl_type.removesuffix("+") not in KL_KINDS:
            raise ValueError(f"kl_type must be one of {', '.join(KL_KINDS)}, not {self.kl_type!r}")
        self.correction  # noqa: B018 - checks the correction options

    @property
    def correction(self) -> CorrectionConfig:
        return CorrectionConfig(
            self.rollout_is, self.rollout_is_threshold, self.rollout_rs, self.rollout_rs_threshold
        )


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    base = kind.removesuffix("+")
    if base not in KL_KINDS:
        raise ValueError(f"unknown kl_type {kind!r}; use one of {', '.join(KL_KINDS)} (+ suffix)")
    value = _kl_forward(logp, ref_logp, base)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return value
    straight = 0.5 * (logp - ref_logp).square()
    return straight - straight.detach() + value.detach()


def _kl_forward(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref_logp).square()
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10.0, 10.0)


def entropy_of(logprobs: torch.Tensor) -> torch.Tensor:
    """``[K]`` entropy of each row of ``[K, V]`` log-probabilities."""
    finite = logprobs.masked_fill(torch.isinf(logprobs), 0.0)
    return -(logprobs.exp() * finite).sum(-1)
