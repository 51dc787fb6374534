"""The champion promotion rule (models/promotion.py) on each of its branches, and the one average of the
report figures (models/report.py) that gives the dev scores it compares."""

import math

import pandas as pd
import pytest

from covlab.models.promotion import ALREADY_CHAMPION, GATED, PROMOTE, STAYS_CANDIDATE, promotion_decision
from covlab.models.report import method_means, method_scores, report_figures
from covlab.models.selection import Trust


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
