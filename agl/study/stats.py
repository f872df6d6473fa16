"""What a handful of seeds supports: means, 95% intervals and tests, as pure functions.

A study has few seeds per setting (3 is the least agl reports), so everything here is
small-sample statistics with the t distribution, not the normal one:

- ``interval``: the mean and its two-sided Student-t interval (``n >= 2``; with
  ``n = 1`` there is no spread to estimate: the interval is the value itself, flagged).
- ``bounded``: an interval clipped to what its metric can be (a reward in [0, 1], an
  entropy >= 0), saying so in its text.
- ``paired`` and ``paired_interval``: two settings run at the same seeds (each seed's runs
  start from the same warm-up), compared seed by seed: the t-test and the interval of the
  mean of the per-seed differences. Seed-to-seed spread cancels out of the differences.
- ``min_detectable``: the smallest true mean difference a paired t-test at a level finds
  with a given power (80%): what a "not supported" could have missed.
- ``welch``: Welch's t-test of two settings' means (unequal variances), two-sided: for
  samples that do not pair.
- ``one_sample``: a setting's mean against a fixed figure (a task's exact baseline).
- ``holm``: the Holm-Bonferroni step-down over a family of p-values, so that comparing
  every setting with the reference does not find a "difference" by chance alone.
- ``slope`` and ``auc``: a run's series reduced to one figure (an endpoint).

Invariants (tests/study/test_study_stats.py): an interval holds its mean and widens with the
confidence; a bounded interval lies within its bounds; two identical samples are never
significantly different; a constant sample (or a constant per-seed difference) that
differs is (p = 0); the paired p-value does not change when the two samples swap; Holm's
adjusted p-values are monotone in the raw ones, at least the raw ones, and at most 1; the
minimum detectable difference has the asked power, shrinks with more pairs, grows with
the spread and as the level gets stricter.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import optimize as _optimize
from scipy import stats as _scipy

CONFIDENCE = 0.95
ALPHA = 0.05
POWER = 0.8


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int
    clipped: tuple[float, ...] = ()  # the bounds that cut it (``bounded``), low one first

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def text(self, fmt: str = "{:.3f}") -> str:
        if self.n < 2:
            return f"{fmt.format(self.mean)} (1 seed)"
        shown = f"{fmt.format(self.mean)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"
        if self.clipped:
            shown += f" (clipped at {' and '.join(f'{b:g}' for b in self.clipped)})"
        return shown


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


def bounded(ci: Interval, low: float | None, high: float | None) -> Interval:
    """``ci`` clipped to a metric's known bounds (``None``: unbounded on that side), e.g. a
    reward's [0, 1]: a t-interval is symmetric and reaches past a bound near it, which no
    run could. The mean must lie within the bounds (else the bounds are wrong for the
    metric); ``clipped`` names the bounds that cut the interval."""
    if low is not None and high is not None and not low < high:
        raise ValueError(f"bounds must have low < high, not [{low}, {high}]")
    # A mean of values at a bound may land an ulp past it: that is the bound, not a breach.
    slack = 1e-9 * max(1.0, abs(ci.mean))
    if (low is not None and ci.mean < low - slack) or (high is not None and ci.mean > high + slack):
        raise ValueError(f"the mean {ci.mean} lies outside the bounds [{low}, {high}]")
    clipped = []
    new_low, new_high = ci.low, ci.high
    if low is not None and ci.low < low:
        new_low = low
        clipped.append(low)
    if high is not None and ci.high > high:
        new_high = high
        clipped.append(high)
    return Interval(ci.mean, new_low, new_high, ci.n, (*ci.clipped, *clipped))


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


def _differences(a: Sequence[float], b: Sequence[float]) -> list[float]:
    xs, ys = _checked(a), _checked(b)
    if len(xs) != len(ys):
        raise ValueError(f"paired samples must have the same length, not {len(xs)} and {len(ys)}")
    if len(xs) < 2:
        raise ValueError("a paired test needs two pairs at least")
    return [x - y for x, y in zip(xs, ys, strict=True)]


def paired(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sided p-value of the paired t-test that ``a - b`` has mean 0: ``a[i]`` and
    ``b[i]`` are the same seed's runs. Differences without spread: 1 when they are all
    0, else 0 (as ``welch``)."""
    return one_sample(_differences(a, b), 0.0)


