"""Selections, one asset per method: for every evaluated query, the k documents put into the context
(query_id, rank, doc_id). All start from the same BM25 pool (METHODS.md §1). A method on estimated
coverage is never meant to do worse than its fallback, the coverage bi-encoder order: below the estimator
gate it selects in that order, and above it hard and soft greedy move away from that order only as far as
the tune split rewards (the blend weight chosen on dev)."""

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
from dagster import AssetIn, AssetKey, MetadataValue, Output, asset

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.models.coverage import queries_of, rank_pool_by
from covlab.models.selection import (ESTIMATED, GOLD, SELECTIONS, CoverageColumns, EstimateTrust, GreedyCoverage,
                                     KSelector, RelevanceSelection, SoftGreedyCoverage, select_method)
from covlab.resources.evaluation import EvaluationResource


@dataclass(frozen=True)
class SelectionMethod:
    name: str
    description: str
    ranking: str | None  # POOL_SCORES column that orders the pool (ties and fill); None: BM25 order
    # the selector under the evaluation settings (hard greedy on an estimated matrix counts p >= their tau)
    selector: Callable[[EvaluationResource], KSelector] = lambda evaluation: RelevanceSelection()
    coverage: str | None = None  # asset holding the coverage table
    columns: CoverageColumns = ESTIMATED  # that table's columns: an estimated matrix, or GOLD for nugget_links

    @property
    def estimated(self) -> bool:
        """Whether the method reads an estimated coverage matrix (and so goes through the estimator gate)."""
        return self.coverage is not None and self.columns == ESTIMATED


METHODS = [
    SelectionMethod("bm25", "the BM25 pool's first k", None),
    SelectionMethod("relevance", "relevance bi-encoder order (Table 1: relevance)", "relevance"),
    SelectionMethod("relevance_coverage_trained", "coverage-trained bi-encoder order (+ coverage training)",
                    "coverage_trained"),
    SelectionMethod("coverage_greedy", "greedy max-marginal coverage on the estimated matrix at tau, ties and "
                    "fill by the coverage bi-encoder, blended with that order by the weight chosen on the tune "
                    "split (+ estimator and greedy)", "coverage_trained",
                    lambda evaluation: GreedyCoverage(threshold=evaluation.tau), "estimated_coverage_matrix"),
    SelectionMethod("coverage_greedy_soft", "[chosen extension] soft greedy on the estimated probabilities, blended "
                    "with the coverage bi-encoder order by the weight chosen on the tune split",
                    "coverage_trained", lambda evaluation: SoftGreedyCoverage(), "estimated_coverage_matrix"),
    SelectionMethod("gold_nugget_bound", "the pipeline with the gold nuggets as subquestions, blended as "
                    "coverage_greedy (gold nuggets)", "coverage_trained",
                    lambda evaluation: GreedyCoverage(threshold=evaluation.tau), "estimated_gold_coverage_matrix"),
    SelectionMethod("gold_nugget_bound_soft", "[chosen extension] soft greedy on the estimator's probabilities "
                    "for the gold nuggets, blended as coverage_greedy_soft", "coverage_trained",
                    lambda evaluation: SoftGreedyCoverage(), "estimated_gold_coverage_matrix"),
    SelectionMethod("oracle_greedy", "greedy on the gold coverage matrix (oracle greedy)", "coverage_trained",
                    lambda evaluation: GreedyCoverage(threshold=1.0), "nugget_links", GOLD),  # a link of grade >= 1
]


def estimate_trust(evaluation: EvaluationResource, coverage_estimator: dict, queries: pd.DataFrame,
                   nugget_links: pd.DataFrame) -> EstimateTrust:
    """How far a selection on the estimator's matrix may follow it, under the evaluation settings: the
    estimator's dev ROC-AUC against the gate, the blend weight tuned on the tune split's gold."""
    return EstimateTrust(dev_auc=coverage_estimator["dev_auc"], min_dev_auc=evaluation.min_estimator_dev_auc,
                         queries=queries, tune_split=evaluation.tune_split, nugget_links=nugget_links,
                         weights=evaluation.blend_weights, alpha=evaluation.alpha)


def _ranked_pool(bm25_pools: pd.DataFrame, pool_scores: pd.DataFrame | None, queries: pd.DataFrame,
                 evaluation: EvaluationResource, ranking: str | None) -> pd.DataFrame:
    pool = bm25_pools.merge(queries_of(queries, evaluation.splits)[["query_id"]], on="query_id")
    return pool if ranking is None else rank_pool_by(pool, pool_scores, ranking)


def _selection(spec: SelectionMethod, bm25_pools: pd.DataFrame, pool_scores: pd.DataFrame | None,
               queries: pd.DataFrame, evaluation: EvaluationResource, coverage: pd.DataFrame | None,
               coverage_estimator: dict | None = None, nugget_links: pd.DataFrame | None = None
               ) -> Output[pd.DataFrame]:
    """One method's run; a method on estimated coverage goes through the estimator gate and the blend
    (models/selection.py: select_method)."""
    pool = _ranked_pool(bm25_pools, pool_scores, queries, evaluation, spec.ranking)
    selector = spec.selector(evaluation)
    metadata = {"k": evaluation.k, "method": selector.name, "ordered_by": spec.ranking or "bm25",
                "settings": MetadataValue.json(evaluation.model_dump())}
    trust = (None if coverage_estimator is None
             else estimate_trust(evaluation, coverage_estimator, queries, nugget_links))
    selected, decision = select_method(pool, selector, evaluation.k, coverage, spec.columns, trust)
    metadata.update(decision)
    if "blend" in decision:
        metadata["blend"] = MetadataValue.json(decision["blend"])
    return content_output(selected, metadata={"queries": int(selected["query_id"].nunique()), **metadata})


def selection_asset(spec: SelectionMethod, code_version: str | None = None):
    """The asset of one method: BM25 order needs only the pool, a ranking also the pool scores, a covering
    method also its coverage matrix; one on estimated coverage also the estimator (its gate) and the gold
    nugget links (its blend weight is chosen on the tune split)."""
    common = dict(name=f"selection_{spec.name}", partitions_def=DATASETS, group_name="selections",
                  code_version=code_version or ("3" if spec.estimated else "1"), kinds={"python", "parquet"},
                  owners=OWNERS, metadata=table_metadata(SELECTIONS),
                  description=f"Selection: {spec.description}.")
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

    coverage_in = {"coverage": AssetIn(key=AssetKey(spec.coverage))}
    if not spec.estimated:
        @asset(ins=coverage_in, **common)
        def covering(bm25_pools: pd.DataFrame, pool_scores: pd.DataFrame, queries: pd.DataFrame,
                     coverage: pd.DataFrame, evaluation: EvaluationResource) -> Output[pd.DataFrame]:
            return _selection(spec, bm25_pools, pool_scores, queries, evaluation, coverage)

        return covering

    @asset(ins=coverage_in, **common)
    def blended(bm25_pools: pd.DataFrame, pool_scores: pd.DataFrame, queries: pd.DataFrame,
                coverage: pd.DataFrame, coverage_estimator: dict, nugget_links: pd.DataFrame,
                evaluation: EvaluationResource) -> Output[pd.DataFrame]:
        return _selection(spec, bm25_pools, pool_scores, queries, evaluation, coverage, coverage_estimator,
                          nugget_links)

    return blended


SELECTION_ASSETS = [selection_asset(spec) for spec in METHODS]
