"""Pinned: the k = 10 selections of every selection asset (assets/selections.py) on the demo dataset.

Deterministic stand-ins replace what the pipeline retrieves and estimates: a BM25 pool ranked by a seeded
score, relevance scores and coverage-trained pool scores drawn from seeds (the latter with many ties), and
estimated coverage matrices that mix the gold links with seeded noise at four strengths (informative, moderate,
weak, coin), read by an estimator that is trusted (dev ROC-AUC 0.9) or not (0.545). Every asset is invoked as the
pipeline invokes it, with the inputs its definition names; each case's run is pinned by the SHA-256 of its
rows, its metadata but the settings (SHA-256, plus fell_back and blend_weight in the clear; the blend's
dev evidence scores every candidate weight), and its mean alpha-nDCG@10 and StRecall@10 against the gold
nuggets, exactly. The rows and figures were computed before the selectors became typed objects, and held when
the k selections became Budget(k=10) calls of the one selector interface (models/selectors.py); only the
metadata's `method` entry changed then, from the selector's name to the registry method's. A refactor of the
selectors must not move them."""

import hashlib
import json

import numpy as np
import pandas as pd
import pytest

from covlab.assets.outputs import ROW_COUNT
from covlab.resources.source import RUNTIME_METADATA, SOURCE_METADATA
from covlab.assets.selections import SELECTION_ASSETS
from covlab.models.metrics import evaluate_run
from covlab.models.pools import rank_within_queries
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.model_store import RegisteredModel, TrainedModel
from covlab.resources.tracking import TrackingResource

TRUSTED, UNTRUSTED = 0.9, 0.545
# matrix -> the weight of the gold link in each pair's probability (the rest is seeded noise)
SIGNAL = {"informative": 0.8, "moderate": 0.6, "weak": 0.4, "coin": 0.0}
EVALUATIONS = {"default": EvaluationResource(), "tau0.5": EvaluationResource(tau=0.5),
               "weights0-0.5": EvaluationResource(blend_weights=[0.0, 0.5])}
# (estimator dev ROC-AUC, matrix, evaluation settings) of the assets on an estimated matrix
ESTIMATED_CASES = [(UNTRUSTED, "informative", "default"), (TRUSTED, "informative", "default"),
                   (TRUSTED, "moderate", "default"), (TRUSTED, "weak", "default"), (TRUSTED, "coin", "default"),
                   (TRUSTED, "weak", "tau0.5"), (TRUSTED, "moderate", "weights0-0.5")]

