"""The study's statistics (agl/study/stats.py): checked against textbook values and
scipy's own tests, and the invariants its docstring states."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from agl.study import stats

values = st.lists(st.floats(min_value=-1e3, max_value=1e3, allow_nan=False), min_size=2, max_size=8)


def test_the_interval_of_three_seeds_is_the_textbook_one() -> None:
    # mean 2, sd 1, n 3: t(0.975, 2) = 4.3027, half width 4.3027 / sqrt(3) = 2.4841.
    ci = stats.interval([1.0, 2.0, 3.0])
    assert ci.mean == 2.0 and ci.n == 3
    assert ci.half_width == pytest.approx(2.4841, abs=1e-4)


def test_one_value_has_no_interval_and_says_so() -> None:
    ci = stats.interval([0.5])
    assert (ci.low, ci.high) == (0.5, 0.5)
    assert "1 seed" in ci.text()


@given(values)
def test_an_interval_holds_its_mean_and_widens_with_the_confidence(xs: list[float]) -> None:
    narrow, wide = stats.interval(xs, 0.8), stats.interval(xs, 0.99)
    assert narrow.low <= narrow.mean <= narrow.high
    assert wide.low <= narrow.low + 1e-9 and narrow.high <= wide.high + 1e-9


# scipy warns of precision loss on near-identical samples; the comparison stands.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@given(values, values)
def test_welch_matches_scipy(a: list[float], b: list[float]) -> None:
    ours = stats.welch(a, b)
    spread = max(a) - min(a) + max(b) - min(b)
    if spread < 1e-6:  # no noise: scipy answers nan, the test stays decided
        return
    theirs = float(scipy_stats.ttest_ind(a, b, equal_var=False).pvalue)
    if math.isfinite(theirs):
        assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-9)


@given(values)
def test_a_sample_is_never_significantly_different_from_itself(xs: list[float]) -> None:
    assert stats.welch(xs, list(xs)) == pytest.approx(1.0)


def test_samples_without_noise_that_differ_are_different() -> None:
    assert stats.welch([0.625] * 3, [0.5] * 3) == 0.0
    assert stats.one_sample([0.625] * 3, 0.5) == 0.0
    assert stats.one_sample([0.5] * 3, 0.5) == 1.0


def test_one_sample_matches_scipy() -> None:
    xs = [0.58, 0.61, 0.66]
    assert stats.one_sample(xs, 0.5) == pytest.approx(
        float(scipy_stats.ttest_1samp(xs, 0.5).pvalue), rel=1e-9
    )


@given(st.lists(st.floats(min_value=0, max_value=1), min_size=1, max_size=10))
def test_holm_is_monotone_at_least_the_raw_p_and_at_most_one(ps: list[float]) -> None:
    adjusted = stats.holm(ps)
    assert all(p <= a + 1e-12 <= 1 + 1e-12 for p, a in zip(ps, adjusted, strict=True))
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    assert all(adjusted[i] <= adjusted[j] + 1e-12 for i, j in itertools.pairwise(order))


def test_holm_on_a_known_family() -> None:
    assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


@pytest.mark.parametrize("bad", [[], [1.0, math.nan], [math.inf, 1.0]])
def test_bad_values_are_refused(bad: list[float]) -> None:
    with pytest.raises(ValueError):
        stats.interval(bad)


def test_tests_need_two_values() -> None:
    with pytest.raises(ValueError, match="two values"):
        stats.welch([1.0], [1.0, 2.0])
