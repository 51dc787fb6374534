"""Paired per-query comparison (METHODS.md §2 "Statistics") on hand-checkable inputs."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from covlab.models.statistics import paired_comparison


def per_query(values, prefix="q") -> pd.Series:
    return pd.Series(values, index=[f"{prefix}{i}" for i in range(len(values))], dtype=float)


def test_all_wins():
    """a beats b on all 6 queries by 0.1: sign test p = 2 * 0.5^6 = 0.03125; Wilcoxon (exact) has W- = 0,
    p = 2 * P(W <= 0) = 2 / 2^6 as well; every bootstrap mean is 0.1."""
    a = per_query([0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    result = paired_comparison(a, a - 0.1, n_boot=500)
    assert (result["wins"], result["ties"], result["losses"]) == (6, 0, 0)
    assert result["sign_test_p"] == pytest.approx(2 * 0.5 ** 6)
    assert result["wilcoxon_p"] == pytest.approx(2 * 0.5 ** 6)
    assert result["mean_difference"] == pytest.approx(0.1)
    assert result["ci_low"] == pytest.approx(0.1) and result["ci_high"] == pytest.approx(0.1)
    assert result["n"] == 6 and result["mean_a"] == pytest.approx(0.75) and result["mean_b"] == pytest.approx(0.65)


def test_identical_runs_are_all_ties():
    a = per_query([0.2, 0.4, 0.4, 0.9])
    result = paired_comparison(a, a.copy())
    assert (result["wins"], result["ties"], result["losses"]) == (0, 4, 0)
    assert result["mean_difference"] == 0.0
    assert (result["ci_low"], result["ci_high"]) == (0.0, 0.0)
    assert result["sign_test_p"] is None and result["wilcoxon_p"] is None


def test_mixed_known_answer():
    """Differences (a - b): +0.3, +0.1, 0, -0.2, +0.4: 3 wins, 1 tie, 1 loss, mean 0.12.
    Sign test on the 4 untied queries, 3 wins: P(X >= 3) + P(X <= 1) = 2 * 5/16 = 0.625.
    Wilcoxon drops the tie; ranks of |d| 0.1, 0.2, 0.3, 0.4 are 1..4; the loss has rank 2, so W- = 2 and
    the exact two-sided p = 2 * P(W <= 2) = 2 * 3/16 = 0.375 (subsets of {1,2,3,4} summing to <= 2: {}, {1}, {2})."""
    b = per_query([0.5, 0.5, 0.5, 0.5, 0.5])
    a = b + np.array([0.3, 0.1, 0.0, -0.2, 0.4])
    result = paired_comparison(a, b, n_boot=2000, seed=3)
    assert (result["wins"], result["ties"], result["losses"]) == (3, 1, 1)
    assert result["mean_difference"] == pytest.approx(0.12)
    assert result["sign_test_p"] == pytest.approx(0.625)
    assert result["wilcoxon_p"] == pytest.approx(0.375)
    assert -0.2 <= result["ci_low"] < 0.12 < result["ci_high"] <= 0.4


def test_bootstrap_ci_matches_a_direct_percentile_bootstrap_and_is_seeded():
    rng = np.random.default_rng(7)
    b = per_query(rng.random(40))
    a = b + rng.normal(0.05, 0.1, size=40)
    first = paired_comparison(a, b, n_boot=4000, seed=11, confidence=0.9)
    assert first == paired_comparison(a, b, n_boot=4000, seed=11, confidence=0.9)
    assert first != paired_comparison(a, b, n_boot=4000, seed=12, confidence=0.9)
    reference = stats.bootstrap(((a - b).to_numpy(),), np.mean, n_resamples=4000, confidence_level=0.9,
                                method="percentile", rng=np.random.default_rng(0))
    # Two independent bootstraps of 4000 resamples agree to well within the spread of the mean.
    spread = (a - b).std() / np.sqrt(40)
    assert first["ci_low"] == pytest.approx(reference.confidence_interval.low, abs=0.1 * spread)
    assert first["ci_high"] == pytest.approx(reference.confidence_interval.high, abs=0.1 * spread)


def test_alignment_is_by_query_not_position():
    a = pd.Series({"q1": 1.0, "q2": 0.0})
    b = pd.Series({"q2": 0.0, "q1": 0.5})
    result = paired_comparison(a, b, n_boot=100)
    assert (result["wins"], result["ties"], result["losses"]) == (1, 1, 0)
    assert result["mean_difference"] == pytest.approx(0.25)


@pytest.mark.parametrize("a, b, kwargs, message", [
    (pd.Series({"q1": 1.0}), pd.Series({"q2": 1.0}), {}, "same queries; only in a: \\['q1'\\]"),
    (pd.Series([1.0, 2.0], index=["q1", "q1"]), pd.Series([1.0, 2.0], index=["q1", "q2"]), {}, "duplicate"),
    (pd.Series({"q1": np.nan}), pd.Series({"q1": 1.0}), {}, "missing values"),
    (pd.Series(dtype=float), pd.Series(dtype=float), {}, "empty"),
    (pd.Series({"q1": 1.0}), pd.Series({"q1": 1.0}), {"n_boot": 0}, "n_boot"),
    (pd.Series({"q1": 1.0}), pd.Series({"q1": 1.0}), {"confidence": 1.0}, "confidence"),
])
def test_bad_input_is_named(a, b, kwargs, message):
    with pytest.raises(ValueError, match=message):
        paired_comparison(a, b, **kwargs)


def test_mean_ci_is_the_mean_with_the_percentile_bootstrap_of_its_queries():
    from covlab.models.statistics import mean_ci

    assert mean_ci(pd.Series([0.4, 0.4, 0.4])) == {"n": 3, "mean": pytest.approx(0.4), "ci_low": pytest.approx(0.4),
                                                    "ci_high": pytest.approx(0.4), "confidence": 0.95}
    values = np.array([0.1, 0.9, 0.5, 0.7])
    resampled = np.random.default_rng(3).integers(0, 4, size=(500, 4))
    low, high = np.quantile(values[resampled].mean(axis=1), [0.05, 0.95])
    found = mean_ci(pd.Series(values), n_boot=500, seed=3, confidence=0.9)
    assert (found["n"], found["mean"]) == (4, pytest.approx(0.55))
    assert (found["ci_low"], found["ci_high"]) == (pytest.approx(low), pytest.approx(high))
    with pytest.raises(ValueError, match="1 missing"):
        mean_ci(pd.Series([0.5, np.nan]))


def test_wilcoxon_p_is_scipys_value_with_and_without_ties():
    """The vectorised permutation test gives exactly scipy.stats.wilcoxon's p-value: tied |differences| (scipy's
    sign-flip enumeration, n <= 13), untied ones (its exact distribution) and larger n (its approximation)."""
    from covlab.models.statistics import PERMUTED_UP_TO, wilcoxon_p

    rng = np.random.default_rng(1)
    for n in range(1, PERMUTED_UP_TO + 4):
        tied = rng.choice([-0.5, -0.25, -0.1, 0.1, 0.25, 0.5], size=n)
        untied = rng.normal(size=n)
        for differences in (tied, untied):
            assert wilcoxon_p(differences) == pytest.approx(stats.wilcoxon(differences).pvalue, abs=1e-12), n
