"""The estimator's scoring settings live in one resource (resources/scoring.py `EstimatorScoring`): every asset
that scores with the estimator reads it, so one setting changes every estimated matrix alike, and each matrix
scores the pools of the evaluated splits' queries only."""

import pandas as pd
import pytest
from dagster import build_asset_context

from covlab.assets.coverage import estimated_coverage_matrix, estimated_gold_coverage_matrix
from covlab.assets.mcompass import mcompass_pool_coverage_matrix
from covlab.models.schemas import COVERAGE_MATRIX
from covlab.models.versions import directory_hash
from covlab.resources.device import DeviceResource
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.model_store import RegisteredModel, TrainedModel
from covlab.resources.scoring import EstimatorScoring

QUERIES = pd.DataFrame({"query_id": ["qa", "qb", "qc"], "text": ["harbour fleet", "lighthouse", "school buses"],
                        "split": ["train", "dev", "test"], "topic": ["qa", "qb", "qc"]})
DOCS = [f"d{i}" for i in range(1, 7)]
CORPUS = pd.DataFrame({"doc_id": DOCS, "title": "", "source_unit": DOCS, "text": [
    "The council sets fishing quotas every spring.", "Boats report their catch at the pier office.",
    "The new lighthouse is too bright at night.", "Tourists photograph the lighthouse at sunset.",
    "The town pays for two school buses.", "Parents drive when the buses are late."]})
# every query's pool holds all six documents; two subquestions (and two gold nuggets) per query
POOLS = pd.DataFrame([(q, d, rank, 0.0) for q in QUERIES["query_id"] for rank, d in enumerate(DOCS, 1)],
                     columns=["query_id", "doc_id", "rank", "score"])
SUBQUESTIONS = pd.DataFrame([(q, f"{q}/s{i}", f"{text} facet {i}") for q, text in zip(QUERIES["query_id"],
                                                                                       QUERIES["text"])
                             for i in range(2)], columns=["query_id", "subq_id", "text"])
NUGGETS = SUBQUESTIONS.rename(columns={"subq_id": "nugget_id"}).assign(nugget_id=lambda f: f["nugget_id"] + "n")
EVALUATED = {"qb", "qc"}  # EvaluationResource's default splits: dev and test
PAIRS_PER_QUERY = len(DOCS) * 2


@pytest.fixture(scope="module")
def estimator(tiny_model) -> TrainedModel:
    """The tiny BERT as a registered estimator (a fresh one-logit head: its probabilities mean nothing here)."""
    return TrainedModel(RegisteredModel("covlab.test.coverage_estimator", 1, "models:/e/1", "run", "source",
                                        tiny_model, directory_hash(tiny_model)), {"dev_auc": 0.5})


def _matrices(estimator: TrainedModel, scoring: EstimatorScoring) -> dict:
    """Each estimated-matrix asset's Output under `scoring`, from the same pools and subquestions."""
    from tiny_bert import one_thread

    common = dict(queries=QUERIES, corpus=CORPUS, coverage_estimator=estimator, evaluation=EvaluationResource(),
                  device=DeviceResource(device="cpu"), tracking=None, artifacts=None, estimator_scoring=scoring)
    with one_thread():
        return {
            "estimated_coverage_matrix": estimated_coverage_matrix(
                build_asset_context(), bm25_pools=POOLS, subquestions=SUBQUESTIONS, **common),
            "estimated_gold_coverage_matrix": estimated_gold_coverage_matrix(
                build_asset_context(), bm25_pools=POOLS, nuggets=NUGGETS, **common),
            "mcompass_pool_coverage_matrix": mcompass_pool_coverage_matrix(
                build_asset_context(partition_key="t"), mcompass_pools=POOLS, subquestions=SUBQUESTIONS,
                estimated_coverage_matrix=COVERAGE_MATRIX.conform(POOLS.iloc[:0].assign(subq_id="", probability=0.0)),
                **common)}


