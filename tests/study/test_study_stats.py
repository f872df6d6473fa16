"""The study's statistics (agl/study/stats.py): checked against textbook values, cases
computed by hand, scipy's own tests and distributions, and the invariants its docstring
states."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import integrate
from scipy import stats as scipy_stats

from agl.study import stats

values = st.lists(st.floats(min_value=-1e3, max_value=1e3, allow_nan=False), min_size=2, max_size=8)
pairs = st.integers(min_value=2, max_value=8).flatmap(
    lambda n: st.tuples(
        *(
            st.lists(st.floats(min_value=-1e3, max_value=1e3), min_size=n, max_size=n)
            for _ in range(2)
        )
    )
)


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


def _spread(xs: list[float]) -> float:
    return max(xs) - min(xs)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@given(values)
def test_the_interval_is_scipys_t_interval(xs: list[float]) -> None:
    ci = stats.interval(xs)
    n = len(xs)
    sd = float(scipy_stats.tstd(xs))
    half = float(scipy_stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    assert ci.half_width == pytest.approx(half, rel=1e-9, abs=1e-9)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@given(values)
def test_one_sample_matches_scipy_everywhere(xs: list[float]) -> None:
    if _spread(xs) < 1e-6:  # no noise: scipy answers nan (or an unstable t)
        return
    theirs = float(scipy_stats.ttest_1samp(xs, 1.5).pvalue)
    assert stats.one_sample(xs, 1.5) == pytest.approx(theirs, rel=1e-9, abs=1e-12)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@given(pairs)
def test_paired_matches_scipys_ttest_rel(ab: tuple[list[float], list[float]]) -> None:
    a, b = ab
    differences = [x - y for x, y in zip(a, b, strict=True)]
    if _spread(differences) < 1e-6:
        return
    theirs = float(scipy_stats.ttest_rel(a, b).pvalue)
    assert stats.paired(a, b) == pytest.approx(theirs, rel=1e-9, abs=1e-12)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@given(pairs)
def test_the_paired_interval_is_the_t_interval_of_the_differences(
    ab: tuple[list[float], list[float]],
) -> None:
    a, b = ab
    differences = [x - y for x, y in zip(a, b, strict=True)]
    ci = stats.paired_interval(a, b)
    n = len(a)
    assert ci.mean == pytest.approx(sum(differences) / n, rel=1e-12, abs=1e-12)
    half = float(scipy_stats.t.ppf(0.975, n - 1)) * float(scipy_stats.tstd(differences))
    assert ci.half_width == pytest.approx(half / math.sqrt(n), rel=1e-9, abs=1e-9)


@given(pairs)
def test_the_paired_p_does_not_change_when_the_samples_swap(
    ab: tuple[list[float], list[float]],
) -> None:
    a, b = ab
    assert stats.paired(a, b) == stats.paired(b, a)


@given(
    values,
    st.one_of(
        st.just(0.0),
        st.floats(min_value=1e-3, max_value=1e3),
        st.floats(min_value=-1e3, max_value=-1e-3),
    ),
)
def test_a_constant_shift_is_a_difference_unless_it_is_zero(xs: list[float], c: float) -> None:
    """Every seed moved by the same c: no noise could make that (p ~ 0; rounding in x + c
    leaves a spread of an ulp of x at most), and no shift is no difference (p = 1)."""
    p = stats.paired([x + c for x in xs], xs)
    if c == 0:
        assert p == 1.0
    else:
        assert p < 1e-6


def test_paired_needs_pairs() -> None:
    with pytest.raises(ValueError, match="same length"):
        stats.paired([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="two pairs"):
        stats.paired([1.0], [2.0])


def test_a_textbook_paired_test() -> None:
    # Differences 1, 2, 3: mean 2, sd 1, t = 2 / (1 / sqrt 3) = 3.4641 on 2 df; the
    # two-sided p of t(2) is 1 - t / sqrt(t^2 + 2) = 1 - 3.4641 / sqrt(14) = 0.07418.
    assert stats.paired([3.0, 5.0, 7.0], [2.0, 3.0, 4.0]) == pytest.approx(
        1 - math.sqrt(12) / math.sqrt(14), rel=1e-9
    )


def _power(d: float, sd: float, n: int, alpha: float) -> float:
    """The two-sided one-sample t-test's power from scipy's noncentral t, directly: the
    lower tail P(T < -c) as P(-T > c), -T being noncentral t with -nc (scipy's nct.cdf
    answers NaN at some large nc)."""
    df, nc = n - 1, d * math.sqrt(n) / sd
    critical = scipy_stats.t.ppf(1 - alpha / 2, df)
    return float(scipy_stats.nct.sf(critical, df, nc) + scipy_stats.nct.sf(critical, df, -nc))


def _power_by_integration(d: float, sd: float, n: int, alpha: float) -> float:
    """The same power without the noncentral t: T = (Z + nc) / sqrt(V / df) with V a
    chi-square on df, so P(|T| > c) is the mean over V of Phi(nc - k) + Phi(-nc - k),
    k = c sqrt(V / df)."""
    df, nc = n - 1, d * math.sqrt(n) / sd
    critical = float(scipy_stats.t.ppf(1 - alpha / 2, df))

    def given(v: float) -> float:
        k = critical * math.sqrt(v / df)
        tails = scipy_stats.norm.cdf(nc - k) + scipy_stats.norm.cdf(-nc - k)
        return float(tails * scipy_stats.chi2.pdf(v, df))

    return float(integrate.quad(given, 0, math.inf, limit=200)[0])


@pytest.mark.parametrize(
    ("sd", "n", "alpha"),
    [(1.0, 5, 0.05), (0.011, 5, 0.05 / 12), (0.3, 3, 0.05 / 6), (2.0, 7, 0.01), (1.0, 40, 0.05)],
)
def test_the_detectable_difference_has_the_asked_power(sd: float, n: int, alpha: float) -> None:
    d = stats.min_detectable(sd, n, alpha)
    assert _power(d, sd, n, alpha) == pytest.approx(0.8, abs=1e-6)
    assert _power_by_integration(d, sd, n, alpha) == pytest.approx(0.8, abs=1e-6)
    assert stats.min_detectable(sd, n, alpha, power=0.9) > d


def test_the_detectable_difference_of_two_pairs_at_level_one_half_by_hand() -> None:
    """n = 2, alpha = 0.5: T = (Z + nc) / |W| with Z, W independent standard normals (t on
    1 df is a normal over the root of a chi-square on 1 df), and t(0.75, 1) = tan(pi / 4)
    = 1 (t on 1 df is Cauchy). So power = P(|Z + nc| > |W|) = P((Z + nc - W)(Z + nc + W)
    > 0); with U = (Z - W) / sqrt 2 and V = (Z + W) / sqrt 2 independent standard normals
    and q = Phi(nc / sqrt 2), that is q^2 + (1 - q)^2. Power 0.8: q = (1 + sqrt 0.6) / 2
    = 0.88730; nc / sqrt 2 = Phi^-1(q) = 1.2123; and nc = d sqrt 2 / sd: d = 1.2123 sd."""
    assert scipy_stats.t.ppf(0.75, 1) == pytest.approx(1.0, rel=1e-12)
    q = (1 + math.sqrt(2 * 0.8 - 1)) / 2
    by_hand = float(scipy_stats.norm.ppf(q))
    assert by_hand == pytest.approx(1.2123, abs=1e-4)
    for sd in (1.0, 0.02):
        assert stats.min_detectable(sd, 2, 0.5) == pytest.approx(by_hand * sd, rel=1e-7)


def test_the_detectable_difference_matches_the_textbook_sample_size() -> None:
    """Cohen's (and G*Power's) one-sample t-test: a standardised effect of 0.5 at a
    two-sided 0.05 needs n = 34 for 80% power (33 falls short)."""
    assert stats.min_detectable(1.0, 34, 0.05) < 0.5 < stats.min_detectable(1.0, 33, 0.05)


@pytest.mark.parametrize("n", [2, 3, 5, 10, 100, 1000])
def test_the_normal_approximation_is_a_lower_bound_and_close_for_many_pairs(n: int) -> None:
    normal = (scipy_stats.norm.ppf(0.975) + scipy_stats.norm.ppf(0.8)) / math.sqrt(n)
    d = stats.min_detectable(1.0, n, 0.05)
    assert normal < d
    if n >= 100:
        assert d == pytest.approx(normal, rel=0.01)


def test_no_spread_detects_everything() -> None:
    assert stats.min_detectable(0.0, 5, 0.05) == 0.0


@given(
    st.floats(min_value=1e-4, max_value=1e3),
    st.integers(min_value=2, max_value=30),
    st.floats(min_value=1e-4, max_value=0.2),
)
def test_the_detectable_difference_shrinks_with_pairs_and_grows_with_spread_and_strictness(
    sd: float, n: int, alpha: float
) -> None:
    d = stats.min_detectable(sd, n, alpha)
    assert stats.min_detectable(sd, n + 1, alpha) < d
    assert stats.min_detectable(sd * 1.5, n, alpha) > d
    assert stats.min_detectable(sd, n, alpha / 2) > d


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1.0, 5, 0.05), "sd must be"),
        ((math.nan, 5, 0.05), "sd must be"),
        ((1.0, 1, 0.05), "two pairs"),
        ((1.0, 5, 0.0), "alpha must be"),
        ((1.0, 5, 0.05, 0.05), "power must be"),
        ((1.0, 5, 0.05, 1.0), "power must be"),
    ],
)
def test_a_bad_detectable_question_is_refused(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stats.min_detectable(*args)


def test_a_bounded_interval_is_clipped_and_says_so() -> None:
    ci = stats.bounded(stats.interval([0.01, 0.02, 0.05]), 0.0, 1.0)
    assert ci.low == 0.0 and ci.high < 1.0 and ci.clipped == (0.0,)
    assert ci.text().endswith("(clipped at 0)")
    top = stats.bounded(stats.interval([0.98, 1.0, 0.99]), 0.0, 1.0)
    assert top.high == 1.0 and top.text().endswith("(clipped at 1)")
    both = stats.bounded(stats.interval([0.0, 1.0]), 0.0, 1.0)
    assert (both.low, both.high) == (0.0, 1.0) and "clipped at 0 and 1" in both.text()
    inside = stats.bounded(stats.interval([0.4, 0.5, 0.6]), 0.0, 1.0)
    assert inside == stats.interval([0.4, 0.5, 0.6]) and "clipped" not in inside.text()
    entropy = stats.bounded(stats.interval([0.01, 0.03]), 0.0, None)
    assert entropy.low == 0.0 and entropy.high > 0.03


@given(st.lists(st.floats(min_value=0, max_value=1), min_size=1, max_size=8))
def test_a_bounded_interval_lies_within_its_bounds_and_holds_its_mean(xs: list[float]) -> None:
    ci = stats.bounded(stats.interval(xs), 0.0, 1.0)
    assert 0.0 <= ci.low <= ci.mean + 1e-12 and ci.mean - 1e-12 <= ci.high <= 1.0


def test_bounds_that_the_mean_breaks_are_refused() -> None:
    with pytest.raises(ValueError, match="outside the bounds"):
        stats.bounded(stats.interval([1.5, 1.7]), 0.0, 1.0)
    with pytest.raises(ValueError, match="low < high"):
        stats.bounded(stats.interval([0.5, 0.7]), 1.0, 0.0)


@given(
    st.lists(st.floats(min_value=-1e3, max_value=1e3), min_size=2, max_size=20),
    st.integers(min_value=0, max_value=5),
    st.integers(min_value=1, max_value=5),
)
def test_the_slope_is_scipys_least_squares_slope(ys: list[float], start: int, every: int) -> None:
    steps = [start + every * i for i in range(len(ys))]
    theirs = float(scipy_stats.linregress(steps, ys).slope)
    assert stats.slope(steps, ys) == pytest.approx(theirs, rel=1e-9, abs=1e-9)


def test_a_line_has_its_slope_and_the_auc_weighs_each_step_the_same() -> None:
    assert stats.slope([1, 2, 3, 4], [0.5, 0.7, 0.9, 1.1]) == pytest.approx(0.2)
    assert stats.slope([0, 10], [1.0, 0.0]) == pytest.approx(-0.1)
    # Step 0 counts as much as any later step, whatever the gaps.
    assert stats.auc([0, 5, 10, 40], [0.2, 0.4, 0.6, 0.8]) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("steps", "ys", "message"),
    [
        ([1, 2], [0.5], "2 steps for 1 values"),
        ([2, 1], [0.5, 0.6], "steps must increase"),
        ([1, 1], [0.5, 0.6], "steps must increase"),
        ([1], [0.5], "two steps"),
    ],
)
def test_a_bad_series_is_refused(steps: list[int], ys: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stats.slope(steps, ys)
