"""Never worse than the fallback, by construction and by check: on the generated long-document set with
BM25 pools, soft greedy with its blend weight chosen on dev stays with the pool order when the estimator
is a coin (uniform random probabilities) and leaves it when the estimator is perfect (the gold matrix); the
estimator gate makes the selections fall back, warns in its check and blocks champion promotion."""

import json

import numpy as np
import pandas as pd
import pytest

from covlab.assets.checks import coverage_estimator_dev_auc, estimated_gold_coverage_calibration
from covlab.assets.promotions import promote
from covlab.assets.selections import k_selection
from covlab.models.metrics import evaluate_run
from covlab.models.pools import rank_within_queries
from covlab.models.registry import method
from covlab.models.schemas import SELECTIONS, document_text
from covlab.models.selection import ranked_pools, select_queries
from covlab.models.selectors import Blend, Budget, CoverageGreedy, RelevanceOrder
from covlab.models.trust import choose_blend_weight, estimator_trusted
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.model_store import RegisteredModel, TrainedModel
from covlab.resources.tracking import TrackingResource

K, ALPHA, WEIGHTS = 10, 0.5, [0.0, 0.25, 0.5, 0.75, 1.0]
MARGIN = 0.05  # alpha-nDCG@10 on test a coin estimator may cost at most
RANDOM_SEEDS = range(5)
NO_DOCUMENT_JUDGMENTS = pd.DataFrame({"query_id": [], "doc_id": [], "relevance": []})


@pytest.fixture(scope="module")
def longdoc():
    from covlab.resources.longdoc_dataset import build_longdoc_dataset

    return build_longdoc_dataset(profile="small", seed=7)


@pytest.fixture(scope="module")
def pools(longdoc):
    """BM25 (bm25s, Lucene variant, k1 0.9, b 0.4) over the whole corpus for every dev and test question:
    the pool order is the fallback, as the coverage bi-encoder order is in the pipeline."""
    bm25s = pytest.importorskip("bm25s")
    corpus = longdoc.corpus
    retriever = bm25s.BM25(method="lucene", k1=0.9, b=0.4)
    retriever.index(bm25s.tokenize([document_text(t, x) for t, x in zip(corpus["title"], corpus["text"])],
                                   stopwords="en", show_progress=False), show_progress=False)
    doc_ids = corpus["doc_id"].to_numpy()
    evaluated = longdoc.queries[longdoc.queries["split"].isin(["dev", "test"])]
    rows = []
    for query_id, text in zip(evaluated["query_id"], evaluated["text"]):
        hits, scores = retriever.retrieve(bm25s.tokenize([text], stopwords="en", show_progress=False),
                                          k=min(100, len(corpus)), show_progress=False)
        rows += [{"query_id": query_id, "doc_id": doc_ids[i], "score": float(s)} for i, s in zip(hits[0], scores[0])]
    return rank_within_queries(pd.DataFrame(rows))


def estimator(**figures) -> TrainedModel:
    """A coverage estimator's asset value carrying `figures` (what its gate and its check read)."""
    model = RegisteredModel("covlab.longdoc.coverage_estimator", 1, "models:/e/1", "run", "source", "path", "hash")
    return TrainedModel(model, figures)


def pool_nugget_pairs(pools: pd.DataFrame, nuggets: pd.DataFrame) -> pd.DataFrame:
    return (pools[["query_id", "doc_id"]].merge(nuggets[["query_id", "nugget_id"]], on="query_id")
            .rename(columns={"nugget_id": "subq_id"}))


def coin_estimate(pools, nuggets, seed: int) -> pd.DataFrame:
    pairs = pool_nugget_pairs(pools, nuggets)
    return pairs.assign(probability=np.random.default_rng(seed).random(len(pairs)))


def perfect_estimate(pools, nuggets, nugget_links) -> pd.DataFrame:
    pairs = pool_nugget_pairs(pools, nuggets)
    linked = set(map(tuple, nugget_links[["query_id", "doc_id", "nugget_id"]].itertuples(index=False)))
    return pairs.assign(probability=[float(t in linked) for t in pairs.itertuples(index=False)])


def k_run(pools: pd.DataFrame, queries: pd.DataFrame, selector, estimate: pd.DataFrame | None = None) -> pd.DataFrame:
    """A SELECTIONS run: `selector` at Budget(k=K) over every pool, in pool order, reading `estimate`."""
    query_pools = ranked_pools(pools, queries, estimate) if estimate is not None else ranked_pools(pools, queries)
    return SELECTIONS.conform(select_queries(query_pools, selector, [Budget(k=K)]).table, source="selections")


