"""What a handful of seeds supports: means, 95% intervals and tests, as pure functions.

A study has few seeds per setting (3 is the least agl reports), so everything here is
small-sample statistics with the t distribution, not the normal one:

- ``interval``: the mean and its two-sided Student-t interval (``n >= 2``; with
  ``n = 1`` there is no spread to estimate: the interval is the value itself, flagged).
- ``welch``: Welch's t-test of two settings' means (unequal variances), two-sided.
- ``one_sample``: a setting's mean against a fixed figure (a task's exact baseline).
- ``holm``: the Holm-Bonferroni step-down over a family of p-values, so that comparing
  every setting with the reference does not find a "difference" by chance alone.

Invariants (tests/study/test_study_stats.py): an interval holds its mean and widens with the
confidence; two identical samples are never significantly different; a constant sample
that differs is (p = 0); Holm's adjusted p-values are monotone in the raw ones, at least
the raw ones, and at most 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats as _scipy

CONFIDENCE = 0.95
ALPHA = 0.05


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def text(self, fmt: str = "{:.3f}") -> str:
        if self.n < 2:
            return f"{fmt.format(self.mean)} (1 seed)"
        return f"{fmt.format(self.mean)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"


def _checked(values: Sequence[float]) -> list[float]:
    if not values:
        raise ValueError("no values")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"values must be finite, not {list(values)}")
    return [float(v) for v in values]


def interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The mean of ``values`` and its two-sided ``confidence`` Student-t interval."""
    xs = _checked(values)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), not {confidence}")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return Interval(mean, mean, mean, n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(_scipy.t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def _variance(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


def welch(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sided p-value of Welch's t-test that ``a`` and ``b`` have equal means.
    Each needs two values at least. Two samples without spread: 1 when their means are
    equal, 0 when they are not (no noise could make them differ)."""
    xs, ys = _checked(a), _checked(b)
    if len(xs) < 2 or len(ys) < 2:
        raise ValueError("Welch's test needs two values per sample at least")
    diff = sum(xs) / len(xs) - sum(ys) / len(ys)
    se2 = _variance(xs) / len(xs) + _variance(ys) / len(ys)
    if se2 == 0:
        return 1.0 if diff == 0 else 0.0
    denominator = (_variance(xs) / len(xs)) ** 2 / (len(xs) - 1) + (
        _variance(ys) / len(ys)
    ) ** 2 / (len(ys) - 1)
    # Welch-Satterthwaite; where it underflows, the conservative min(n) - 1.
    df = se2**2 / denominator if denominator > 0 else min(len(xs), len(ys)) - 1
    t = diff / math.sqrt(se2)
    return float(2 * _scipy.t.sf(abs(t), df))


def one_sample(values: Sequence[float], figure: float) -> float:
    """The two-sided p-value of a t-test that the mean of ``values`` is ``figure``."""
    xs = _checked(values)
    if len(xs) < 2:
        raise ValueError("a t-test needs two values at least")
    mean = sum(xs) / len(xs)
    se = math.sqrt(_variance(xs) / len(xs))
    if se == 0:
        return 1.0 if mean == figure else 0.0
    return float(2 * _scipy.t.sf(abs(mean - figure) / se, len(xs) - 1))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the order given: reject where <= alpha."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
