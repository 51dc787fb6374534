"""The token-budgeted comparison of every selector family on the same pools, budgets and measures
(METHODS.md §2, §3, §5): the tables it reads (item embeddings, token counts), the per-query pools built from
them, the line-up of budgeted methods, selections per method and budget, topic-grouped cross-validation for
the trained selectors, the measures of every selection and the report's tables (means, oracle headroom,
paired statistics).

A method's selection is a BUDGETED_SELECTIONS table: for every query and token budget, the chosen documents
in selection order (rank 1 first); the exact oracles' selections are sets, listed in pool order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from covlab.models.lmvu import (FoldRanker, LMVUSettings, TrainedLMVU, fit_lmvu, fold_rankers,
                                heldout_top1_accuracy, labelled_pools)
from covlab.models.metrics import (ALPHA_NDCG, IOU, RANK_CUTOFF, REDUNDANCY, RVC1, RVC2, STRECALL, TOKENS,
                                   VITAL_STRECALL, evaluate_run)
from covlab.models.protocol import EvaluationProtocol
from covlab.models.registry import Report, SelectorSettings, method, methods
from covlab.models.report import method_means
from covlab.models.runs import run_method
from covlab.models.schemas import COMPARISON_FIGURES, ITEM_EMBEDDINGS, TOKEN_COUNTS
from covlab.models.selection import QueryPool
from covlab.models.selectors import Budget, check_token_budgets
from covlab.models.statistics import paired_comparison
from covlab.models.subquestions import split_sentences
from covlab.models.viewpoints import iou, redundancy, rvc1, rvc2


# Default token budgets per dataset [chosen]: items of at most SHORT_ITEM_MEDIAN_TOKENS tokens (median) are
# short evidence items (ArgKP and Perspectrum arguments, ~20 tokens), where 32-256 tokens separate the
# selectors; longer items are document chunks, compared at 512-2,048 tokens.
SHORT_ITEM_MEDIAN_TOKENS = 64
SHORT_ITEM_BUDGETS = (32, 64, 128, 256)
LONG_ITEM_BUDGETS = (512, 1024, 2048)
# What the comparison measures of every selection: coverage of the viewpoints, the ranked-list measures of the
# selections that have a rank order (METHODS.md §5), and the selection's overlap, redundancy and cost.
RANKED = (ALPHA_NDCG @ RANK_CUTOFF, STRECALL @ RANK_CUTOFF)
# Measured of a dataset whose nuggets are graded vital or okay only (models/metrics.py vital_nuggets).
VITAL_RANKED = VITAL_STRECALL @ RANK_CUTOFF
RATE_METRICS = tuple(str(m) for m in (RVC1, RVC2, *RANKED, VITAL_RANKED, IOU, REDUNDANCY, TOKENS))
# Metrics of the paired statistics.
PAIRED_METRICS = tuple(str(m) for m in (RVC1, RVC2, ALPHA_NDCG @ RANK_CUTOFF))
ATOM_MIN_WORDS = 3  # a sentence of fewer words is not an atom of its own (models/subquestions.split_sentences)


def default_token_budgets(token_counts: pd.DataFrame) -> tuple[int, ...]:
    """SHORT_ITEM_BUDGETS when the median item is at most SHORT_ITEM_MEDIAN_TOKENS tokens, else
    LONG_ITEM_BUDGETS."""
    if token_counts.empty:
        raise ValueError("no token counts: the pools are empty, so there is nothing to budget")
    short = float(token_counts["tokens"].median()) <= SHORT_ITEM_MEDIAN_TOKENS
    return SHORT_ITEM_BUDGETS if short else LONG_ITEM_BUDGETS


def atom_sentences(text: str) -> list[str]:
    """A document's sentence-level atoms (LMVU, METHODS.md §2): its sentences of ATOM_MIN_WORDS words or more when
    it has two or more, else none (the document is its own single atom)."""
    sentences = split_sentences(text, min_words=ATOM_MIN_WORDS)
    return sentences if len(sentences) > 1 else []


def pooled_texts(pools: pd.DataFrame, queries: pd.DataFrame, texts: Mapping[str, str]) -> pd.DataFrame:
    """What item_embeddings encodes: (kind, item_id, atom, text) for every pooled query and document and the
    sentences of pooled documents that have two or more (ATOM_MIN_WORDS words at least)."""
    query_text = dict(zip(queries["query_id"], queries["text"]))
    rows = [("query", q, 0, query_text[q]) for q in sorted(set(pools["query_id"]))]
    for doc_id in sorted(set(pools["doc_id"])):
        rows.append(("document", doc_id, 0, texts[doc_id]))
        rows += [("atom", doc_id, i, s) for i, s in enumerate(atom_sentences(texts[doc_id]))]
    return pd.DataFrame(rows, columns=["kind", "item_id", "atom", "text"])


def embed_items(pools: pd.DataFrame, queries: pd.DataFrame, texts: Mapping[str, str],
                    embed: Callable[[list[str]], np.ndarray]) -> pd.DataFrame:
    """ITEM_EMBEDDINGS of `pooled_texts`, `embed` mapping texts to unit vectors (a bi-encoder)."""
    items = pooled_texts(pools, queries, texts)
    vectors = embed(items["text"].tolist())
    return ITEM_EMBEDDINGS.conform(items.drop(columns="text").assign(vector=list(np.asarray(vectors, np.float32))),
                                   source="item_embeddings")


def pool_token_counts(pools: pd.DataFrame, texts: Mapping[str, str], count: Callable[[list[str]], np.ndarray]
                 ) -> pd.DataFrame:
    """TOKEN_COUNTS t(d) of every pooled document under `count` (models/tokens.TokenCounter.count)."""
    doc_ids = sorted(set(pools["doc_id"]))
    return TOKEN_COUNTS.conform(pd.DataFrame({"doc_id": doc_ids, "tokens": count([texts[d] for d in doc_ids])}),
                                source="token_counts")


def resolve_budgets(configured: Sequence[int], token_counts: pd.DataFrame) -> tuple[int, ...]:
    """The configured token budgets (distinct, ascending), or the dataset's default when none are configured."""
    return tuple(sorted(set(check_token_budgets(configured)))) or default_token_budgets(token_counts)