SOFT = CoverageGreedy(soft=True)


def blend_choice(pools, dataset, estimate, selector=SOFT):
    """The blend weight of `selector` chosen on dev (models/trust.choose_blend_weight)."""
    return choose_blend_weight(selector, ranked_pools(pools, dataset.queries, estimate), "dev", Budget(k=K),
                               dataset.nugget_links, WEIGHTS, ALPHA)


def mean_alpha_ndcg(run: pd.DataFrame, dataset, split: str) -> float:
    measured = evaluate_run(run, dataset.nugget_links, NO_DOCUMENT_JUDGMENTS, k=K, alpha=ALPHA)
    measured = measured[measured["metric"] == f"alpha_ndcg@{K}"].merge(dataset.queries, on="query_id")
    return float(measured.loc[measured["split"] == split, "value"].mean())


@pytest.mark.parametrize("selector", [CoverageGreedy(soft=True), CoverageGreedy(soft=False, tau=0.3)],
                         ids=["soft", "hard"])
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_a_coin_estimator_costs_at_most_the_margin_on_test(longdoc, pools, seed, selector):
    estimate = coin_estimate(pools, longdoc.nuggets, seed)
    choice = blend_choice(pools, longdoc, estimate, selector)
    fallback = k_run(pools, longdoc.queries, RelevanceOrder())
    assert choice.fallback_score == pytest.approx(mean_alpha_ndcg(fallback, longdoc, "dev"))
    assert choice.scores[choice.weight] >= choice.fallback_score  # by construction, on dev
    blended = k_run(pools, longdoc.queries, Blend(selector, choice.weight), estimate)
    unblended = k_run(pools, longdoc.queries, selector, estimate)
    test_fallback, test_blended = mean_alpha_ndcg(fallback, longdoc, "test"), mean_alpha_ndcg(blended, longdoc, "test")
    assert test_blended >= test_fallback - MARGIN, (choice.evidence(), test_blended, test_fallback)
    if selector.soft:  # what the blend guards against (hard greedy at tau 0.3 counts 70% of coin
        # flips as covered, so unblended it stays near the pool order on this set)
        assert mean_alpha_ndcg(unblended, longdoc, "test") < test_fallback - MARGIN


def test_a_perfect_estimator_is_followed_and_beats_the_fallback_on_dev(longdoc, pools):
    estimate = perfect_estimate(pools, longdoc.nuggets, longdoc.nugget_links)
    choice = blend_choice(pools, longdoc, estimate)
    assert choice.weight > 0
    assert choice.scores[choice.weight] > choice.fallback_score


@pytest.fixture(scope="module")
def asset_inputs(longdoc, pools):
    """What the selection assets read: the BM25 pools, pool scores whose coverage_trained column keeps the
    BM25 order, the queries and nugget links."""
    return {"bm25_pools": pools, "scores": pools.assign(coverage_trained=pools["score"]),
            "queries": longdoc.queries}


@pytest.mark.parametrize("name", ["coverage_greedy", "coverage_greedy_soft", "gold_nugget_bound_soft"])
def test_selections_on_an_untrusted_estimator_fall_back_to_the_pool_order(longdoc, pools, asset_inputs, name):
    evaluation = EvaluationResource()
    out = k_selection(method(name), **asset_inputs, evaluation=evaluation,
                      coverage=coin_estimate(pools, longdoc.nuggets, 0), estimator=estimator(dev_auc=0.545),
                      nugget_links=longdoc.nugget_links)
    assert out.value.equals(k_run(pools, longdoc.queries, RelevanceOrder()))
    assert out.metadata["fell_back"].value is True and "0.5450 < 0.6500" in out.metadata["estimator_gate"].value
    assert "blend" not in out.metadata


def test_a_trusted_estimator_is_followed_with_the_blend_chosen_on_dev(longdoc, pools, asset_inputs):
    estimate = perfect_estimate(pools, longdoc.nuggets, longdoc.nugget_links)
    out = k_selection(method("coverage_greedy_soft"), **asset_inputs, evaluation=EvaluationResource(),
                      coverage=estimate, estimator=estimator(dev_auc=0.9), nugget_links=longdoc.nugget_links)
    choice = blend_choice(pools, longdoc, estimate)
    assert out.metadata["fell_back"].value is False and out.metadata["blend_weight"].value == choice.weight
    assert json.dumps(out.metadata["blend"].value) == json.dumps(choice.evidence())
    assert out.value.equals(k_run(pools, longdoc.queries, Blend(CoverageGreedy(soft=True), choice.weight), estimate))


