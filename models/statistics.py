"""Paired per-query comparison of two methods (METHODS.md §2 "Statistics"): mean difference with a
percentile bootstrap CI, win/tie/loss counts, sign test, and Wilcoxon signed-rank test."""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats


def paired_comparison(a: pd.Series, b: pd.Series, n_boot: int = 10000, seed: int = 0,
                      confidence: float = 0.95) -> dict:
    """Compare per-query values `a` and `b` (indexed by query id; both must hold the same queries).

    Returns plain Python numbers (JSON-ready): n, mean_a, mean_b, mean_difference (a - b), ci_low and
    ci_high (percentile bootstrap over queries, `n_boot` resamples drawn from numpy's Generator(seed)),
    confidence, wins / ties / losses (a > b / a == b / a < b, exact equality), sign_test_p (two-sided
    binomial test on the non-tied queries) and wilcoxon_p (two-sided, zero differences dropped, exact for
    small n as scipy decides). Both p-values are None when every query is a tie: there is nothing to test."""
    values = _paired_differences(a, b).to_numpy()
    ci_low, ci_high = _bootstrap_ci(values, n_boot, seed, confidence)
    wins, losses = int((values > 0).sum()), int((values < 0).sum())
    untied = wins + losses
    return {
        "n": len(values),
        "mean_a": float(a.mean()),
        "mean_b": float(b.mean()),
        "mean_difference": float(values.mean()),
        "ci_low": float(ci_low),
        "ci_high": float(ci_high),
        "confidence": confidence,
        "wins": wins,
        "ties": len(values) - untied,
        "losses": losses,
        "sign_test_p": float(stats.binomtest(wins, untied, 0.5).pvalue) if untied else None,
        "wilcoxon_p": wilcoxon_p(values[values != 0]) if untied else None,
    }


# scipy's Wilcoxon test turns to a sign-flip permutation test for tied |differences| up to this many queries
# (2**13 sign patterns, all enumerated), and to its normal approximation above it.
PERMUTED_UP_TO = 13


def wilcoxon_p(differences: np.ndarray) -> float:
    """Two-sided Wilcoxon signed-rank p-value of nonzero paired `differences`, the value scipy.stats.wilcoxon
    gives. Where ties among |differences| make scipy enumerate every sign pattern (n <= PERMUTED_UP_TO), its
    permutation test is run here with a vectorised statistic: scipy applies its own statistic one pattern at a
    time (2**n Python calls, about a second per test at n = 13), the same enumeration and p-value at array speed."""
    differences = np.asarray(differences, dtype=float)
    magnitudes = np.abs(differences)
    tied = len(np.unique(magnitudes)) < len(magnitudes)
    if not tied or len(differences) > PERMUTED_UP_TO:
        return float(stats.wilcoxon(differences).pvalue)
    ranks = stats.rankdata(magnitudes)  # a sign flip keeps every |difference|, so their ranks are fixed

    def positive_rank_sum(flipped: np.ndarray, axis: int) -> np.ndarray:
        return np.sum((flipped > 0) * ranks, axis=axis)

    return float(stats.permutation_test((differences,), positive_rank_sum, permutation_type="samples",
                                        vectorized=True, n_resamples=9999, alternative="two-sided").pvalue)


def mean_ci(values: pd.Series, n_boot: int = 10000, seed: int = 0, confidence: float = 0.95) -> dict:
    """The mean of per-query values with its percentile bootstrap CI over queries (as `paired_comparison`
    resamples): {n, mean, ci_low, ci_high, confidence}, plain numbers."""
    array = np.asarray(values, dtype=float)
    if len(array) == 0 or np.isnan(array).any():
        raise ValueError(f"mean_ci: expected per-query values without gaps; got {len(array)} values, "
                         f"{int(np.isnan(array).sum())} missing")
    ci_low, ci_high = _bootstrap_ci(array, n_boot, seed, confidence)
    return {"n": len(array), "mean": float(array.mean()), "ci_low": float(ci_low), "ci_high": float(ci_high),
            "confidence": confidence}


def _bootstrap_ci(values: np.ndarray, n_boot: int, seed: int, confidence: float) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of `values`: `n_boot` resamples of the queries drawn from numpy's
    Generator(seed)."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be a positive number of bootstrap resamples; got {n_boot}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1; got {confidence}")
    resampled = np.random.default_rng(seed).integers(0, len(values), size=(n_boot, len(values)))
    tail = (1 - confidence) / 2
    low, high = np.quantile(values[resampled].mean(axis=1), [tail, 1 - tail])
    return float(low), float(high)


def _paired_differences(a: pd.Series, b: pd.Series) -> pd.Series:
    """a - b aligned on the query index; refuses unpaired, duplicated or missing values."""
    for name, series in (("a", a), ("b", b)):
        if series.index.has_duplicates:
            raise ValueError(f"{name} has duplicate query ids {series.index[series.index.duplicated()][:5].tolist()}; "
                             "expected one value per query")
        if series.isna().any():
            raise ValueError(f"{name} has missing values for queries {series.index[series.isna()][:5].tolist()}")
    only_a, only_b = a.index.difference(b.index), b.index.difference(a.index)
    if len(only_a) or len(only_b):
        raise ValueError(f"a and b must hold the same queries; only in a: {only_a[:5].tolist()}, "
                         f"only in b: {only_b[:5].tolist()}")
    if len(a) == 0:
        raise ValueError("a and b are empty; expected at least one query")
    return (a - b.reindex(a.index)).astype(float)