# case -> (rows SHA-256[:16], metadata SHA-256[:16], fell_back, blend_weight, alpha-nDCG@10, StRecall@10)
EXPECTED = {
    "selection_bm25/default":
        ("05582be0aec77a6b", "ac4cf9a4061a40ed", None, None, 0.696377126846773, 0.887962962962963),
    "selection_relevance/default":
        ("58d7f56c38771058", "c38978fd77ace382", None, None, 0.752007500346895, 0.9069444444444444),
    "selection_relevance_coverage_trained/default":
        ("696e859dca389d05", "9258a9c7d0751e0a", None, None, 0.748180398572468, 0.8868386243386244),
    "selection_coverage_greedy/auc0.545/informative/default":
        ("696e859dca389d05", "825bd2247a3107f6", True, None, 0.748180398572468, 0.8868386243386244),
    "selection_coverage_greedy/auc0.9/informative/default":
        ("27a6c045a1bf8edf", "6dd4083358fdf35d", False, 1.0, 0.8969693846617726, 1.0),
    "selection_coverage_greedy/auc0.9/moderate/default":
        ("879ee291c54520b4", "8b8259c6e741ca14", False, 0.25, 0.7619332370153559, 0.8868386243386244),
    "selection_coverage_greedy/auc0.9/weak/default":
        ("ececb42e3ff10d4f", "510b84b4305a2166", False, 0.5, 0.766367076005924, 0.8868386243386244),
    "selection_coverage_greedy/auc0.9/coin/default":
        ("696e859dca389d05", "32744c584d36a35f", False, 0.0, 0.748180398572468, 0.8868386243386244),
    "selection_coverage_greedy/auc0.9/weak/tau0.5":
        ("340fe84bdad8c25e", "b51bfb6fb8d001a4", False, 0.75, 0.8009756080326841, 0.8868386243386244),
    "selection_coverage_greedy/auc0.9/moderate/weights0-0.5":
        ("696e859dca389d05", "2b2606ce66e2676f", False, 0.0, 0.748180398572468, 0.8868386243386244),
    "selection_coverage_greedy_soft/auc0.545/informative/default":
        ("696e859dca389d05", "0e8a8bda19e92ac2", True, None, 0.748180398572468, 0.8868386243386244),
    "selection_coverage_greedy_soft/auc0.9/informative/default":
        ("5c4346ea7960d290", "cf86cffd42573267", False, 1.0, 0.9788439024058304, 1.0),
    "selection_coverage_greedy_soft/auc0.9/moderate/default":
        ("f56f30d004dca6bf", "204206241604e27e", False, 1.0, 0.9580570790644706, 1.0),
    "selection_coverage_greedy_soft/auc0.9/weak/default":
        ("8628f26415ac0a6b", "c1291c0221208729", False, 1.0, 0.9002896537032004, 0.9629629629629629),
    "selection_coverage_greedy_soft/auc0.9/coin/default":
        ("277254f6ffb2bf15", "4fc32e26119565a5", False, 0.75, 0.756046507891111, 0.8868386243386244),
    "selection_coverage_greedy_soft/auc0.9/weak/tau0.5":
        ("8628f26415ac0a6b", "c1291c0221208729", False, 1.0, 0.9002896537032004, 0.9629629629629629),
    "selection_coverage_greedy_soft/auc0.9/moderate/weights0-0.5":
        ("50d554d94ee8bd7b", "dce48d7eb35f7170", False, 0.5, 0.7883958987314709, 0.8868386243386244),
    "selection_gold_nugget_bound/auc0.545/informative/default":
        ("696e859dca389d05", "d76ced26010d7fc8", True, None, 0.748180398572468, 0.8868386243386244),
    "selection_gold_nugget_bound/auc0.9/informative/default":
        ("27a6c045a1bf8edf", "f8ecbfa245bbf49f", False, 1.0, 0.8969693846617726, 1.0),
    "selection_gold_nugget_bound/auc0.9/moderate/default":
        ("696e859dca389d05", "97c9c622b8e9b893", False, 0.0, 0.748180398572468, 0.8868386243386244),
    "selection_gold_nugget_bound/auc0.9/weak/default":
        ("696e859dca389d05", "5f95ca925851b613", False, 0.0, 0.748180398572468, 0.8868386243386244),
    "selection_gold_nugget_bound/auc0.9/coin/default":
        ("696e859dca389d05", "dd0dd87da3127abf", False, 0.0, 0.748180398572468, 0.8868386243386244),
    "selection_gold_nugget_bound/auc0.9/weak/tau0.5":
        ("696e859dca389d05", "76d9e20ea9a68e4d", False, 0.0, 0.748180398572468, 0.8868386243386244),
    "selection_gold_nugget_bound/auc0.9/moderate/weights0-0.5":
        ("696e859dca389d05", "070da44893b54350", False, 0.0, 0.748180398572468, 0.8868386243386244),
    "selection_gold_nugget_bound_soft/auc0.545/informative/default":
        ("696e859dca389d05", "132ccef81c603980", True, None, 0.748180398572468, 0.8868386243386244),
    "selection_gold_nugget_bound_soft/auc0.9/informative/default":
        ("5333841e8310eb0c", "89f341ffe51a7600", False, 1.0, 0.9963199257406871, 1.0),
    "selection_gold_nugget_bound_soft/auc0.9/moderate/default":
        ("980ff634c62b598e", "2c933d1a9003df62", False, 1.0, 0.9740815874947083, 1.0),
    "selection_gold_nugget_bound_soft/auc0.9/weak/default":
        ("cfeb00788b21bfe3", "43f17095792d8841", False, 1.0, 0.899022556552593, 0.9398148148148149),
    "selection_gold_nugget_bound_soft/auc0.9/coin/default":
        ("696e859dca389d05", "65a45b986f027ba8", False, 0.0, 0.748180398572468, 0.8868386243386244),
    "selection_gold_nugget_bound_soft/auc0.9/weak/tau0.5":
        ("cfeb00788b21bfe3", "43f17095792d8841", False, 1.0, 0.899022556552593, 0.9398148148148149),
    "selection_gold_nugget_bound_soft/auc0.9/moderate/weights0-0.5":
        ("dbc511d02221d5dc", "9f4d422af779e11f", False, 0.5, 0.7850346742636326, 0.8868386243386244),
    "selection_oracle_greedy/default":
        ("27a6c045a1bf8edf", "e48afaf18b1a0118", None, None, 0.8969693846617726, 1.0),
}

