"""The statistics of a repeated comparison (issue 28, item 2) against hand computations on made-up scores.

Student-t quantiles and tails are written in closed form where they have one, so that the oracle is not the code's
own scipy call: with 1 degree of freedom T is Cauchy, t_p = tan(π (p − 1/2)); with 2 degrees of freedom
F(t) = 1/2 + t / (2 √(2 + t²)), so t_p = (2p − 1) √(2 / (4 p (1 − p))) and the two-sided p of t is
1 − |t| / √(2 + t²). They give t_{0.975,2} = 0.95 · √(2 / 0.0975) = 4.30265272974946 and t_{0.975,1} = tan(0.475 π) =
12.7062047361747, the values printed in t tables (4.303, 12.706). (The 4.302652729911275 sometimes quoted is off in
its tenth digit, which a tolerance of 1e-12 tells apart.)
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from peradapt.evaluation.statistics import (
    PairedTest,
    SeedSummary,
    holm,
    over_seeds,
    paired_difference,
    tied_ranks,
)

T_975_DF2 = 0.95 * math.sqrt(2 / (4 * 0.975 * 0.025))  # closed form for 2 df, see above
T_975_DF1 = math.tan(math.pi * 0.475)  # Cauchy quantile for 1 df


def two_sided_p_df2(t: float) -> float:
    """The two-sided p of a t statistic with 2 degrees of freedom, from the closed-form CDF above."""
    return 1 - abs(t) / math.sqrt(2 + t * t)


def test_the_closed_forms_are_the_table_values():
    assert math.isclose(T_975_DF2, 4.30265272974946, rel_tol=1e-13)
    assert round(T_975_DF2, 3) == 4.303
    assert math.isclose(T_975_DF1, 12.7062047361747, rel_tol=1e-13)
    assert round(T_975_DF1, 3) == 12.706
    assert two_sided_p_df2(T_975_DF2) == pytest.approx(0.05, rel=1e-12)


def test_over_seeds_by_hand():
    # [70, 72, 74]: mean 72; deviations −2, 0, 2, squares 4 + 0 + 4 = 8, s² = 8 / (3 − 1) = 4, s = 2;
    # half-width t_{0.975,2} · s / √n = 4.30265272974946 · 2 / √3 = 4.968275...
    summary = over_seeds([70, 72, 74])
    half = T_975_DF2 * 2 / math.sqrt(3)
    assert half == pytest.approx(4.968275, abs=1e-6)
    assert summary.n == 3
    assert summary.mean == pytest.approx(72)
    assert summary.std == pytest.approx(2)
    assert summary.low == pytest.approx(72 - half, rel=1e-12)
    assert summary.high == pytest.approx(72 + half, rel=1e-12)


def test_over_seeds_uses_the_sample_std_and_student_t_not_the_normal_quantile():
    # Two seeds (a NaN one left out): [70, 74], mean 72, s² = (4 + 4) / 1 = 8, s = 2√2 (ddof = 0 would give 2);
    # half-width t_{0.975,1} · 2√2 / √2 = 2 · 12.7062... = 25.41 (1.96 would give 3.92).
    summary = over_seeds([70, float("nan"), 74])
    assert summary.n == 2
    assert summary.std == pytest.approx(2 * math.sqrt(2))
    assert summary.high - summary.mean == pytest.approx(2 * T_975_DF1, rel=1e-12)
    assert summary.mean - summary.low == pytest.approx(2 * T_975_DF1, rel=1e-12)


def test_one_seed_has_no_spread_and_serializes_as_null():
    summary = over_seeds([71.5])
    assert summary == SeedSummary(mean=71.5, std=None, low=None, high=None, n=1)
    assert json.loads(json.dumps(summary.as_dict())) == {"mean": 71.5, "std": None, "low": None, "high": None, "n": 1}
    assert over_seeds([float("nan")]) == SeedSummary(None, None, None, None, 0)


def test_paired_t_test_by_hand_not_significant():
    # a = [80, 82, 85], b = [78, 81, 81]: d = [2, 1, 4], mean 7/3; deviations −1/3, −4/3, 5/3, squares
    # (1 + 16 + 25) / 9 = 42/9, s_d² = 21/9 = 7/3, standard error √(7/3) / √3 = √7 / 3,
    # t = (7/3) / (√7 / 3) = √7 = 2.6458 on 2 df; p = 1 − √7 / √(2 + 7) = 1 − √7 / 3 = 0.1181: not significant.
    result = paired_difference([80, 82, 85], [78, 81, 81])
    se = math.sqrt(7) / 3
    assert result.n == 3
    assert result.mean_difference == pytest.approx(7 / 3)
    assert result.p_value == pytest.approx(1 - math.sqrt(7) / 3, rel=1e-9)
    assert result.p_value == pytest.approx(two_sided_p_df2(math.sqrt(7)), rel=1e-9)
    assert result.p_value == pytest.approx(2 * stats.t.sf(math.sqrt(7), 2), rel=1e-9)
    assert result.significant is False
    # Interval 7/3 ∓ 4.3027 · √7/3 = [−1.461, 6.128]: contains 0, as it must when the test is not significant.
    assert result.low == pytest.approx(7 / 3 - T_975_DF2 * se, rel=1e-12)
    assert result.high == pytest.approx(7 / 3 + T_975_DF2 * se, rel=1e-12)
    assert result.low < 0 < result.high


def test_paired_t_test_by_hand_significant():
    # d = [10, 11, 12] (a − b): mean 11, s_d = 1, se = 1/√3, t = 11√3 = 19.053; p = 1 − t / √(2 + t²) = 0.00275.
    result = paired_difference([90, 91, 93], [80, 80, 81])
    t = 11 * math.sqrt(3)
    assert result.mean_difference == pytest.approx(11)
    assert result.p_value == pytest.approx(two_sided_p_df2(t), rel=1e-9)
    assert result.p_value == pytest.approx(0.00275, abs=1e-5)
    assert result.significant is True
    assert result.low == pytest.approx(11 - T_975_DF2 / math.sqrt(3), rel=1e-12)
    assert result.low > 0
    # The reverse comparison: the same p, the difference and interval mirrored.
    reverse = paired_difference([80, 80, 81], [90, 91, 93])
    assert reverse.mean_difference == pytest.approx(-11)
    assert reverse.p_value == pytest.approx(result.p_value)
    assert (reverse.low, reverse.high) == pytest.approx((-result.high, -result.low))


def test_alpha_sets_both_the_threshold_and_the_interval_level():
    # p = 1 − √7/3 = 0.118 (test above): significant at alpha 0.2, and the 80% interval then excludes 0.
    result = paired_difference([80, 82, 85], [78, 81, 81], alpha=0.2)
    assert result.significant is True
    assert result.low > 0


@pytest.mark.parametrize("seed", range(5))
def test_paired_t_test_agrees_with_scipy_ttest_rel(seed):
    rng = np.random.default_rng(seed)
    n = 3 + seed
    b = rng.normal(70, 3, n)
    a = b + rng.normal(1.0, 1.5, n)
    result = paired_difference(list(a), list(b))
    expected = stats.ttest_rel(a, b)
    assert result.p_value == pytest.approx(float(expected.pvalue), rel=1e-9)
    low, high = expected.confidence_interval(0.95)
    assert (result.low, result.high) == pytest.approx((float(low), float(high)), rel=1e-9)


def test_identical_columns_are_not_different():
    result = paired_difference([70.0, 72.5, 74.0], [70.0, 72.5, 74.0])
    assert result.as_dict() == {
        "mean_difference": 0.0,
        "low": 0.0,
        "high": 0.0,
        "p_value": 1.0,
        "significant": False,
        "n": 3,
        "test": "paired t-test",
        "note": "identical scores on every seed",
        "p_holm": None,  # alone: no family of tests to adjust over
    }
    json.dumps(result.as_dict(), allow_nan=False)


def test_the_same_nonzero_difference_on_every_seed_is_significant_with_a_note():
    # d = [2, 2, 2]: s_d = 0, t = 2 / 0 infinite; p is taken as its limit 0, and the interval is [2, 2].
    result = paired_difference([72.0, 74.0, 76.0], [70.0, 72.0, 74.0])
    assert (result.mean_difference, result.low, result.high, result.p_value) == (2.0, 2.0, 2.0, 0.0)
    assert result.significant is True
    assert "infinite" in result.note
    json.dumps(result.as_dict(), allow_nan=False)


def test_fewer_than_two_pairs_have_no_test():
    result = paired_difference([72.0], [70.0])
    assert result == PairedTest(2.0, None, None, None, False, 1, "paired t-test", "no test with 1 pair")
    # A NaN removes its whole pair, so the other list's score for that seed does not count either.
    result = paired_difference([72.0, float("nan")], [70.0, 71.0])
    assert (result.n, result.mean_difference, result.p_value, result.significant) == (1, 2.0, None, False)
    assert json.loads(json.dumps(result.as_dict()))["p_value"] is None


def test_nan_pairs_are_left_out_of_the_test():
    with_nan = paired_difference([80, 82, float("nan"), 85], [78, 81, 79, 81])
    assert with_nan.n == 3
    assert with_nan.p_value == pytest.approx(1 - math.sqrt(7) / 3, rel=1e-9)


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="same seeds"):
        paired_difference([1.0, 2.0, 3.0], [1.0, 2.0])


def test_wilcoxon_cannot_reach_5_percent_below_six_seeds():
    # Every difference positive: W+ is its maximum, whose exact probability under H0 is 1 / 2^n (each sign is a
    # fair coin), two-sided 2 / 2^n: n = 5 gives 0.0625 (not significant), n = 6 gives 0.03125 (significant).
    # The t-test on the same five differences is significant: why the table uses it for few seeds.
    b5 = [70.0, 71.0, 72.0, 73.0, 74.0]
    a5 = [x + d for x, d in zip(b5, [1.0, 1.2, 0.9, 1.1, 1.3], strict=True)]
    wilcoxon = paired_difference(a5, b5, test="wilcoxon")
    assert wilcoxon.test == "Wilcoxon signed-rank"
    assert wilcoxon.p_value == pytest.approx(2 / 2**5)
    assert wilcoxon.significant is False
    assert paired_difference(a5, b5).significant is True
    a6, b6 = [*a5, 76.4], [*b5, 75.0]
    assert paired_difference(a6, b6, test="wilcoxon").p_value == pytest.approx(2 / 2**6)
    assert paired_difference(a6, b6, test="wilcoxon").significant is True


def test_ranks_one_significantly_best_two_not_separable():
    # A − B: d = [10, 10, 9.5], mean 59/6, s_d² = ((1/6)² + (1/6)² + (1/3)²) / 2 = 1/12, se = √(1/12) / √3 = 1/6,
    #        t = (59/6) / (1/6) = 59, p = 1 − 59 / √(2 + 59²) = 0.00029: A better.
    # A − C: d = [9, 11, 10], mean 10, s_d = 1, t = 10√3 = 17.32, p = 0.0033: A better.
    # B − C: d = [−1, 1, 0.5], mean 1/6, deviations −7/6, 5/6, 1/3, s_d² = (49 + 25 + 4) / 36 / 2 = 13/12,
    #        se = √(13/36) = √13 / 6, t = (1/6) / (√13 / 6) = 1/√13 = 0.277, p = 0.81: not separable.
    values = {"A": [90.0, 91.0, 92.0], "B": [80.0, 81.0, 82.5], "C": [81.0, 80.0, 82.0]}
    assert two_sided_p_df2(59) == pytest.approx(0.00029, abs=1e-5)
    assert two_sided_p_df2(10 * math.sqrt(3)) < 0.05
    assert paired_difference(values["B"], values["C"]).p_value == pytest.approx(two_sided_p_df2(1 / math.sqrt(13)))
    ranks = tied_ranks(values)
    assert [(r.method, r.rank, r.shared, r.label) for r in ranks] == [
        ("A", 1, False, "1"),
        ("B", 2, True, "2="),  # B's mean 81.17 is above C's 81.0: listed first, but the same rank
        ("C", 2, True, "2="),
    ]
    assert ranks[1].as_dict() == {
        "method": "B",
        "rank": 2,
        "shared": True,
        "mean": pytest.approx(243.5 / 3),
        "label": "2=",
    }


def test_ranks_are_not_transitive_ties():
    # A − B: d = [5, 0, 6], mean 11/3, s_d² = 93/9, t = (11/3) / √(93/27) = 1.976, p = 0.187: not separable.
    # B − C: d = [4, 11, 4], mean 19/3, s_d² = 147/9, t = (19/3) / √(147/27) = 2.714, p = 0.113: not separable.
    # A − C: d = [9, 11, 10], p = 0.0033: A better. So A and B are 1= (nothing beats them), C is 2 (A beats it).
    values = {"C": [81.0, 80.0, 82.0], "B": [85.0, 91.0, 86.0], "A": [90.0, 91.0, 92.0]}
    assert two_sided_p_df2((11 / 3) / math.sqrt(93 / 27)) == pytest.approx(0.187, abs=1e-3)
    assert two_sided_p_df2((19 / 3) / math.sqrt(147 / 27)) == pytest.approx(0.113, abs=1e-3)
    ranks = tied_ranks(values)
    assert [(r.method, r.label) for r in ranks] == [("A", "1="), ("B", "1="), ("C", "2")]


def test_ranks_of_one_seed_all_tie():
    # No test with n = 1: nothing is significantly better, so every method shares rank 1, best mean first.
    ranks = tied_ranks({"A": [70.0], "B": [75.0]})
    assert [(r.method, r.label) for r in ranks] == [("B", "1="), ("A", "1=")]


def test_ranks_of_identical_methods_tie():
    ranks = tied_ranks({"A": [70.0, 71.0, 72.0], "B": [70.0, 71.0, 72.0], "C": [60.0, 62.0, 61.0]})
    assert [(r.method, r.label) for r in ranks] == [("A", "1="), ("B", "1="), ("C", "3")]


def test_holm_adjusts_by_hand():
    # m = 4, sorted: 0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06; 0.04 x 1 = 0.04, raised to the running
    # maximum 0.06 (adjusted p never decrease along the sorted order). None: no test, not counted in m.
    assert holm([0.01, 0.04, None, 0.03, 0.005]) == pytest.approx([0.03, 0.06, None, 0.06, 0.02])
    assert holm([0.5, 0.9]) == [1.0, 1.0]  # capped at 1
    assert holm([]) == [] and holm([None]) == [None]


def test_ranks_tie_where_only_the_raw_p_is_below_alpha():
    # Four methods, six pairs (C, noisy, is near no one). Raw p: A − D 0.0032, A − B 0.015, B − D 0.039, all
    # below 0.05 alone. Holm, sorted: 0.0032 x 6 = 0.019 (A better than D); 0.015 x 5 = 0.077 and 0.039 x 4 = 0.16
    # are not, so B ties with A, which raw p alone would have ranked first on its own.
    values = {
        "A": [81.0, 81.5, 81.2, 80.9],
        "B": [80.4, 80.6, 80.9, 80.2],
        "C": [70.0, 90.0, 60.0, 95.0],
        "D": [80.0, 80.0, 80.0, 80.0],
    }
    raw = {
        pair: paired_difference(values[pair[0]], values[pair[1]]).p_value
        for pair in (("A", "B"), ("B", "D"), ("A", "D"))
    }
    assert raw[("A", "B")] < 0.05 and raw[("B", "D")] < 0.05 and raw[("A", "D")] < 0.05 / 6
    ranks = {rank.method: rank.label for rank in tied_ranks(values)}
    assert ranks["A"] == "1=" and ranks["B"] == "1="  # raw p alone would have ranked A alone first
    assert ranks["D"] == "2"  # A is better than D even after the adjustment
