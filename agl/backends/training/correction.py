"""Off-policy correction of the train-inference mismatch, on lists (verl's rollout
correction, ``verl/trainer/ppo/rollout_corr_helper.py``, same names and thresholds).

The tokens of a step were sampled by the inference engine (``π_rollout``: the recorded
logprobs); the trainer's own forward pass over the same weights (``π_old``) can disagree
(another kernel, bf16, a stale or quantised copy). With ``log_ratio = log π_old - log
π_rollout`` per action token:

- **truncated importance sampling** (TIS), ``rollout_is``: a weight per token,
  ``exp(log_ratio)`` (``token``) or ``exp(Σ log_ratio)`` over the sample (``sequence``),
  capped at ``rollout_is_threshold`` (a number); ``"lower_upper"`` zeroes weights outside
  ``[lower, upper]`` instead (IcePop). The weight multiplies the token's PPO loss, which is
  then taken against ``π_old`` (verl's decoupled mode).
- **masked importance sampling** (rejection), ``rollout_rs``: tokens (``token_k*``) or
  whole samples (``seq_sum_*``, ``seq_mean_*``, ``seq_max_*``) whose divergence is past
  ``rollout_rs_threshold`` stop being action tokens, *before* the loss strategy
  normalises. ``k1 = -log_ratio`` with ratio bounds ``lower_upper`` (one number ``u``:
  ``1/u_u``); ``k2 = log_ratio² / 2``; ``k3 = exp(log_ratio) - 1 - log_ratio``, each with
  an upper bound. Several options (comma-separated) must all pass.

Both are computed from the unmodified action tokens and clamp log ratios to ±20 as verl.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

SAFETY_BOUND = 20.0
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
IS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class CorrectionConfig:
    rollout_is: str | None = None  # token | sequence | None (off)
    rollout_is_threshold: float | str = 2.0  # TIS cap C, or "lower_upper" (IcePop)
    rollout_rs: str | None = None  # e.g. "token_k1" or "seq_mean_k3,token_k1"; None: off
    rollout_rs_threshold: float | str | None = None

    def __post_init__(self) -> None:
        if self.rollout_is is not None:
            if self.rollout_is not in IS_LEVELS:
                raise ValueError(
                    f"rollout_is must be one of {', '.join(IS_LEVELS)} or null, "
                    f"not {self.rollout_is!r}"
                )
            _bounds(self.rollout_is_threshold, "rollout_is_threshold")
        if self.rollout_rs is not None:
            self.rs_thresholds()

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    def rs_options(self) -> list[str]:
        options = [o.strip() for o in (self.rollout_rs or "").split(",") if o.strip()]
        unknown = [o for o in options if o not in RS_OPTIONS]
        if unknown or not options:
            raise ValueError(
                f"rollout_rs: {unknown or self.rollout_rs!r} not among {', '.join(RS_OPTIONS)}"
            )
        return list(dict.fromkeys(options))

    def rs_thresholds(self) -> dict[str, tuple[float | None, float]]:
        """Per option, ``(lower, upper)``: ratio bounds for k1, an upper bound otherwise."""
        options = self.rs_options()
        spec = self.rollout_rs_threshold
        if spec is None or isinstance(spec, bool):
            raise ValueError("rollout_rs_threshold must be set when rollout_rs is")
        parts = [p.strip() for p in str(spec).split(",") if p.strip()]
        if len(parts) not in (1, len(options)):
            raise ValueError(
                f"rollout_rs_threshold: one threshold, or one per rollout_rs option "
                f"({len(options)}), not {len(parts)}"
            )
        parts = parts * len(options) if len(parts) == 1 else parts
        out: dict[str, tuple[float | None, float]] = {}
        for option, part in zip(options, parts, strict=True):
            if option.endswith("k1"):
                lower, upper = _bounds(part if "_" in part else f"{1 / float(part)}_{part}", option)
                out[option] = (lower, upper)
            else:
                lower, upper = _bounds(part, option)
                if lower is not None:
                    raise ValueError(f"rollout_rs_threshold for {option} is one upper bound")
                out[option] = (None, upper)
        return out


@dataclass
class Correction:
    """Per sample, per action token: the IS weight, and whether it stays an action."""

    weights: list[list[float]]
    keep: list[list[bool]]
    metrics: dict[str, float]


def correct(log_ratios: Sequence[Sequence[float]], config: CorrectionConfig) -> Correction:
    """``log_ratios[j]`` holds ``log π_old - log π_rollout`` of sample j's action tokens."""
    weights = [_is_weights(r, config) for r in log_ratios]
    keep = [[True] * len(r) for r in log_ratios]
    metrics: dict[str, float] = {}
    if config.rollout_rs is not None:
        for option, (lower, upper) in config.rs_thresholds().items():
            for j, r in enumerate(log_ratios):
                passed = _passes(r, option, lower, upper)
                keep[j] = [k and p for k, p in zip(keep[j], passed, strict=True)]
    tokens = sum(len(r) for r in log_ratios)
    flat = [x for r in log_ratios for x in r]
    kept = sum(k for row in keep for k in row)
    metrics["correction/log_ratio_abs_mean"] = math.fsum(abs(x) for x in flat) / max(tokens, 1)
    if config.rollout_is is not None:
        w = [x for row in weights for x in row]
        metrics["correction/is_weight_mean"] = math.fsum(w) / max(tokens, 1)
        upper, lower = _upper_lower(config.rollout_is_threshold)
        metrics["correction/is_truncated_fraction"] = sum(
            _raw(row, config)[i] > upper or (lower is not None and _raw(row, config)[i] < lower)
            for row in log_ratios
            for i in range(len(row))
        ) / max(tokens, 1)
    if config.rollout_rs is not None:
        metrics["correction/rs_masked_fraction"] = 1 - kept / max(tokens, 1)
        samples = [row for row in keep if row]
        metrics["correction/rs_seq_masked_fraction"] = sum(not all(row) for row in samples) / max(
            len(samples), 1
        )
    return Correction(weights, keep, metrics)