# asset -> its inputs (input name -> asset) and code version, as the selection assets are defined
EXPECTED_GRAPH = {
    "selection_bm25": (
        {"bm25_pools": "bm25_pools", "queries": "queries"},
        "1"),
    "selection_relevance": (
        {"bm25_pools": "bm25_pools", "queries": "queries", "scores": "relevance_scores"},
        "1"),
    "selection_relevance_coverage_trained": (
        {"bm25_pools": "bm25_pools", "queries": "queries", "scores": "pool_scores"},
        "1"),
    "selection_coverage_greedy": (
        {"bm25_pools": "bm25_pools", "coverage": "estimated_coverage_matrix",
         "estimator": "coverage_estimator", "nugget_links": "nugget_links", "queries": "queries",
         "scores": "pool_scores"},
        "3"),
    "selection_coverage_greedy_soft": (
        {"bm25_pools": "bm25_pools", "coverage": "estimated_coverage_matrix",
         "estimator": "coverage_estimator", "nugget_links": "nugget_links", "queries": "queries",
         "scores": "pool_scores"},
        "3"),
    "selection_gold_nugget_bound": (
        {"bm25_pools": "bm25_pools", "coverage": "estimated_gold_coverage_matrix",
         "estimator": "coverage_estimator", "nugget_links": "nugget_links", "queries": "queries",
         "scores": "pool_scores"},
        "3"),
    "selection_gold_nugget_bound_soft": (
        {"bm25_pools": "bm25_pools", "coverage": "estimated_gold_coverage_matrix",
         "estimator": "coverage_estimator", "nugget_links": "nugget_links", "queries": "queries",
         "scores": "pool_scores"},
        "3"),
    "selection_oracle_greedy": (
        {"bm25_pools": "bm25_pools", "coverage": "nugget_links", "queries": "queries",
         "scores": "pool_scores"},
        "1"),
}


@pytest.fixture(scope="module")
def pinned_demo(demo_dataset):
    """The demo as the pins were recorded on it: its first 14 queries (8 train, 3 dev, 3 test), which the generator
    draws first and unchanged whatever follows them."""
    first = [f"demo-q{i:02d}" for i in range(14)]
    return {name: demo_dataset.table(name).pipe(lambda t: t[t["query_id"].isin(first)].reset_index(drop=True))
            for name in ("queries", "candidates", "nuggets", "nugget_links", "qrels")}


@pytest.fixture(scope="module")
def inputs(pinned_demo):
    """What the selection assets read, deterministic: every demo query's candidates as its BM25 pool."""
    candidates = pinned_demo["candidates"].sort_values(["query_id", "doc_id"], ignore_index=True)
    bm25_pools = rank_within_queries(candidates.assign(score=np.random.default_rng(10).random(len(candidates))))
    pairs = bm25_pools[["query_id", "doc_id"]]
    return {"bm25_pools": bm25_pools, "queries": pinned_demo["queries"],
            "relevance_scores": pairs.assign(relevance=np.random.default_rng(11).random(len(bm25_pools))),
            "pool_scores": pairs.assign(
                coverage_trained=np.random.default_rng(12).integers(0, 6, len(bm25_pools)).astype(float)),
            "nugget_links": pinned_demo["nugget_links"]}


def estimated_matrix(pools: pd.DataFrame, nuggets: pd.DataFrame, links: pd.DataFrame, signal: float, seed: int,
                     subquestion_suffix: str) -> pd.DataFrame:
    """A COVERAGE_MATRIX over every (pool document, nugget) pair: p = signal * [linked] + (1 - signal) * noise,
    the subquestions being the nuggets renamed by `subquestion_suffix`."""
    pairs = pools[["query_id", "doc_id"]].merge(nuggets[["query_id", "nugget_id"]], on="query_id")
    pairs = pairs.sort_values(["query_id", "doc_id", "nugget_id"], ignore_index=True)
    linked = pairs.merge(links[["query_id", "doc_id", "nugget_id"]], how="left", indicator=True)["_merge"] == "both"
    noise = np.random.default_rng(seed).random(len(pairs))
    return pd.DataFrame({"query_id": pairs["query_id"], "doc_id": pairs["doc_id"],
                         "subq_id": pairs["nugget_id"] + subquestion_suffix,
                         "probability": signal * linked.to_numpy(float) + (1 - signal) * noise})