def comparison_figures(selections: Mapping[str, pd.DataFrame], query_pools: Mapping[str, QueryPool],
                       nugget_links: pd.DataFrame, alpha: float,
                       vital: set[tuple[str, str]] | None = None) -> pd.DataFrame:
    """COMPARISON_FIGURES of every method's selections: per query and budget RVC1, RVC2, tokens, IOU against
    the gold evidence (pool documents linked to a nugget of the query), redundancy, and for ordered methods
    alpha-nDCG@10 and StRecall@10 of the selection order (ir_measures, models/metrics.py), with `vital` (the
    vital nuggets of a graded dataset) vital_strecall@10 too. Queries without viewpoints have no RVC; IOU is
    left out when nothing is selected and nothing is gold.

    A method is measured on every pool of `query_pools`, except the exact oracles and the methods on
    estimated coverage, which are measured on the queries their selections name (the oracle skips refused
    inventories; an estimated matrix exists for the evaluated splits only). A measured query with nothing
    selected at a budget (no item fits) scores 0 coverage at that budget."""
    rows = []
    no_qrels = pd.DataFrame({"query_id": [], "doc_id": [], "relevance": []})
    for name, table in sorted(selections.items()):
        entry = method(name)
        measured = (sorted(set(table["query_id"])) if not entry.ordered or entry.coverage.estimated
                    else sorted(query_pools))
        chosen = {(q, b): r.sort_values("rank")["doc_id"].tolist()
                  for (q, b), r in table.groupby(["query_id", "budget"])}
        for budget in sorted(set(table["budget"])):
            for query_id in measured:
                rows += _set_measures(name, int(budget), query_pools[query_id], chosen.get((query_id, budget), []))
            if entry.ordered:
                run = table[(table["budget"] == budget) & table["query_id"].isin(measured)]
                ranked = evaluate_run(run, nugget_links, no_qrels, k=RANK_CUTOFF, alpha=alpha, vital=vital)
                ranked = ranked[ranked["metric"].isin(RATE_METRICS)]
                scored = set(ranked["query_id"])
                rows += [(name, int(budget), q, query_pools[q].split, m, v)
                         for q, m, v in ranked[["query_id", "metric", "value"]].itertuples(index=False)]
                rows += [(name, int(budget), q, query_pools[q].split, m, 0.0) for q in measured if q not in scored
                         for m in map(str, RANKED + ((VITAL_RANKED,) if vital is not None else ()))]
    frame = pd.DataFrame(rows, columns=list(COMPARISON_FIGURES.columns))
    return COMPARISON_FIGURES.conform(frame, source="comparison_figures")


def _set_measures(method: str, budget: int, query_pool: QueryPool, doc_ids: list[str]) -> list[tuple]:
    index = {d: i for i, d in enumerate(query_pool.doc_ids)}
    chosen = np.array([index[d] for d in doc_ids], dtype=np.int64)
    pool, gold = query_pool.pool, query_pool.gold_labels()
    values = {str(TOKENS): float(pool.tokens[chosen].sum()), str(REDUNDANCY): redundancy(pool.embeddings, chosen)}
    evidence = query_pool.doc_ids[gold.any(axis=1)]
    if len(chosen) or len(evidence):
        values[str(IOU)] = iou(doc_ids, evidence)
    if gold.shape[1]:
        values[str(RVC1)] = rvc1(gold, chosen)
        values[str(RVC2)] = rvc2(gold, pool.source_units, chosen)
    return [(method, budget, query_pool.query_id, query_pool.split, metric, value)
            for metric, value in values.items()]