def test_the_estimator_check_warns_below_the_threshold_and_passes_above():
    low = coverage_estimator_dev_auc(coverage_estimator=estimator(dev_auc=0.545, dev_brier=0.08, dev_ece=0.3),
                                     evaluation=EvaluationResource())
    assert not low.passed and low.severity.value == "WARN"
    assert low.metadata["dev_auc"].value == 0.545 and low.metadata["threshold"].value == 0.65
    assert low.metadata["dev_brier"].value == 0.08 and low.metadata["dev_ece"].value == 0.3
    assert "too close to chance" in low.metadata["decision"].value and low.metadata["model_uri"].value == "models:/e/1"
    # calibration is recorded, not judged: a badly calibrated estimator above the AUC threshold passes
    high = coverage_estimator_dev_auc(coverage_estimator=estimator(dev_auc=0.7, dev_brier=0.6, dev_ece=0.9),
                                      evaluation=EvaluationResource(min_estimator_dev_auc=0.6))
    assert high.passed and high.metadata["dev_ece"].value == 0.9


def test_the_estimator_check_names_a_record_without_calibration():
    """A model record written before the estimator carried its dev calibration is named, with what to do,
    instead of being checked on part of its figures."""
    with pytest.raises(KeyError, match=r"covlab.longdoc.coverage_estimator v1 recorded no 'dev_brier' .*"
                                       r"re-materialize it"):
        coverage_estimator_dev_auc(coverage_estimator=estimator(dev_auc=0.7),
                                   evaluation=EvaluationResource(min_estimator_dev_auc=0.6))


def test_the_calibration_check_measures_the_tune_split_pairs_against_the_gold_links():
    """Known answer on four dev pairs (the test query's pair is ignored): labels 1, 0, 1, 0 for
    p 0.9, 0.1, 0.6, 0.6 -> ROC-AUC 0.875, Brier 0.135, ECE 0.1 (tests/test_metrics.py)."""
    queries = pd.DataFrame({"query_id": ["a", "b", "t"], "split": ["dev", "dev", "test"]})
    matrix = pd.DataFrame({"query_id": ["a", "a", "b", "b", "t"], "doc_id": ["d1", "d2", "d3", "d4", "d5"],
                           "subq_id": ["n1", "n1", "n2", "n2", "n3"], "probability": [0.9, 0.1, 0.6, 0.6, 0.0]})
    links = pd.DataFrame({"query_id": ["a", "b", "t"], "doc_id": ["d1", "d3", "d5"], "nugget_id": ["n1", "n2", "n3"],
                          "grade": 1})
    result = estimated_gold_coverage_calibration(estimated_gold_coverage_matrix=matrix, nugget_links=links,
                                                 queries=queries, evaluation=EvaluationResource())
    figures = {k: v.value for k, v in result.metadata.items()}
    assert figures["pairs"] == 4 and figures["covered_share"] == 0.5
    assert figures["roc_auc"] == pytest.approx(0.875) and figures["brier"] == pytest.approx(0.135)
    assert figures["ece"] == pytest.approx(0.1) and result.passed


def test_an_estimator_below_the_threshold_is_never_promoted_to_champion(tmp_path):
    tracking = TrackingResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                artifact_root=str(tmp_path / "artifacts"))
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    name = "covlab.longdoc.coverage_estimator"
    with tracking.training_run(name, params={}, tags={}) as training:
        ref = training.register(weights, metrics={"dev_auc": 0.545})
    model = RegisteredModel(ref.name, ref.version, ref.uri, ref.run_id, ref.source, str(weights), "hash")
    row = promote(tracking, model, 0.9, "alpha_ndcg@10", estimator_trusted(0.545, 0.65))
    assert not row["champion"] and row["action"] == "gated" and tracking.version_for_alias(name, "champion") is None
    assert row["decision"] == f"{ref.uri} is not promoted to champion: dev ROC-AUC 0.5450 < 0.6500: the estimate " \
                              "is too close to chance to select by"
    row = promote(tracking, model, 0.9, "alpha_ndcg@10", estimator_trusted(0.7, 0.65))
    assert row["champion"] and tracking.version_for_alias(name, "champion").version == ref.version
    assert row["dev_score"] == 0.9 and row["version"] == ref.version
