"""models/plots.py: the float entries a report's Plots tab charts (a known answer by hand) and the inline PNG
figures (they decode: the PNG signature and the expected size)."""

import base64
import struct

import pandas as pd
import pytest

from covlab.models.leaderboard import BOARDS, leaderboard
from covlab.models.plots import (PNG_SIGNATURE, SIZE_PX, budget_chart, figure_entries, interval_chart,
                                 leaderboard_chart, markdown_image, method_intervals, training_curve)
from covlab.models.registry import Report


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which follows the 8-byte signature and its 8-byte chunk header."""
    assert png[:8] == PNG_SIGNATURE and png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])


PER_QUERY = pd.DataFrame({
    "method": ["greedy"] * 4 + ["relevance"] * 4,
    "query_id": ["q1", "q2"] * 4,
    "metric": ["alpha_ndcg@10", "alpha_ndcg@10", "strecall@10", "strecall@10"] * 2,
    "value": [0.5, 0.75, 1.0, 0.5, 0.25, 0.25, 0.5, 0.0],
})


def test_one_entry_per_metric_and_method_is_the_mean_over_queries():
    assert figure_entries(PER_QUERY) == {
        "alpha_ndcg@10/greedy": 0.625, "alpha_ndcg@10/relevance": 0.25,
        "strecall@10/greedy": 0.75, "strecall@10/relevance": 0.25}
    assert list(figure_entries(PER_QUERY, metrics=["strecall@10"])) == ["strecall@10/greedy",
                                                                        "strecall@10/relevance"]


def test_budgets_are_zero_padded_so_names_sort_in_budget_order():
    rows = pd.DataFrame({"method": ["mmr", "mmr", "mmr", "lmvu"], "budget": [1024, 64, 64, 64],
                         "query_id": ["q1", "q1", "q2", "q1"], "metric": "rvc1", "value": [1.0, 0.25, 0.75, 0.5]})
    entries = figure_entries(rows)
    assert entries == {"rvc1/budget_00064/lmvu": 0.5, "rvc1/budget_00064/mmr": 0.5, "rvc1/budget_01024/mmr": 1.0}
    assert list(entries) == sorted(entries)
    assert all(isinstance(value, float) for value in entries.values())


def test_method_intervals_hold_the_mean_and_collapse_for_constant_values():
    intervals = method_intervals(PER_QUERY, "alpha_ndcg@10")
    assert intervals.loc["greedy", "mean"] == pytest.approx(0.625)
    assert intervals.loc["greedy", "ci_low"] <= 0.625 <= intervals.loc["greedy", "ci_high"]
    assert intervals.loc["greedy", ["ci_low", "ci_high"]].tolist() == pytest.approx([0.5, 0.75])  # 2 queries
    assert intervals.loc["relevance", ["mean", "ci_low", "ci_high"]].tolist() == pytest.approx([0.25] * 3)
    assert intervals.loc["relevance", "n"] == 2


def test_figures_are_pngs_of_the_expected_size():
    rows = pd.DataFrame({"method": ["a", "a", "b", "b"], "budget": [32, 64, 32, 64], "value": [0.1, 0.3, 0.2, 0.5]})
    figures = [interval_chart(method_intervals(PER_QUERY, "strecall@10"), "strecall@10"),
               budget_chart(rows, "rvc1 vs budget"),
               training_curve([{"epoch": 1, "train_loss": 0.7, "dev_auc": 0.6},
                               {"epoch": 2, "train_loss": 0.5, "dev_auc": None}], "training"),
               leaderboard_chart(leaderboard(pd.DataFrame({  # two budgets of two ranked methods each
                   "method": ["relevance", "mmr", "lmvu", "oracle_rvc1"] * 2, "budget": [32] * 4 + [64] * 4,
                   "query_id": ["q1"] * 8, "metric": "rvc1", "value": [0.2, 0.4, 0.2, 1.0, 0.5, 0.1, 0.5, 1.0]}),
                   BOARDS[Report.COMPARISON]), "relevance")]
    for png in figures[:-1]:
        assert png_size(png) == SIZE_PX
    assert png_size(figures[-1])[0] == SIZE_PX[0]  # the leaderboard's panels stack: its height follows its rows
    for png in figures:
        assert len(png) < 30_000  # small enough to inline in metadata


def test_markdown_image_inlines_the_png_as_a_data_uri():
    png = budget_chart(pd.DataFrame({"method": ["a"], "budget": [32], "value": [0.5]}), "one point")
    text = markdown_image(png, "rvc1")
    assert text.startswith("![rvc1](data:image/png;base64,") and text.endswith(")")
    assert base64.b64decode(text[len("![rvc1](data:image/png;base64,"):-1]) == png
