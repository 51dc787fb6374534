"""Selections, one asset per method of the coverage report (models/registry.py): for every evaluated query,
the k documents put into the context (query_id, rank, doc_id), a `Budget(k=k)` call of the method's selector.
All start from the same BM25 pool (METHODS.md §1), ranked as the method's entry says. A method on estimated
coverage is never meant to do worse than its fallback, the coverage bi-encoder order: below the estimator
gate it selects in that order, and above it the selector moves away from that order only as far as the tune
split rewards (the blend weight chosen on dev)."""

import pandas as pd
from dagster import AssetIn, AssetKey, MetadataValue, Output, asset

from covlab.assets.model_registry import source_replay
from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.models.coverage import queries_of, rank_pool_by
from covlab.models.registry import ESTIMATOR, Coverage, Method, PoolOrder, Report, methods
from covlab.models.runs import run_method
from covlab.models.selection import ESTIMATED, GOLD, ranked_pools
from covlab.models.schemas import SELECTIONS
from covlab.models.selectors import Budget
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.model_store import TrainedModel
from covlab.resources.tracking import TrackingResource


def k_selection(method: Method, bm25_pools: pd.DataFrame, scores: pd.DataFrame | None, queries: pd.DataFrame,
                evaluation: EvaluationResource, coverage: pd.DataFrame | None = None,
                estimator: TrainedModel | None = None, nugget_links: pd.DataFrame | None = None,
                tracking: TrackingResource | None = None) -> Output[pd.DataFrame]:
    """One method's k selection over the evaluated queries' pools (models/runs.run_method), ranked by the column of
    `scores` its entry's order names (models/registry.py PoolOrder; None for BM25 order); a method on
    estimated coverage goes through the estimator gate and the blend, and its metadata says what they decided
    (model_promotions records it on the estimator's version, for serving to replay)."""
    pool = bm25_pools.merge(queries_of(queries, evaluation.splits)[["query_id"]], on="query_id")
    if method.order is not PoolOrder.BM25:
        pool = rank_pool_by(pool, scores, method.order.column)
    columns = GOLD if method.coverage is Coverage.GOLD else ESTIMATED
    pools = ranked_pools(pool, queries, coverage, columns) if coverage is not None else ranked_pools(pool, queries)
    trust = None if estimator is None else evaluation.estimate_trust(estimator.figure("dev_auc"), nugget_links,
                                                                     source_replay(tracking, estimator, method.name))
    budget = Budget(k=evaluation.k)
    run = run_method(method, pools, [budget], evaluation.selector_settings(), trust=trust)
    selected = SELECTIONS.conform(run.table.drop(columns="budget"), source=f"selection_{method.name}")
    metadata = {"k": evaluation.k, "method": method.name, "ordered_by": method.order.name.lower(),
                "settings": MetadataValue.json(evaluation.model_dump())}
    if budget.limit in run.decisions:
        decision = run.decisions[budget.limit].metadata()
        metadata.update({key: MetadataValue.json(value) if key == "blend" else value
                         for key, value in decision.items()})
    return content_output(selected, metadata={"queries": int(selected["query_id"].nunique()), **metadata})


# Each k method's selection asset, by method name.
SELECTION_KEYS = {m.name: f"selection_{m.name}" for m in methods(Report.COVERAGE)}


def selection_asset(method: Method, code_version: str | None = None):
    """The asset of one method: BM25 order needs only the pool, a ranking also the scores of its order (input
    `scores`: relevance_scores or pool_scores, PoolOrder.asset), a covering method also its coverage matrix; one on
    estimated coverage also the estimator (its gate) and the gold nugget links (its blend weight is chosen on the
    tune split)."""
    common = dict(name=SELECTION_KEYS[method.name], partitions_def=DATASETS, group_name="selections",
                  code_version=code_version or ("3" if method.coverage.estimated else "1"),
                  kinds={"python", "parquet"}, owners=OWNERS, metadata=table_metadata(SELECTIONS),
                  description=f"Selection: {method.description}.")
    if method.order is PoolOrder.BM25 and method.coverage is Coverage.NONE:
        @asset(**common)
        def pooled(bm25_pools: pd.DataFrame, queries: pd.DataFrame,
                   evaluation: EvaluationResource) -> Output[pd.DataFrame]:
            return k_selection(method, bm25_pools, None, queries, evaluation)

        return pooled

    scores_in = {"scores": AssetIn(key=AssetKey(method.order.asset))}
    if method.coverage is Coverage.NONE:
        @asset(ins=scores_in, **common)
        def ranked(bm25_pools: pd.DataFrame, scores: pd.DataFrame, queries: pd.DataFrame,
                   evaluation: EvaluationResource) -> Output[pd.DataFrame]:
            return k_selection(method, bm25_pools, scores, queries, evaluation)

        return ranked

    coverage_in = {**scores_in, "coverage": AssetIn(key=AssetKey(method.coverage.asset))}
    if not method.coverage.estimated:
        @asset(ins=coverage_in, **common)
        def covering(bm25_pools: pd.DataFrame, scores: pd.DataFrame, queries: pd.DataFrame,
                     coverage: pd.DataFrame, evaluation: EvaluationResource) -> Output[pd.DataFrame]:
            return k_selection(method, bm25_pools, scores, queries, evaluation, coverage)

        return covering

    @asset(ins={**coverage_in, "estimator": AssetIn(key=AssetKey(ESTIMATOR.asset))}, **common)
    def blended(bm25_pools: pd.DataFrame, scores: pd.DataFrame, queries: pd.DataFrame,
                coverage: pd.DataFrame, estimator: TrainedModel, nugget_links: pd.DataFrame,
                evaluation: EvaluationResource, tracking: TrackingResource) -> Output[pd.DataFrame]:
        return k_selection(method, bm25_pools, scores, queries, evaluation, coverage, estimator, nugget_links,
                           tracking)

    return blended


SELECTION_ASSETS = [selection_asset(m) for m in methods(Report.COVERAGE)]