@pytest.fixture(scope="module")
def matrices(pinned_demo, inputs):
    """The two estimated matrices the assets read, per noise strength (seeded apart)."""
    nuggets, links = pinned_demo["nuggets"], pinned_demo["nugget_links"]
    return {(asset, strength): estimated_matrix(inputs["bm25_pools"], nuggets, links, signal, seed, suffix)
            for (asset, suffix), base in ((("estimated_coverage_matrix", "-s"), 20),
                                          (("estimated_gold_coverage_matrix", ""), 40))
            for seed, (strength, signal) in enumerate(SIGNAL.items(), start=base)}


def cases():
    for assets_def in SELECTION_ASSETS:
        name = assets_def.key.to_user_string()
        if "estimator" in assets_def.keys_by_input_name:
            for dev_auc, strength, settings in ESTIMATED_CASES:
                yield f"{name}/auc{dev_auc}/{strength}/{settings}", assets_def, dev_auc, strength, settings
        else:
            yield f"{name}/default", assets_def, None, None, "default"


def run_case(assets_def, dev_auc, strength, settings, inputs, matrices):
    # the registry is never opened: an estimator trained on this dataset replays no other dataset's decisions
    available = {**inputs, "evaluation": EVALUATIONS[settings],
                 "tracking": TrackingResource(tracking_uri="sqlite:///never-opened/mlflow.db")}
    if dev_auc is not None:  # what the selections read of the estimator: its dev ROC-AUC (the gate)
        model = RegisteredModel("covlab.demo.coverage_estimator", 1, "models:/covlab.demo.coverage_estimator/1", "run",
                                "source", "path", "hash")
        available["estimator"] = TrainedModel(model, {"dev_auc": dev_auc})
    scores_key = assets_def.keys_by_input_name.get("scores")
    if scores_key is not None:  # the scores of the method's pool order: relevance_scores or pool_scores
        available["scores"] = inputs[scores_key.to_user_string()]
    coverage_key = assets_def.keys_by_input_name.get("coverage")
    if coverage_key is not None:
        coverage = coverage_key.to_user_string()
        available["coverage"] = inputs[coverage] if coverage == "nugget_links" else matrices[(coverage, strength)]
    resources = assets_def.required_resource_keys & {"evaluation", "tracking"}
    return assets_def(**{name: available[name] for name in [*assets_def.keys_by_input_name, *resources]})


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pinned(output, links: pd.DataFrame, qrels: pd.DataFrame) -> tuple:
    run = output.value
    rows = "\n".join(f"{q}\t{r}\t{d}" for q, r, d in run[["query_id", "rank", "doc_id"]].itertuples(index=False))
    metadata = {key: value.value for key, value in output.metadata.items()
                if key not in ("settings", SOURCE_METADATA, RUNTIME_METADATA,  # the checkout and machine vary
                               ROW_COUNT)}  # pinned with the rows themselves
    measured = evaluate_run(run, links, qrels, k=10, alpha=0.5).groupby("metric")["value"].mean()
    return (digest(rows), digest(json.dumps(metadata, sort_keys=True)), metadata.get("fell_back"),
            metadata.get("blend_weight"), float(measured["alpha_ndcg@10"]), float(measured["strecall@10"]))


CASES = list(cases())


@pytest.mark.parametrize("case, assets_def, dev_auc, strength, settings", CASES, ids=[c[0] for c in CASES])
def test_selection_is_pinned(case, assets_def, dev_auc, strength, settings, pinned_demo, inputs, matrices):
    output = run_case(assets_def, dev_auc, strength, settings, inputs, matrices)
    assert output.value["query_id"].nunique() == 6 and output.value.groupby("query_id").size().eq(10).all()
    assert output.metadata[ROW_COUNT].value == len(output.value) == 60
    assert pinned(output, pinned_demo["nugget_links"], pinned_demo["qrels"]) == EXPECTED[case]


def test_the_selection_assets_keep_their_inputs_and_code_versions():
    graph = {a.key.to_user_string(): ({k: v.to_user_string() for k, v in sorted(a.keys_by_input_name.items())},
                                      a.code_versions_by_key[a.key]) for a in SELECTION_ASSETS}
    assert graph == EXPECTED_GRAPH