def method_rvc1(name: str, query_pools: Mapping[str, QueryPool], budgets: Sequence[int],
                nugget_links: pd.DataFrame, settings: SelectorSettings, *, alpha: float,
                model: object = None) -> tuple[float, dict[int, float]]:
    """One method's RVC1 as the comparison reports it: its selections (models/runs.run_method) over
    `query_pools` (of one split) measured by `comparison_figures` and averaged over the queries with
    viewpoints per budget (models/report.method_means); (the mean over `budgets` of those means, budget ->
    mean; NaN where no query has viewpoints). The LMVU ranker's dev score for champion promotion, on the tune
    split's pools."""
    splits = sorted({p.split for p in query_pools.values()})
    if len(splits) > 1:
        raise ValueError(f"method_rvc1 scores the pools of one split; got {splits}")
    run = run_method(method(name), query_pools, [Budget(tokens=int(b)) for b in budgets], settings, model=model)
    means = method_means(comparison_figures({name: run.table}, query_pools, nugget_links, alpha))
    rvc1_means = means[means["metric"] == str(RVC1)].set_index("budget")["value"]
    by_budget = {int(b): float(rvc1_means.get(b, np.nan)) for b in budgets}
    return float(np.mean(list(by_budget.values()))), by_budget


@dataclass(frozen=True, eq=False)
class LMVUTraining:
    """The LMVU ranker's training (`train_lmvu_ranker`): the ranker fit on train with C chosen on the tune
    split, its held-out top-1 accuracy against chance on the tune split (its promotion gate), the mean RVC1 of
    its selections there (its promotion score) per budget, and under cross-validation one ranker per fold."""
    trained: TrainedLMVU
    top1: float
    chance: float
    dev_rvc1: float
    dev_rvc1_by_budget: dict[int, float]
    folds: list[FoldRanker]


def train_lmvu_ranker(pools: Mapping[str, QueryPool], protocol: EvaluationProtocol, budgets: Sequence[int],
                      settings: LMVUSettings, selector_settings: SelectorSettings, nugget_links: pd.DataFrame,
                      queries: pd.DataFrame, alpha: float) -> LMVUTraining:
    """LMVU's training as the comparison uses it (METHODS.md §2): on the train split's pools, C chosen on the
    tune split's; its gate and dev score on the tune split; under grouped_cv also a ranker per topic-grouped
    fold of `protocol` over the pooled queries, which the budgeted selection applies to each fold's queries."""
    by_budget = [Budget(tokens=int(b)) for b in budgets]
    split_ids = {name: [q for q, p in pools.items() if p.split == name] for name in ("train", protocol.tune_split)}
    trained = fit_lmvu(pools, split_ids["train"], split_ids[protocol.tune_split], by_budget, settings)
    tune = labelled_pools(pools, split_ids[protocol.tune_split])
    top1, chance = heldout_top1_accuracy(trained.ranker, tune, by_budget, states_per_query=settings.states_per_query,
                                         seed=settings.seed)
    tune_pools = {q: pools[q] for q in split_ids[protocol.tune_split]}
    dev_rvc1, dev_by_budget = method_rvc1("lmvu", tune_pools, budgets, nugget_links, selector_settings, alpha=alpha,
                                          model=trained.ranker)
    folds = []
    if protocol.cross_validated:
        plan = protocol.fold_plan(queries[queries["query_id"].isin(set(pools))])
        folds = fold_rankers(pools, plan, by_budget, settings)
    return LMVUTraining(trained, top1, chance, dev_rvc1, dev_by_budget, folds)


def summary_table(figures: pd.DataFrame, methods: Sequence[str]) -> pd.DataFrame:
    """Mean of each metric per (method, budget), methods in `methods` order, with the number of queries."""
    means = figures.pivot_table(index=["method", "budget"], columns="metric", values="value", aggfunc="mean")
    counts = figures[figures["metric"] == "tokens"].groupby(["method", "budget"])["query_id"].nunique()
    means["queries"] = counts
    order = {m: i for i, m in enumerate(methods)}
    means = means.reset_index()
    means = means.sort_values(["method", "budget"], key=lambda s: s.map(order) if s.name == "method" else s)
    columns = [m for m in RATE_METRICS if m in means.columns] + ["queries"]
    return means.set_index(["method", "budget"])[columns]