def _raw(log_ratio: Sequence[float], config: CorrectionConfig) -> list[float]:
    """Untruncated IS weights of one sample's action tokens."""
    if config.rollout_is == "sequence":
        total = _clamp(math.fsum(log_ratio))
        return [math.exp(total)] * len(log_ratio)
    return [math.exp(_clamp(x)) for x in log_ratio]


def _is_weights(log_ratio: Sequence[float], config: CorrectionConfig) -> list[float]:
    if config.rollout_is is None:
        return [1.0] * len(log_ratio)
    upper, lower = _upper_lower(config.rollout_is_threshold)
    raw = _raw(log_ratio, config)
    if lower is None:
        return [min(w, upper) for w in raw]
    return [w if lower <= w <= upper else 0.0 for w in raw]


def _passes(
    log_ratio: Sequence[float], option: str, lower: float | None, upper: float
) -> list[bool]:
    safe = [_clamp(x) for x in log_ratio]
    kind = option[-2:]
    stat = [_divergence(x, kind) for x in safe]
    if option.startswith("token"):
        return [_within(s, kind, lower, upper) for s in stat]
    if not stat:
        return []
    if option.startswith("seq_sum"):
        value = math.fsum(stat)
    elif option.startswith("seq_mean"):
        value = math.fsum(stat) / len(stat)
    else:
        value = max(stat)
    return [_within(value, kind, lower, upper)] * len(stat)


def _divergence(log_ratio: float, kind: str) -> float:
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return math.exp(log_ratio) - 1.0 - log_ratio


def _within(value: float, kind: str, lower: float | None, upper: float) -> bool:
    if kind == "k1":
        assert lower is not None
        return math.log(lower) <= value <= math.log(upper)
    return value <= upper


def _clamp(x: float) -> float:
    return min(max(x, -SAFETY_BOUND), SAFETY_BOUND)


def _upper_lower(spec: float | str) -> tuple[float, float | None]:
    lower, upper = _bounds(spec, "rollout_is_threshold")
    return upper, lower


def _bounds(spec: float | str, name: str) -> tuple[float | None, float]:
    """``"lower_upper"`` or one upper bound, both positive, lower <= upper."""
    if isinstance(spec, bool):
        raise ValueError(f"{name} must be a number or 'lower_upper', not a boolean")
    text = str(spec).strip()
    try:
        if "_" in text:
            low, high = text.split("_", 1)
            lower, upper = float(low), float(high)
        else:
            lower, upper = None, float(text)
    except ValueError:
        raise ValueError(f"{name}: {spec!r} is not a number or 'lower_upper'") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{name}: bounds must be positive with lower <= upper, not {spec!r}")
    return lower, upper
