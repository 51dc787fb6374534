"""The leaderboard (models/leaderboard.py): known answers worked out by hand on small per-query tables."""

import numpy as np
import pandas as pd
import pytest

from covlab.models.leaderboard import BOARDS, MIN_QUERIES, Board, answers, leaderboard
from covlab.models.metrics import RVC1
from covlab.models.registry import Report
from covlab.models.schemas import LEADERBOARD

TOKENS = BOARDS[Report.COMPARISON]


def _figures(values: dict[str, list[float]], budget: int = 128, metric: str = "rvc1") -> pd.DataFrame:
    rows = [{"method": m, "budget": budget, "query_id": f"q{i:02d}", "metric": metric, "value": v}
            for m, column in values.items() for i, v in enumerate(column)]
    return pd.DataFrame(rows)


def _row(table: pd.DataFrame, method: str, budget: str = "128 tokens") -> pd.Series:
    return table[(table["method"] == method) & (table["budget"] == budget)].iloc[0]


def test_a_method_ahead_of_relevance_and_of_the_runner_up_wins():
    relevance = [0.2, 0.4, 0.5, 0.3, 0.6, 0.1, 0.4, 0.5, 0.2, 0.3, 0.7, 0.4]
    table = leaderboard(_figures({
        "relevance": relevance,
        "mmr": relevance,  # equal on every query: a tie, CI [0, 0]
        "lmvu": [v + 0.1 for v in relevance],  # 0.1 ahead on every query
        "oracle_rvc1": [1.0] * 12}), TOKENS)
    assert list(table.columns) == list(LEADERBOARD.columns)
    lmvu = _row(table, "lmvu")
    assert lmvu["rank"] == 1 and lmvu["n"] == 12
    assert lmvu["mean"] == pytest.approx(np.mean(relevance) + 0.1)
    assert lmvu["difference"] == pytest.approx(0.1) and lmvu["ci_low"] == pytest.approx(0.1)
    assert lmvu["verdict"] == "winner: ahead of relevance"  # the runner-up is relevance itself (registry order)
    assert lmvu["headroom"] == pytest.approx(1.0 - np.mean(relevance) - 0.1)
    mmr = _row(table, "mmr")
    assert mmr["verdict"] == "tie with relevance" and mmr["ci_low"] == 0 == mmr["ci_high"]
    assert _row(table, "relevance")["verdict"] == "baseline"
    oracle = _row(table, "oracle_rvc1")  # the best mean, yet a bound: listed last, never ranked
    assert pd.isna(oracle["rank"]) and oracle["verdict"].startswith("bound")
    assert table.iloc[-1]["method"] == "oracle_rvc1"
    assert list(table["rank"].dropna()) == [1, 2, 2]  # relevance and mmr tie on every query: one place


def test_two_methods_ahead_but_inseparable_share_first_place():
    rng = np.random.default_rng(3)
    relevance = rng.uniform(0.2, 0.5, 20)
    noise = rng.normal(0, 0.05, 20)
    table = leaderboard(_figures({"relevance": list(relevance), "mmr": list(relevance + 0.2),
                                  "adagres": list(relevance + 0.2 + noise)}), TOKENS)
    first = table[table["rank"] == 1].iloc[0]
    second = table[table["rank"] == 2].iloc[0]
    assert {first["method"], second["method"]} == {"mmr", "adagres"}
    assert first["verdict"].startswith(f"ahead of relevance, shares first with {second['method']} [-")
    assert second["verdict"] == "ahead of relevance"
    table = leaderboard(_figures({"relevance": list(relevance), "mmr": list(relevance + 0.2),
                                  "adagres": list(relevance + 0.5 + noise)}), TOKENS)
    assert table.iloc[0]["verdict"] == "winner: ahead of relevance and of mmr"


def test_equal_means_share_a_place_and_the_first_says_so():
    values = {"relevance": [0.1 * i for i in range(3)], "facloc": [0.5] * 3, "lmvu": [0.5] * 3}
    table = leaderboard(_figures(values), TOKENS)
    assert list(table["rank"]) == [1, 1, 3]
    assert table.iloc[0]["verdict"] == f"first (tied with lmvu), no winner: no call: n=3 < {MIN_QUERIES}"


def test_below_min_queries_nothing_is_called():
    relevance = [0.1, 0.2, 0.3]
    table = leaderboard(_figures({"relevance": relevance, "lmvu": [0.9, 0.9, 0.9]}), TOKENS)
    lmvu = _row(table, "lmvu")
    assert lmvu["rank"] == 1 and lmvu["ci_low"] > 0  # the bootstrap of three positive differences excludes 0 ...
    assert lmvu["verdict"] == f"first, no winner: no call: n=3 < {MIN_QUERIES}"  # ... and is no evidence


def test_behind_and_first_place_of_the_baseline():
    relevance = [0.5 + 0.01 * i for i in range(12)]
    table = leaderboard(_figures({"relevance": relevance, "facloc": [v - 0.2 for v in relevance]}), TOKENS)
    assert _row(table, "relevance")["verdict"] == "first: nothing is ahead of it"
    assert _row(table, "facloc")["verdict"] == "behind relevance"
    assert answers(table) == [f"128 tokens: relevance {np.mean(relevance):.3f} (baseline, n=12): first: nothing is "
                              "ahead of it"]


def test_budgets_in_numeric_order_and_one_line_each():
    values = {"relevance": [0.1 * i for i in range(10)], "mmr": [0.1 * i + 0.05 for i in range(10)]}
    table = leaderboard(pd.concat([_figures(values, 1024), _figures(values, 32)]), TOKENS)
    assert list(dict.fromkeys(table["budget"])) == ["32 tokens", "1024 tokens"]
    lines = answers(table)
    assert lines == [f"{budget} tokens: MMR 0.500 (+0.050 [+0.050, +0.050], n=10): winner: ahead of relevance"
                     for budget in (32, 1024)]
    assert np.isnan(_row(table, "mmr", "32 tokens")["headroom"])  # no oracle in the figures


def test_a_report_without_budgets_is_one_board():
    values = {"relevance": [0.3] * 10, "coverage_greedy": [0.4] * 10}
    figures = _figures(values, metric="alpha_ndcg@10").drop(columns="budget")
    table = leaderboard(figures, BOARDS[Report.COVERAGE], budget_label="k=10")
    assert set(table["budget"]) == {"k=10"}
    assert _row(table, "coverage_greedy", "k=10")["verdict"].startswith("winner")


def test_a_missing_measure_is_named():
    with pytest.raises(ValueError, match="no rvc1 figures to rank; the report has \\['alpha_ndcg@10'\\]"):
        leaderboard(_figures({"relevance": [0.1]}, metric="alpha_ndcg@10"), Board(RVC1))
