"""Selections, one asset per method: for every evaluated query, the k documents put into the context
(query_id, rank, doc_id). All start from the same BM25 pool (METHODS.md §1)."""

from dataclasses import dataclass

import pandas as pd
from dagster import AssetIn, AssetKey, MetadataValue, Output, asset

from covlab.assets.partitions import DATASETS
from covlab.models.coverage import queries_of, rank_pool_by
from covlab.models.selection import select_per_query
from covlab.resources.evaluation import EvaluationResource


@dataclass(frozen=True)
class SelectionMethod:
    name: str
    description: str
    ranking: str | None  # POOL_SCORES column that orders the pool (ties and fill); None: BM25 order
    method: str = "relevance"  # select_per_query method
    coverage: str | None = None  # asset holding the coverage matrix
    gold: bool = False  # the coverage asset is nugget_links (grade), not an estimated matrix (probability)


METHODS = [
    SelectionMethod("bm25", "the BM25 pool's first k", None),
    SelectionMethod("relevance", "relevance bi-encoder order (Table 1: relevance)", "relevance"),
    SelectionMethod("relevance_coverage_trained", "coverage-trained bi-encoder order (+ coverage training)",
                    "coverage_trained"),
    SelectionMethod("coverage_greedy", "greedy max-marginal coverage on the estimated matrix at tau, ties and "
                    "fill by the coverage bi-encoder (+ estimator and greedy)", "coverage_trained", "greedy",
                    "estimated_coverage_matrix"),
    SelectionMethod("coverage_greedy_soft", "[chosen extension] soft greedy on the estimated probabilities",
                    "coverage_trained", "soft_greedy", "estimated_coverage_matrix"),
    SelectionMethod("gold_nugget_bound", "the pipeline with the gold nuggets as subquestions (gold nuggets)",
                    "coverage_trained", "greedy", "estimated_gold_coverage_matrix"),
    SelectionMethod("gold_nugget_bound_soft", "[chosen extension] soft greedy on the estimator's probabilities "
                    "for the gold nuggets", "coverage_trained", "soft_greedy", "estimated_gold_coverage_matrix"),
    SelectionMethod("oracle_greedy", "greedy on the gold coverage matrix (oracle greedy)", "coverage_trained",
                    "greedy", "nugget_links", gold=True),
]


def _ranked_pool(bm25_pools: pd.DataFrame, pool_scores: pd.DataFrame | None, queries: pd.DataFrame,
                 evaluation: EvaluationResource, ranking: str | None) -> pd.DataFrame:
    pool = bm25_pools.merge(queries_of(queries, evaluation.splits)[["query_id"]], on="query_id")
    return pool if ranking is None else rank_pool_by(pool, pool_scores, ranking)


def _selection(spec: SelectionMethod, bm25_pools: pd.DataFrame, pool_scores: pd.DataFrame | None,
               queries: pd.DataFrame, evaluation: EvaluationResource,
               coverage: pd.DataFrame | None) -> Output[pd.DataFrame]:
    pool = _ranked_pool(bm25_pools, pool_scores, queries, evaluation, spec.ranking)
    columns = ("nugget_id", "grade", 1.0) if spec.gold else ("subq_id", "probability", evaluation.tau)
    selected = select_per_query(pool, spec.method, evaluation.k, coverage, nugget_column=columns[0],
                                value_column=columns[1], threshold=columns[2])
    return Output(selected, metadata={"queries": int(selected["query_id"].nunique()), "k": evaluation.k,
                                      "method": spec.method, "ordered_by": spec.ranking or "bm25",
                                      "settings": MetadataValue.json(evaluation.model_dump())})


def selection_asset(spec: SelectionMethod, code_version: str = "1"):
    """The asset of one method: BM25 order needs only the pool, a ranking also the pool scores, and a
    covering method also its coverage matrix."""
    common = dict(name=f"selection_{spec.name}", partitions_def=DATASETS, group_name="selections",
                  code_version=code_version, description=f"Selection: {spec.description}.")
    if spec.ranking is None and spec.coverage is None:
        @asset(**common)
        def pooled(bm25_pools: pd.DataFrame, queries: pd.DataFrame,
                   evaluation: EvaluationResource) -> Output[pd.DataFrame]:
            return _selection(spec, bm25_pools, None, queries, evaluation, None)

        return pooled

    if spec.coverage is None:
        @asset(**common)
        def ranked(bm25_pools: pd.DataFrame, pool_scores: pd.DataFrame, queries: pd.DataFrame,
                   evaluation: EvaluationResource) -> Output[pd.DataFrame]:
            return _selection(spec, bm25_pools, pool_scores, queries, evaluation, None)

        return ranked

    @asset(ins={"coverage": AssetIn(key=AssetKey(spec.coverage))}, **common)
    def covering(bm25_pools: pd.DataFrame, pool_scores: pd.DataFrame, queries: pd.DataFrame,
                 coverage: pd.DataFrame, evaluation: EvaluationResource) -> Output[pd.DataFrame]:
        return _selection(spec, bm25_pools, pool_scores, queries, evaluation, coverage)

    return covering


SELECTION_ASSETS = [selection_asset(spec) for spec in METHODS]
