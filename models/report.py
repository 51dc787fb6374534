"""The coverage report (METHODS.md §1, Table 1 of the paper): per-method, per-query metrics of every
selection, the Table 1 layout and paired comparisons against the relevance baseline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import pandas as pd

from covlab.models.coverage import queries_of
from covlab.models.metrics import ALPHA_NDCG, STRECALL, evaluate_run
from covlab.models.registry import Report, SelectorSettings, method, methods
from covlab.models.runs import run_method
from covlab.models.selection import ESTIMATED, ranked_pools
from covlab.models.selectors import Budget
from covlab.models.statistics import paired_comparison
from covlab.models.trust import EstimateTrust

PAPER_TABLE1 = {  # alpha-nDCG@10 / StRecall@10 on TREC RAG 2024, for orientation (METHODS.md §1)
    "relevance": (0.625, 0.744), "relevance_coverage_trained": (0.656, 0.762), "coverage_greedy": (0.702, 0.770),
    "gold_nugget_bound": (0.718, 0.781), "oracle_greedy": (0.887, 0.858),
}


def evaluate_selections(selections: dict[str, pd.DataFrame], nugget_links: pd.DataFrame, qrels: pd.DataFrame,
                        queries: pd.DataFrame, k: int, alpha: float,
                        vital: set[tuple[str, str]] | None = None) -> pd.DataFrame:
    """(method, query_id, split, metric, value) for every selection run; with `vital` (the vital nuggets of a
    dataset whose nuggets are graded, models/metrics.py vital_nuggets) vital_strecall@k too."""
    split_of = dict(zip(queries["query_id"], queries["split"]))
    frames = [evaluate_run(run, nugget_links, qrels, k=k, alpha=alpha, vital=vital).assign(method=method)
              for method, run in sorted(selections.items())]
    table = pd.concat(frames, ignore_index=True)
    table["split"] = table["query_id"].map(split_of)
    return table[["method", "query_id", "split", "metric", "value"]]


def method_means(per_query: pd.DataFrame) -> pd.DataFrame:
    """(method, [budget,] split, metric, value): each metric's mean over the queries of a split, per method
    and, for the token-budgeted comparison's figures (which have a budget column), per budget; the one average
    behind Table 1, the stored report figures and the dev scores that decide promotion."""
    keys = ["method", *(["budget"] if "budget" in per_query else []), "split", "metric"]
    return per_query.groupby(keys, as_index=False)["value"].mean()


def report_figures(per_query: pd.DataFrame, dataset: str, k: int | None) -> pd.DataFrame:
    """The rows the results store keeps for a report: every per-query value and, with query_id None, the
    `method_means` aggregates; budget None when the figures have none, k None for a report without a rank
    cut-off (the comparison's)."""
    figures = pd.concat([per_query, method_means(per_query).assign(query_id=None)], ignore_index=True)
    return figures.assign(dataset=dataset, budget=figures.get("budget"), k=k)


def method_scores(per_query: pd.DataFrame, split: str, metric: str) -> dict[str, float]:
    """method -> mean of `metric` on `split` (e.g. the dev score a trained selector's promotion compares)."""
    means = method_means(per_query)
    chosen = means[(means["split"] == split) & (means["metric"] == metric)]
    return dict(zip(chosen["method"], chosen["value"].astype(float)))


def table1(per_query: pd.DataFrame, split: str) -> pd.DataFrame:
    """Mean of each metric per method on `split`, rows in Table 1 order (the coverage report's methods in
    registry order, which is the paper's with our rows after, labelled as the paper labels them; methods
    absent are left out)."""
    means = method_means(per_query[per_query["split"] == split]).pivot(index="method", columns="metric",
                                                                       values="value")
    rows = [(m.label, m.name) for m in methods(Report.COVERAGE) if m.name in means.index]
    table = means.loc[[m for _, m in rows]]
    queries = per_query.loc[per_query["split"] == split, "query_id"].nunique()
    table.index = pd.Index([label for label, _ in rows], name=f"{split} (n={queries})")
    metric_order = sorted(table.columns, key=lambda m: ("alpha" not in m, "strecall" not in m, "p@" not in m, m))
    return table[metric_order]


def paired_against(per_query: pd.DataFrame, split: str, metric: str, baseline: str, seed: int = 0) -> pd.DataFrame:
    """Each method vs `baseline` on one metric: mean difference, bootstrap CI, wins/ties/losses, sign test
    and Wilcoxon p (METHODS.md §2 "Statistics")."""
    rows = per_query[(per_query["split"] == split) & (per_query["metric"] == metric)]
    wide = rows.pivot_table(index="query_id", columns="method", values="value")
    if baseline not in wide.columns:
        return pd.DataFrame()
    return pd.DataFrame([{"method": m, **paired_comparison(wide[m], wide[baseline], seed=seed)}
                         for m in wide.columns if m != baseline]).set_index("method")


class PoolComparison(NamedTuple):
    """The k-document selections of several candidate pools, scored (`compare_pools`). per_query: (method,
    query_id, split, metric, value), method "<pool source>:<selection>"; summary: each metric's mean on the
    report split per selection (rows) and source (columns); paired: per selection and metric, each source
    against the baseline source (paired_against's fields); decisions: source -> the coverage selection's
    estimator decision (fell_back, estimator_gate, blend_weight, ...)."""
    per_query: pd.DataFrame
    summary: pd.DataFrame
    paired: pd.DataFrame
    decisions: dict[str, dict]


def compare_pools(pools: Mapping[str, pd.DataFrame], matrices: Mapping[str, pd.DataFrame], selection: str,
                  settings: SelectorSettings, trust: EstimateTrust, nugget_links: pd.DataFrame, qrels: pd.DataFrame,
                  queries: pd.DataFrame, splits: Sequence[str], report_split: str, baseline: str, k: int,
                  alpha: float, seed: int = 0) -> PoolComparison:
    """Which candidate pool serves a coverage selection better: from each pool (source -> POOLS table) the
    first k documents in pool order (the `pool_order` method) and the registry method `selection`'s on the
    source's estimated coverage matrix (`matrices`, COVERAGE_MATRIX), through the estimator gate and the blend
    tuned on trust.tune_split (models/runs.run_method), its fallback being the pool order; then alpha-nDCG@k
    and StRecall@k of each (`evaluate_selections`) and the paired statistics of every source against
    `baseline` per selection and metric on `report_split`. Every source is compared on the same queries:
    those of `splits` that every pool holds."""
    if baseline not in pools:
        raise ValueError(f"baseline {baseline!r} is not a pool source; expected one of {sorted(pools)}")
    shared = set(queries_of(queries, splits)["query_id"]).intersection(*(set(p["query_id"]) for p in pools.values()))
    budget, order, chosen = Budget(k=k), method("pool_order"), method(selection)
    runs, decisions = {}, {}
    for source, pool in sorted(pools.items()):
        pool = pool[pool["query_id"].isin(shared)]
        ordered = run_method(order, ranked_pools(pool, queries), [budget], settings)
        selected = run_method(chosen, ranked_pools(pool, queries, matrices[source], ESTIMATED), [budget], settings,
                              trust=trust)
        runs[f"{source}:{order.name}"] = ordered.table.drop(columns="budget")
        runs[f"{source}:{selection}"] = selected.table.drop(columns="budget")
        decisions[source] = selected.decisions[k].metadata()
    measured = [str(ALPHA_NDCG @ k), str(STRECALL @ k)]
    per_query = evaluate_selections(runs, nugget_links, qrels, queries, k, alpha)
    per_query = per_query[per_query["metric"].isin(measured)].reset_index(drop=True)

    def with_parts(rows: pd.DataFrame) -> pd.DataFrame:  # "<source>:<selection>" split into its two parts
        parts = rows["method"].str.split(":", n=1, expand=True)
        return rows.assign(source=parts[0], selection=parts[1])

    means = with_parts(method_means(per_query[per_query["split"] == report_split]))
    summary = means.pivot(index="selection", columns=["metric", "source"], values="value").sort_index(axis=1)
    named = with_parts(per_query)
    paired = pd.concat([paired_against(rows.assign(method=rows["source"]), report_split, metric, baseline, seed)
                        .assign(selection=name, metric=metric)
                        for (name, metric), rows in named.groupby(["selection", "metric"], sort=True)])
    return PoolComparison(per_query, summary, paired.rename_axis("source").reset_index(), decisions)