def paired_interval(
    a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE
) -> Interval:
    """The mean of the per-pair differences ``a - b`` and its Student-t interval."""
    return interval(_differences(a, b), confidence)


def _power(effect: float, n: int, alpha: float) -> float:
    """The power of the two-sided one-sample t-test at level ``alpha`` with ``n`` values
    when the true mean is ``effect`` standard deviations away: P(|T| > t_crit) with T
    noncentral t (df n - 1, noncentrality effect * sqrt(n))."""
    df, nc = n - 1, effect * math.sqrt(n)
    critical = float(_scipy.t.ppf(1 - alpha / 2, df))
    # The lower tail as the upper tail of -T: scipy's nct.cdf(-t) is NaN at some large nc.
    return float(_scipy.nct.sf(critical, df, nc) + _scipy.nct.sf(critical, df, -nc))


def min_detectable(sd: float, n: int, alpha: float, power: float = POWER) -> float:
    """The smallest true mean difference that a two-sided paired (one-sample) t-test at
    level ``alpha`` over ``n`` pairs whose differences have standard deviation ``sd``
    finds with probability ``power``: the root of the noncentral-t power equation. It
    is at least the normal approximation ``(z(1 - alpha/2) + z(power)) * sd / sqrt(n)``
    and close to it for large ``n``. ``sd = 0``: 0 (any difference shows)."""
    if not (math.isfinite(sd) and sd >= 0):
        raise ValueError(f"sd must be finite and >= 0, not {sd}")
    if n < 2:
        raise ValueError(f"a t-test needs two pairs at least, not {n}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), not {alpha}")
    # At no difference the test rejects with probability alpha: no power below that.
    if not alpha < power < 1:
        raise ValueError(f"power must be in (alpha, 1) = ({alpha}, 1), not {power}")
    if sd == 0:
        return 0.0
    normal = (_scipy.norm.ppf(1 - alpha / 2) + _scipy.norm.ppf(power)) / math.sqrt(n)
    high = 2 * float(normal)
    while _power(high, n, alpha) < power:
        high *= 2
    effect = _optimize.brentq(
        lambda e: _power(e, n, alpha) - power, 0.0, high, xtol=1e-12, rtol=1e-12
    )
    return float(effect) * sd


def _steps_and_values(steps: Sequence[int], values: Sequence[float]) -> list[float]:
    ys = _checked(values)
    if len(steps) != len(ys):
        raise ValueError(f"{len(steps)} steps for {len(ys)} values")
    if any(b <= a for a, b in itertools.pairwise(steps)):
        raise ValueError(f"steps must increase, not {list(steps)}")
    return ys


def slope(steps: Sequence[int], values: Sequence[float]) -> float:
    """The least-squares slope of ``values`` over ``steps`` (per step): e.g. how fast a
    run's entropy rises or falls over its whole run. Needs two steps at least."""
    ys = _steps_and_values(steps, values)
    if len(ys) < 2:
        raise ValueError("a slope needs two steps at least")
    mean_x, mean_y = sum(steps) / len(steps), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in steps)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, ys, strict=True)) / sxx


def auc(steps: Sequence[int], values: Sequence[float]) -> float:
    """The area under a run's curve as the mean of its points, each logged step weighing
    the same (e.g. the validation reward over every validation step, step 0 included):
    with validation every k steps this is the trapezoid area over the run's length but
    for the two ends, which weigh a full point instead of half, so that the start (before
    any update) and the end count as much as any step between."""
    ys = _steps_and_values(steps, values)
    return sum(ys) / len(ys)
