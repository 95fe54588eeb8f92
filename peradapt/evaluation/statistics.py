"""Statistics of a repeated comparison (issue 28, item 2): each tuned method is re-run over K seeds, and the table
reports, per method, the mean over seeds with a 95% interval, the paired difference to a reference method over the
same seeds (and partitions) with a paired test, and ranks that say where methods cannot be told apart.

Pure functions over per-seed scores (one number per seed: a method's headline score of that run); results are
dataclasses whose `as_dict()` is JSON-ready (a quantity that is undefined is None, JSON null, never NaN: NaN is not
JSON and would make a report unreadable by strict parsers).

A score that is undefined (NaN: e.g. a ROC-AUC with a single class) is left out, as `compute.task_metric.mean_and_std`
does for clients; in a paired comparison the whole pair (that seed) is left out, so that the pairing is kept.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats

from peradapt.options import PAIRED_TESTS

CONFIDENCE = 0.95
ALPHA = 0.05

PairedTestName = Literal["t", "wilcoxon"]
TEST_LABELS = dict(zip(PAIRED_TESTS, ("paired t-test", "Wilcoxon signed-rank"), strict=True))

# Differences whose spread is below this (relative to their size, at least 1) are taken as identical: scores are
# accuracies in percent or fractions, and a spread of 1e-12 of them is floating-point noise from `a - b`, which would
# otherwise turn a degenerate case into a huge but finite t.
_IDENTICAL = 1e-12


@dataclass(frozen=True)
class SeedSummary:
    """A method's score over seeds: `mean`, sample standard deviation `std` (ddof = 1), the `low`/`high` ends of the
    Student-t confidence interval of the mean, and `n`, the number of seeds with a defined score. With n = 1 the
    spread is unknown: `std`, `low` and `high` are None. With n = 0, `mean` is None too."""

    mean: float | None
    std: float | None
    low: float | None
    high: float | None
    n: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PairedTest:
    """A method against a reference over the same seeds: `mean_difference` (method − reference), the `low`/`high`
    ends of its Student-t (1 − alpha) interval, the two-sided `p_value` of `test`, whether it is `significant`
    (p < alpha), `n` pairs, and `note`, which says when the test degenerated or could not be run."""

    mean_difference: float | None
    low: float | None
    high: float | None
    p_value: float | None
    significant: bool
    n: int
    test: str
    note: str | None = None
    # Holm's adjusted p over the comparisons made together (`holm_adjusted`); `significant` is then p_holm < alpha
    p_holm: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Rank:
    """A method's place: `rank` (1 is best), `shared` when another method has the same rank, and `label`, the rank
    as a table prints it ("2=" when shared, else "2"). `mean` is the method's mean over seeds (None if it has no
    defined score)."""

    method: str
    rank: int
    shared: bool
    mean: float | None

    @property
    def label(self) -> str:
        return f"{self.rank}=" if self.shared else str(self.rank)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "label": self.label}


def _defined(values: Sequence[float]) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    if array.ndim != 1:
        raise ValueError(f"expected one score per seed, got an array of shape {array.shape}")
    return array[~np.isnan(array)]


def _t_quantile(confidence: float, df: int) -> float:
    return float(stats.t.ppf(0.5 + confidence / 2, df))


def over_seeds(values: Sequence[float], *, confidence: float = CONFIDENCE) -> SeedSummary:
    """Mean, spread and confidence interval of one method's scores x_1..x_n over seeds (NaN scores left out):

        mean = (1/n) Σ x_i
        s    = sqrt( Σ (x_i − mean)² / (n − 1) )            (sample standard deviation, ddof = 1)
        low, high = mean ∓ t_{(1+confidence)/2, n−1} · s / √n  (Student t: the seeds are few, and the normal
                                                              quantile 1.96 would make the interval too narrow)

    n = 1: s and the interval are undefined (there is no spread to estimate), so `std`, `low` and `high` are None,
    which serializes as JSON null rather than a NaN or a misleading zero-width interval. n = 0: everything is None.
    """
    array = _defined(values)
    n = len(array)
    if n == 0:
        return SeedSummary(None, None, None, None, 0)
    mean = float(array.mean())
    if n == 1:
        return SeedSummary(mean, None, None, None, 1)
    std = float(array.std(ddof=1))
    half = _t_quantile(confidence, n - 1) * std / math.sqrt(n)
    return SeedSummary(mean, std, mean - half, mean + half, n)


def paired_difference(
    method_values: Sequence[float],
    reference_values: Sequence[float],
    alpha: float = ALPHA,
    *,
    test: PairedTestName = "t",
) -> PairedTest:
    """A method against a reference run on the same seeds (and so the same partitions): element i of both lists is
    seed i. With differences d_i = a_i − b_i over the n pairs where both are defined:

        mean(d) = (1/n) Σ d_i,   s_d = sqrt( Σ (d_i − mean(d))² / (n − 1) )
        t = mean(d) / (s_d / √n),  df = n − 1,  p = 2 · P(T_{n−1} > |t|)      (paired two-sided t-test)
        low, high = mean(d) ∓ t_{1−alpha/2, n−1} · s_d / √n

    The interval has level 1 − alpha (95% by default), so it excludes 0 exactly when the t-test is significant.

    Why the paired t-test is the default: a comparison has few seeds (3 to 5), and the Wilcoxon signed-rank test
    cannot reach p < 0.05 with n < 6 pairs whatever the data (its smallest two-sided p is 2 / 2^n: 0.0625 for n =
    5), so it could never mark a difference as significant. `test="wilcoxon"` (scipy.stats.wilcoxon, two-sided)
    is offered for many seeds or clearly non-normal differences; the interval stays the t interval of the mean
    difference either way, as the table reports the mean difference.

    Degenerate cases, resolved without NaN:
    - n < 2: no test can be run. p is None and the difference is not significant; the interval is None (the
      mean difference is still given for n = 1).
    - every d_i = 0 (identical columns): nothing to tell apart, p = 1, interval [0, 0], not significant.
    - every d_i equal to the same c ≠ 0 (t-test only): s_d = 0 makes t infinite; p = 0 (its limit as s_d → 0) and
      the difference is significant, with a note saying so: a method that is better by the same amount on every
      seed is consistently better, but the evidence is only n pairs. The interval is [c, c].

    A mismatch in length is a programming error (the lists are not the same seeds): ValueError.
    """
    if test not in TEST_LABELS:
        raise ValueError(f"unknown paired test {test!r}: expected one of {sorted(TEST_LABELS)}")
    a, b = np.asarray(method_values, dtype=float), np.asarray(reference_values, dtype=float)
    if a.ndim != 1 or b.ndim != 1 or len(a) != len(b):
        raise ValueError(
            f"paired values must be two lists of the same seeds, got lengths {len(a)} and {len(b)}"
            if a.ndim == b.ndim == 1
            else f"expected one score per seed, got arrays of shape {a.shape} and {b.shape}"
        )
    both = ~(np.isnan(a) | np.isnan(b))
    differences = a[both] - b[both]
    n = len(differences)
    label = TEST_LABELS[test]
    if n < 2:
        mean = float(differences[0]) if n else None
        return PairedTest(mean, None, None, None, False, n, label, f"no test with {n} pair{'s' * (n != 1)}")
    mean = float(differences.mean())
    scale = max(1.0, float(np.abs(differences).max()))
    if float(np.ptp(differences)) <= _IDENTICAL * scale:
        if abs(mean) <= _IDENTICAL * scale:
            return PairedTest(0.0, 0.0, 0.0, 1.0, False, n, label, "identical scores on every seed")
        if test == "t":
            return PairedTest(
                mean,
                mean,
                mean,
                0.0,
                True,
                n,
                label,
                "the same difference on every seed: the t statistic is infinite, p is its limit 0",
            )
    sd = float(differences.std(ddof=1))
    se = sd / math.sqrt(n)
    half = _t_quantile(1 - alpha, n - 1) * se
    if test == "t":
        t = mean / se
        p = float(2 * stats.t.sf(abs(t), n - 1))
    else:
        p = float(stats.wilcoxon(differences, alternative="two-sided").pvalue)
    return PairedTest(mean, mean - half, mean + half, p, bool(p < alpha), n, label)


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of m p-values tested together (Holm 1979), in their order; None (no test) stays
    None and does not count in m. With the defined p sorted ascending, p_(1) <= ... <= p_(m):

        adjusted p_(i) = max over j <= i of min(1, (m - j + 1) p_(j))

    and a hypothesis is rejected at level alpha where its adjusted p is below alpha: the family-wise error rate
    stays at alpha whatever the dependence between the tests."""
    defined = sorted((p, index) for index, p in enumerate(p_values) if p is not None)
    m = len(defined)
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, index) in enumerate(defined):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[index] = running
    return adjusted