def test_the_mcompass_matrix_scores_only_the_pairs_the_bm25_matrix_did_not(estimator):
    """A (subquestion, document) pair that estimated_coverage_matrix scored with the same estimator version on the
    same runtime is taken from it, not scored again; the others are scored; on another runtime nothing is taken."""
    from dagster import AssetKey, AssetMaterialization, DagsterInstance

    from tiny_bert import one_thread

    common = dict(subquestions=SUBQUESTIONS, queries=QUERIES, corpus=CORPUS, coverage_estimator=estimator,
                  evaluation=EvaluationResource(), device=DeviceResource(device="cpu"), tracking=None,
                  artifacts=None, estimator_scoring=EstimatorScoring(batch_size=5))
    bm25_pools = POOLS[POOLS["doc_id"].isin(DOCS[:4])]  # the MCompass pools hold two documents more
    with one_thread(), DagsterInstance.ephemeral() as instance:
        bm25 = estimated_coverage_matrix(build_asset_context(), bm25_pools=bm25_pools, **common)
        for runtime, reused in (("torch", len(EVALUATED) * 4 * 2), ("onnx-int8", 0)):
            instance.report_runless_asset_event(AssetMaterialization(
                AssetKey("estimated_coverage_matrix"), partition="t",
                metadata={**bm25.metadata, "config": {**bm25.metadata["config"].value, "runtime": runtime}}))
            out = mcompass_pool_coverage_matrix(build_asset_context(instance=instance, partition_key="t"),
                                                mcompass_pools=POOLS, estimated_coverage_matrix=bm25.value, **common)
            metadata = {key: value.value for key, value in out.metadata.items()}
            assert (metadata["pairs_reused"], metadata["pairs_scored"]) == (reused, len(EVALUATED) * 6 * 2 - reused)
            shared = out.value.merge(bm25.value, on=["query_id", "doc_id", "subq_id"])
            assert len(shared) == len(bm25.value)
            # taken: the stored values themselves (the tiny estimator draws a fresh head at each load, so a pair
            # scored again would differ)
            assert shared["probability_x"].equals(shared["probability_y"]) == bool(reused)


def test_known_pairs_answer_what_they_hold_and_score_the_rest_in_one_call():
    from covlab.models.coverage import KnownPairs

    matrix = pd.DataFrame({"query_id": "q", "doc_id": ["d1", "d2", "d3"], "subq_id": "q/s0",
                           "probability": [0.25, 0.0, 0.75]})  # d2 was pruned there: not known
    known = KnownPairs(matrix, SUBQUESTIONS.assign(query_id="q", subq_id="q/s0").iloc[:1],
                       {"d1": "one", "d2": "two", "d3": "three"})
    asked = []
    score = known.reusing(lambda pairs: asked.append(pairs) or [0.5] * len(pairs))
    facet = SUBQUESTIONS["text"].iloc[0]
    assert score([(facet, "three"), (facet, "two"), ("other", "one"), (facet, "one")]).tolist() == [
        0.75, 0.5, 0.5, 0.25]
    assert asked == [[(facet, "two"), ("other", "one")]] and known.reused == 2


def test_one_setting_prunes_every_estimated_matrix_alike(estimator, tiny_model):
    pairs = len(EVALUATED) * PAIRS_PER_QUERY
    for prune_top_m, scored in ((None, pairs), (2, len(EVALUATED) * 2 * 2), (4, len(EVALUATED) * 2 * 4)):
        scoring = EstimatorScoring(batch_size=5, prune_top_m=prune_top_m, first_stage=tiny_model,
                                   first_stage_max_length=32)
        for name, out in _matrices(estimator, scoring).items():
            metadata = {key: value.value for key, value in out.metadata.items()}
            assert (metadata["pairs"], metadata["pairs_scored"], metadata["pairs_pruned"]) == (
                pairs, scored, pairs - scored), (name, prune_top_m)
            assert metadata["config"] == scoring.model_dump(), name
            assert int((out.value["probability"] > 0).sum()) == scored, name  # a sigmoid is never exactly 0


def test_each_matrix_scores_the_evaluated_queries_only(estimator):
    """The pools hold a train query too (as mcompass_pools may, from a run over every query): no pair of it is
    scored, in the MCompass pools' matrix as in the BM25 pools' one."""
    for name, out in _matrices(estimator, EstimatorScoring()).items():
        assert set(out.value["query_id"]) == EVALUATED, name
        assert out.value.groupby("query_id").size().eq(PAIRS_PER_QUERY).all(), name
        assert out.metadata["queries"].value == len(EVALUATED) and out.metadata["splits"].value == ["dev", "test"]


def test_every_step_that_scores_with_the_estimator_reads_the_one_resource():
    from covlab.orchestration.definitions import ASSETS, defs

    readers = {key.to_user_string() for assets_def in ASSETS if hasattr(assets_def, "required_resource_keys")
               and "estimator_scoring" in assets_def.required_resource_keys for key in assets_def.keys}
    assert readers == {"estimated_coverage_matrix", "estimated_gold_coverage_matrix", "mcompass_pool_coverage_matrix",
                       "mcompass_teacher"}
    assert isinstance(defs.resources["estimator_scoring"], EstimatorScoring)


@pytest.mark.parametrize("field, value, message", [("prune_top_m", 0, "prune_top_m must be >= 1"),
                                                   ("batch_size", 0, "batch_size"),
                                                   ("first_stage_max_length", -1, "first_stage_max_length")])
def test_a_bad_setting_is_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        EstimatorScoring(**{field: value})