def headroom_table(figures: pd.DataFrame) -> pd.DataFrame:
    """Exact oracle minus method per (method, budget), for RVC1 (against oracle_rvc1) and RVC2 (against
    oracle_rvc2), averaged over the queries both have (queries the oracle refused are left out)."""
    frames = []
    for metric, oracle in ((str(RVC1), "oracle_rvc1"), (str(RVC2), "oracle_rvc2")):
        rows = figures[figures["metric"] == metric]
        best = rows[rows["method"] == oracle].set_index(["budget", "query_id"])["value"].rename("oracle")
        joined = rows[~rows["method"].isin(["oracle_rvc1", "oracle_rvc2"])].join(best, on=["budget", "query_id"],
                                                                                  how="inner")
        frames.append(joined.assign(headroom=joined["oracle"] - joined["value"]).groupby(["method", "budget"])[
            ["oracle", "value", "headroom"]].mean().add_prefix(f"{metric}_"))
    return pd.concat(frames, axis=1)


def paired_table(figures: pd.DataFrame, pairs: Sequence[tuple[str, str]], seed: int) -> pd.DataFrame:
    """Paired statistics (models/statistics.paired_comparison: bootstrap CI, win/tie/loss, sign test,
    Wilcoxon) of method a against method b for every pair, budget and PAIRED_METRICS metric, over the
    queries both have."""
    rows = []
    for a, b in pairs:
        for (budget, metric), group in figures[figures["metric"].isin(PAIRED_METRICS)].groupby(["budget", "metric"]):
            wide = group.pivot_table(index="query_id", columns="method", values="value")
            if a not in wide or b not in wide:
                continue
            both = wide[[a, b]].dropna()
            if both.empty:
                continue
            rows.append({"a": a, "b": b, "budget": int(budget), "metric": metric,
                         **paired_comparison(both[a], both[b], seed=seed)})
    return pd.DataFrame(rows).set_index(["a", "b", "budget", "metric"]) if rows else pd.DataFrame()


@dataclass(frozen=True)
class Comparison:
    """The comparison report's tables: per-query figures, means per (method, budget), oracle headroom and
    paired statistics."""
    figures: pd.DataFrame
    summary: pd.DataFrame
    headroom: pd.DataFrame
    paired: pd.DataFrame


def compare(selections: Mapping[str, pd.DataFrame], query_pools: Mapping[str, QueryPool],
            nugget_links: pd.DataFrame, *, alpha: float, baseline: str, seed: int,
            vital: set[tuple[str, str]] | None = None) -> Comparison:
    """Every method's selections over the pools of `query_pools` (the reported queries) measured, averaged,
    set against the exact oracles and compared pairwise (`comparison_pairs`); `vital`: the vital nuggets of a
    dataset whose nuggets are graded (models/metrics.py vital_nuggets), measured by vital_strecall@10 too."""
    reported = {name: table[table["query_id"].isin(set(query_pools))] for name, table in selections.items()}
    if baseline not in reported:
        raise ValueError(f"the baseline {baseline!r} is not among the compared methods {sorted(reported)}")
    if reported[baseline].empty:
        raise ValueError(f"the baseline {baseline!r} selected nothing for the {len(query_pools)} reported queries "
                         "at any budget: no paired statistics without it (is every budget below every item's "
                         "token count?)")
    figures = comparison_figures(reported, query_pools, nugget_links, alpha, vital)
    names = [m.name for m in methods(Report.COMPARISON) if m.name in reported]
    return Comparison(figures, summary_table(figures, names), headroom_table(figures),
                      paired_table(figures, comparison_pairs(names, baseline), seed))


def method_protocols(protocol: EvaluationProtocol) -> dict[str, str]:
    """How each method of the comparison met its training data under `protocol` (for the report)."""
    return {m.name: "gold labels (bound)" if m.bound else protocol.describe(m.trained is not None, m.coverage.estimated)
            for m in methods(Report.COMPARISON)}


def comparison_pairs(methods: Iterable[str], baseline: str = "relevance") -> list[tuple[str, str]]:
    """Every method against `baseline`, and LMVU against MMR (the issue's two questions)."""
    methods = list(methods)
    pairs = [(m, baseline) for m in methods if m != baseline and baseline in methods]
    if {"lmvu", "mmr"} <= set(methods):
        pairs.append(("lmvu", "mmr"))
    return pairs


def markdown(table: pd.DataFrame, digits: int = 4) -> str:
    """A table as Markdown for metadata and the closing note ("n/a" when empty), with flat labels: the levels of
    a row MultiIndex become columns of their own, the levels of a column MultiIndex one header each
    ("alpha_ndcg@10 / bm25"), never a Python tuple."""
    if not len(table):
        return "n/a"
    flat = table.round(digits)
    if isinstance(flat.columns, pd.MultiIndex):
        flat.columns = [" / ".join(str(level) for level in column if str(level)) for column in flat.columns]
    if isinstance(flat.index, pd.MultiIndex):
        return flat.reset_index().to_markdown(index=False)
    return flat.to_markdown()