def holm_adjusted(tests: Sequence[PairedTest], alpha: float = ALPHA) -> list[PairedTest]:
    """`tests` made together, each with its Holm-adjusted p (`holm`) and significant by it."""
    adjusted = holm([test.p_value for test in tests])
    return [
        dataclasses.replace(test, p_holm=p, significant=p is not None and p < alpha)
        for test, p in zip(tests, adjusted, strict=True)
    ]


def tied_ranks(
    values: Mapping[str, Sequence[float]],
    alpha: float = ALPHA,
    *,
    test: PairedTestName = "t",
) -> list[Rank]:
    """Ranks of methods (higher score is better: accuracy, ROC-AUC) from their per-seed scores over the same
    seeds, `values`: method name → scores, seed i at index i in every list. For each pair of methods the paired
    test of `paired_difference` is run, and

        rank_i = 1 + #{ j : mean(a_j − a_i) > 0 and p(j, i) < alpha }

    that is, one plus the number of methods significantly better than i, where p(j, i) is Holm's adjusted p over
    all the k(k − 1)/2 pairs (`holm`): with many methods and few seeds, chance alone makes some raw p small (45
    pairs at p < 0.05 each would find two or three by chance). Methods that the test cannot separate share a rank
    ("2=" in the table) rather than being ordered by a difference that may be noise. Not being significantly
    different is not transitive, so e.g. A ≈ B, B ≈ C but A > C gives A 1=, B 1=, C 2.

    Returns one Rank per method, best first (by rank, then by mean, then in the order given).
    """
    names = list(values)
    better = dict.fromkeys(names, 0)
    pairs = [(first, second) for i, first in enumerate(names) for second in names[i + 1 :]]
    tests = [paired_difference(values[first], values[second], alpha, test=test) for first, second in pairs]
    for (first, second), result in zip(pairs, holm_adjusted(tests, alpha), strict=True):
        if result.significant and result.mean_difference is not None:
            # mean_difference is first − second: positive means `first` is the better one.
            better[second if result.mean_difference > 0 else first] += 1
    rank = {name: 1 + better[name] for name in names}
    counts: dict[int, int] = {}
    for r in rank.values():
        counts[r] = counts.get(r, 0) + 1
    means = {name: over_seeds(values[name]).mean for name in names}
    order = sorted(
        names,
        key=lambda name: (rank[name], -means[name] if means[name] is not None else math.inf, names.index(name)),
    )
    return [Rank(name, rank[name], counts[rank[name]] > 1, means[name]) for name in order]
