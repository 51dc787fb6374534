"""The coverage report (METHODS.md §1, Table 1 of the paper): per-method, per-query metrics of every
selection, the Table 1 layout and paired comparisons against the relevance baseline."""

from __future__ import annotations

import pandas as pd

from covlab.models.metrics import evaluate_run
from covlab.models.statistics import paired_comparison

# (row label, selection method) in the paper's Table 1 order, with our extra rows after.
TABLE1_ROWS = [
    ("relevance", "relevance"),
    ("+ coverage training", "relevance_coverage_trained"),
    ("+ estimator and greedy", "coverage_greedy"),
    ("+ estimator and soft greedy [chosen]", "coverage_greedy_soft"),
    ("gold nuggets", "gold_nugget_bound"),
    ("gold nuggets, soft greedy [chosen]", "gold_nugget_bound_soft"),
    ("oracle greedy", "oracle_greedy"),
    ("BM25 pool order", "bm25"),
]
PAPER_TABLE1 = {  # alpha-nDCG@10 / StRecall@10 on TREC RAG 2024, for orientation (METHODS.md §1)
    "relevance": (0.625, 0.744), "relevance_coverage_trained": (0.656, 0.762), "coverage_greedy": (0.702, 0.770),
    "gold_nugget_bound": (0.718, 0.781), "oracle_greedy": (0.887, 0.858),
}


def evaluate_selections(selections: dict[str, pd.DataFrame], nugget_links: pd.DataFrame, qrels: pd.DataFrame,
                        queries: pd.DataFrame, k: int, alpha: float) -> pd.DataFrame:
    """(method, query_id, split, metric, value) for every selection run."""
    split_of = dict(zip(queries["query_id"], queries["split"]))
    frames = [evaluate_run(run, nugget_links, qrels, k=k, alpha=alpha).assign(method=method)
              for method, run in sorted(selections.items())]
    table = pd.concat(frames, ignore_index=True)
    table["split"] = table["query_id"].map(split_of)
    return table[["method", "query_id", "split", "metric", "value"]]


def method_means(per_query: pd.DataFrame) -> pd.DataFrame:
    """(method, split, metric, value): each metric's mean over the queries of a split, per method; the one
    average behind Table 1, the stored report figures and the dev scores that decide promotion."""
    return per_query.groupby(["method", "split", "metric"], as_index=False)["value"].mean()


def report_figures(per_query: pd.DataFrame, dataset: str, k: int) -> pd.DataFrame:
    """The rows the results store keeps for a report: every per-query value and, with query_id None, the
    `method_means` aggregates."""
    return pd.concat([per_query, method_means(per_query).assign(query_id=None)], ignore_index=True).assign(
        dataset=dataset, budget=None, k=k)


def method_scores(per_query: pd.DataFrame, split: str, metric: str) -> dict[str, float]:
    """method -> mean of `metric` on `split` (e.g. the dev score a trained selector's promotion compares)."""
    means = method_means(per_query)
    chosen = means[(means["split"] == split) & (means["metric"] == metric)]
    return dict(zip(chosen["method"], chosen["value"].astype(float)))


def table1(per_query: pd.DataFrame, split: str) -> pd.DataFrame:
    """Mean of each metric per method on `split`, rows in Table 1 order (methods absent are left out)."""
    means = method_means(per_query[per_query["split"] == split]).pivot(index="method", columns="metric",
                                                                       values="value")
    rows = [(label, method) for label, method in TABLE1_ROWS if method in means.index]
    table = means.loc[[m for _, m in rows]]
    table.index = pd.Index([label for label, _ in rows], name=f"{split} (n={per_query.loc[per_query['split'] == split, 'query_id'].nunique()})")
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
