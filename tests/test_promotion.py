"""The champion promotion rule (models/promotion.py) on each of its branches, the LMVU ranker's gate, and
the one average of the report figures (models/report.py) that gives the dev scores it compares."""

import math

import pandas as pd
import pytest

from covlab.models.promotion import (ALREADY_CHAMPION, GATED, PROMOTE, STAYS_CANDIDATE, promotion_decision,
                                     ranker_trusted)
from covlab.models.report import method_means, method_scores, report_figures
from covlab.models.trust import Trust


def test_a_first_version_is_promoted():
    decision = promotion_decision(1, 0.61, None, None, score_name="dev_alpha_ndcg_at_10")
    assert decision == (PROMOTE, True, "promoted to champion (dev_alpha_ndcg_at_10 0.6100; previous champion: none)")


def test_the_champion_itself_stays_champion_whatever_its_score():
    decision = promotion_decision(3, 0.2, 3, 0.7)
    assert decision.action == ALREADY_CHAMPION and decision.champion
    assert decision.reason == "is already champion (dev score 0.2000)"


def test_a_worse_candidate_stays_candidate():
    decision = promotion_decision(4, 0.6, 3, 0.65)
    assert decision == (STAYS_CANDIDATE, False, "stays candidate: dev score 0.6000 < champion v3 0.6500")


@pytest.mark.parametrize("dev_score", [0.65, 0.7])
def test_a_candidate_at_least_as_good_as_the_champion_is_promoted(dev_score):
    decision = promotion_decision(4, dev_score, 3, 0.65)
    assert decision.action == PROMOTE and decision.champion
    assert decision.reason.endswith("previous champion: v3 0.6500)")


def test_a_champion_without_a_score_gives_way():
    decision = promotion_decision(4, 0.1, 3, None)
    assert decision.action == PROMOTE and decision.reason.endswith("previous champion: v3 without a score)")


@pytest.mark.parametrize("champion", [(None, None), (3, 0.1), (4, 0.9)])
def test_a_gated_candidate_is_never_promoted_even_when_better_or_already_champion(champion):
    decision = promotion_decision(4, 0.9, *champion, gate=Trust(False, "dev ROC-AUC 0.5 < 0.65"))
    assert decision == (GATED, False, "is not promoted to champion: dev ROC-AUC 0.5 < 0.65")


def test_a_passed_gate_decides_nothing():
    assert promotion_decision(4, 0.5, 3, 0.6, gate=Trust(True, "ok")) == promotion_decision(4, 0.5, 3, 0.6)


@pytest.mark.parametrize("top1, chance, trusted", [(0.5, 0.3, True), (0.3, 0.3, False), (0.2, 0.3, False),
                                                    (float("nan"), 0.3, False), (0.5, float("nan"), False)])
def test_the_ranker_gate_asks_for_top1_accuracy_above_chance(top1, chance, trusted):
    gate = ranker_trusted(top1, chance)
    assert gate.trusted == trusted
    decision = promotion_decision(2, 0.9, None, None, gate=gate, score_name="dev_rvc1")
    assert (decision.action == GATED) == (not trusted)
    if not trusted:
        assert decision.reason == f"is not promoted to champion: {gate.reason}"


def test_the_ranker_gate_says_why_in_words():
    assert ranker_trusted(0.3, 0.3).reason == ("dev top-1 accuracy 0.3000 <= chance 0.3000: the ranker picks the "
                                               "best candidate no more often than a random pick")
    assert ranker_trusted(0.5, 0.25).reason == "dev top-1 accuracy 0.5000 > chance 0.2500"


PER_QUERY = pd.DataFrame({"method": ["a", "a", "a", "b", "b"], "query_id": ["q1", "q2", "q3", "q1", "q3"],
                          "split": ["dev", "dev", "test", "dev", "test"], "metric": ["m"] * 5,
                          "value": [0.2, 0.6, 1.0, 0.5, 0.0]})


def test_method_means_by_hand():
    means = method_means(PER_QUERY).set_index(["method", "split"])["value"]
    assert means.to_dict() == {("a", "dev"): pytest.approx(0.4), ("a", "test"): 1.0, ("b", "dev"): 0.5,
                               ("b", "test"): 0.0}
    assert method_scores(PER_QUERY, "dev", "m") == {"a": pytest.approx(0.4), "b": 0.5}
    assert method_scores(PER_QUERY, "dev", "other") == {}


def test_report_figures_are_the_rows_and_their_means():
    figures = report_figures(PER_QUERY, "demo", 10)
    assert len(figures) == len(PER_QUERY) + 4
    aggregates = figures[figures["query_id"].isna()]
    assert aggregates.set_index(["method", "split"])["value"].to_dict() == method_means(PER_QUERY).set_index(
        ["method", "split"])["value"].to_dict()
    assert (figures["dataset"] == "demo").all() and (figures["k"] == 10).all()
    assert all(b is None or math.isnan(b) for b in figures["budget"])


BUDGETED = pd.DataFrame({"method": ["a"] * 5 + ["b"], "budget": [32, 32, 64, 64, 32, 32],
                         "query_id": ["q1", "q2", "q1", "q2", "q3", "q1"], "split": ["dev"] * 4 + ["test", "dev"],
                         "metric": ["rvc1"] * 6, "value": [0.0, 0.5, 1.0, 0.5, 0.25, 1.0]})


def test_method_means_of_budgeted_figures_are_per_budget():
    means = method_means(BUDGETED).set_index(["method", "budget", "split"])["value"]
    assert means.to_dict() == {("a", 32, "dev"): 0.25, ("a", 32, "test"): 0.25, ("a", 64, "dev"): 0.75,
                               ("b", 32, "dev"): 1.0}


def test_report_figures_of_budgeted_figures_keep_their_budgets():
    figures = report_figures(BUDGETED, "argkp", None)
    assert len(figures) == len(BUDGETED) + 4
    assert list(figures["budget"].iloc[:len(BUDGETED)]) == list(BUDGETED["budget"])
    aggregates = figures[figures["query_id"].isna()].set_index(["method", "budget", "split"])["value"]
    assert aggregates.to_dict() == method_means(BUDGETED).set_index(["method", "budget", "split"])["value"].to_dict()
    assert figures["k"].isna().all() and (figures["dataset"] == "argkp").all()
