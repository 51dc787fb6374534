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
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from covlab.models.budgeted import (MMR, AdaGReS, Budget, CoverageGreedy, FacilityLocation, Pool, RelevanceOrder,
                                    Selector)
from covlab.models.lmvu import LMVU, LabelledPool, TrainedLMVU, train_lmvu
from covlab.models.metrics import evaluate_run
from covlab.models.oracles import rvc1_oracle, rvc2_oracle
from covlab.models.report import method_means
from covlab.models.schemas import BUDGETED_SELECTIONS, COMPARISON_FIGURES, ITEM_EMBEDDINGS, TOKEN_COUNTS
from covlab.models.selection import ESTIMATED, Trust, query_matrix
from covlab.models.statistics import paired_comparison
from covlab.models.subquestions import split_sentences
from covlab.models.viewpoints import iou, redundancy, rvc1, rvc2


# Default token budgets per dataset [chosen]: items of at most SHORT_ITEM_MEDIAN_TOKENS tokens (median) are
# short evidence items (ArgKP and Perspectrum arguments, ~20 tokens), where 32-256 tokens separate the
# selectors; longer items are document chunks, compared at 512-2,048 tokens.
SHORT_ITEM_MEDIAN_TOKENS = 64
SHORT_ITEM_BUDGETS = (32, 64, 128, 256)
LONG_ITEM_BUDGETS = (512, 1024, 2048)
# Ranked-list measures of the selections that have a rank order (METHODS.md §5).
RANK_CUTOFF = 10
RATE_METRICS = ("rvc1", "rvc2", f"alpha_ndcg@{RANK_CUTOFF}", f"strecall@{RANK_CUTOFF}", "iou", "redundancy",
                "tokens")
# Metrics of the paired statistics and the baseline pairs they compare.
PAIRED_METRICS = ("rvc1", "rvc2", f"alpha_ndcg@{RANK_CUTOFF}")
ATOM_MIN_WORDS = 3  # a sentence of fewer words is not an atom of its own (models/subquestions.split_sentences)


@dataclass(frozen=True)
class BudgetedMethod:
    """One method of the comparison. covers: the coverage matrix its selector reads (None; "estimated": the
    estimator over the subquestions; "estimated_gold": the estimator over the gold nuggets; "gold": the gold
    links); oracle: "rvc1"/"rvc2" for the exact oracles (sets, no rank order); trained: refit per fold under
    topic-grouped cross-validation."""
    name: str
    description: str
    covers: str | None = None
    oracle: str | None = None
    trained: bool = False

    @property
    def ordered(self) -> bool:
        return self.oracle is None


BUDGETED_METHODS = (
    BudgetedMethod("relevance", "relevance order: add by cosine to the query while items fit"),
    BudgetedMethod("mmr", "MMR, lambda from evaluation.mmr_lambda (METHODS.md §5)"),
    BudgetedMethod("facloc", "facility location, cost-scaled greedy or the best single item (METHODS.md §5)"),
    BudgetedMethod("adagres", "AdaGReS with the adaptive beta* (METHODS.md §3)"),
    BudgetedMethod("lmvu", "LMVU: the learned linear ranker of marginal viewpoint gain (METHODS.md §2)",
                   trained=True),
    BudgetedMethod("coverage_greedy", "greedy coverage per token on the estimated matrix at tau",
                   covers="estimated"),
    BudgetedMethod("coverage_greedy_soft", "soft greedy coverage per token on the estimated probabilities",
                   covers="estimated"),
    BudgetedMethod("gold_nugget_bound", "greedy coverage per token on the estimator's gold-nugget matrix at tau",
                   covers="estimated_gold"),
    BudgetedMethod("gold_nugget_bound_soft", "soft greedy per token on the estimator's gold-nugget probabilities",
                   covers="estimated_gold"),
    BudgetedMethod("oracle_greedy", "greedy coverage per token on the gold matrix", covers="gold"),
    BudgetedMethod("oracle_rvc1", "the exact RVC1 oracle (bitmask DP)", covers="gold", oracle="rvc1"),
    BudgetedMethod("oracle_rvc2", "the exact RVC2 oracle (DP over {0,1,2}^|V|)", covers="gold", oracle="rvc2"),
)
METHOD = {method.name: method for method in BUDGETED_METHODS}


def method_selector(method: BudgetedMethod, *, mmr_lambda: float, tau: float,
                    ranker: LMVU | None = None) -> Selector:
    """The selector object of a (non-oracle) method."""
    if method.oracle is not None:
        raise ValueError(f"{method.name} is an exact oracle, not a greedy selector; use oracle_selections")
    soft = method.name.endswith("_soft")
    return {"relevance": lambda: RelevanceOrder(), "mmr": lambda: MMR(mmr_lambda),
            "facloc": lambda: FacilityLocation(), "adagres": lambda: AdaGReS(), "lmvu": lambda: _ranker(ranker),
            "oracle_greedy": lambda: CoverageGreedy(soft=False, tau=1.0)}.get(
        method.name, lambda: CoverageGreedy(soft=soft, tau=tau))()


def _ranker(ranker: LMVU | None) -> LMVU:
    if ranker is None:
        raise ValueError("lmvu needs a trained ranker (the lmvu_ranker asset, or one fit per fold)")
    return ranker


def default_token_budgets(token_counts: pd.DataFrame) -> tuple[int, ...]:
    """SHORT_ITEM_BUDGETS when the median item is at most SHORT_ITEM_MEDIAN_TOKENS tokens, else
    LONG_ITEM_BUDGETS."""
    if token_counts.empty:
        raise ValueError("no token counts: the pools are empty, so there is nothing to budget")
    short = float(token_counts["tokens"].median()) <= SHORT_ITEM_MEDIAN_TOKENS
    return SHORT_ITEM_BUDGETS if short else LONG_ITEM_BUDGETS


def pooled_texts(pools: pd.DataFrame, queries: pd.DataFrame, texts: Mapping[str, str]) -> pd.DataFrame:
    """What item_embeddings encodes: (kind, item_id, atom, text) for every pooled query and document and the
    sentences of pooled documents that have two or more (ATOM_MIN_WORDS words at least)."""
    query_text = dict(zip(queries["query_id"], queries["text"]))
    rows = [("query", q, 0, query_text[q]) for q in sorted(set(pools["query_id"]))]
    for doc_id in sorted(set(pools["doc_id"])):
        rows.append(("document", doc_id, 0, texts[doc_id]))
        sentences = split_sentences(texts[doc_id], min_words=ATOM_MIN_WORDS)
        if len(sentences) > 1:
            rows += [("atom", doc_id, i, s) for i, s in enumerate(sentences)]
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


@dataclass(frozen=True, eq=False)
class QueryPool:
    """One query's pool as the budgeted selectors see it (`pool`, documents in pool-rank order `doc_ids`),
    with its gold viewpoint matrix (pool documents x the query's nuggets, bool) kept beside it, never in it:
    only the methods that are defined on gold labels get it as their covers."""
    query_id: str
    split: str
    topic: str
    doc_ids: np.ndarray
    pool: Pool
    gold: np.ndarray | None

    def labelled(self) -> LabelledPool:
        return LabelledPool(self.query_id, self.pool, self.gold_labels())

    def with_covers(self, covers: np.ndarray) -> Pool:
        return replace(self.pool, covers=covers)

    def gold_labels(self) -> np.ndarray:
        if self.gold is None:
            raise ValueError(f"query {self.query_id!r}: built without nuggets, so it has no gold matrix")
        return self.gold


def query_pools(pools: pd.DataFrame, queries: pd.DataFrame, embeddings: pd.DataFrame, tokens: pd.DataFrame,
                corpus: pd.DataFrame, query_ids: Iterable[str], nuggets: pd.DataFrame | None = None,
                nugget_links: pd.DataFrame | None = None) -> dict[str, QueryPool]:
    """A QueryPool for each of `query_ids` that has a pool, from a POOLS table (pool order = rank), the
    ITEM_EMBEDDINGS and TOKEN_COUNTS tables and the corpus (source units). With nuggets and their links, each
    carries its gold matrix (a link of grade >= 1 covers)."""
    wanted = set(query_ids)
    vectors = {(k, i): v for k, i, a, v in embeddings[["kind", "item_id", "atom", "vector"]].itertuples(index=False)
               if k != "atom"}
    atoms: dict[str, list] = {}
    for item_id, vector in embeddings.loc[embeddings["kind"] == "atom"].sort_values(["item_id", "atom"])[
            ["item_id", "vector"]].itertuples(index=False):
        atoms.setdefault(item_id, []).append(vector)
    cost = dict(zip(tokens["doc_id"], tokens["tokens"]))
    unit = dict(zip(corpus["doc_id"], corpus["source_unit"]))
    meta = queries.set_index("query_id")[["split", "topic"]]
    gold_of = _gold_matrices(nuggets, nugget_links) if nuggets is not None else None
    out = {}
    ranked = pools[pools["query_id"].isin(wanted)].sort_values(["query_id", "rank"], kind="stable")
    for query_id, rows in ranked.groupby("query_id", sort=True):
        doc_ids = rows["doc_id"].to_numpy(dtype=object)
        missing = [d for d in doc_ids if ("document", d) not in vectors or d not in cost]
        if ("query", query_id) not in vectors or missing:
            what = f"document {missing[0]!r}" if missing else "the query itself"
            raise ValueError(f"query {query_id!r}: {what} has no embedding or token count; re-materialize "
                             "item_embeddings and token_counts for the current pools")
        atom_rows = [atoms.get(d, [vectors[("document", d)]]) for d in doc_ids]
        pool = Pool(embeddings=np.stack([vectors[("document", d)] for d in doc_ids]),
                    query=np.asarray(vectors[("query", query_id)]),
                    tokens=np.array([cost[d] for d in doc_ids], dtype=np.int64),
                    source_units=np.array([unit[d] for d in doc_ids], dtype=object),
                    atoms=np.concatenate([np.stack(a) for a in atom_rows]),
                    atom_items=np.repeat(np.arange(len(doc_ids)), [len(a) for a in atom_rows]))
        gold = gold_of(query_id, doc_ids) if gold_of is not None else None
        out[query_id] = QueryPool(query_id, str(meta.at[query_id, "split"]), str(meta.at[query_id, "topic"]),
                                  doc_ids, pool, gold)
    return out


def _gold_matrices(nuggets: pd.DataFrame, nugget_links: pd.DataFrame):
    nuggets_of = nuggets.groupby("query_id")["nugget_id"].apply(lambda s: sorted(s))
    links = nugget_links[nugget_links["grade"] >= 1]
    linked = set(map(tuple, links[["query_id", "doc_id", "nugget_id"]].itertuples(index=False)))

    def gold(query_id: str, doc_ids: np.ndarray) -> np.ndarray:
        viewpoints = nuggets_of.get(query_id, [])
        return np.array([[(query_id, d, v) in linked for v in viewpoints] for d in doc_ids], dtype=bool).reshape(
            len(doc_ids), len(viewpoints))

    return gold


def resolve_budgets(configured: Sequence[int], token_counts: pd.DataFrame) -> tuple[int, ...]:
    """The configured token budgets (distinct, ascending), or the dataset's default when none are configured."""
    budgets = tuple(sorted(set(configured))) or default_token_budgets(token_counts)
    bad = [b for b in budgets if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1]
    if bad:
        raise ValueError(f"token budgets must be positive integers; got {bad}")
    return budgets


def evaluated_query_ids(queries: pd.DataFrame, pools: pd.DataFrame, protocol: str, splits: Sequence[str]
                        ) -> list[str]:
    """The pooled queries a budgeted selection selects for: those of `splits` under the split protocol, every
    pooled query under grouped_cv (each is evaluated once, in its fold)."""
    pooled = set(pools["query_id"])
    if protocol == "grouped_cv":
        return sorted(pooled)
    if protocol != "split":
        raise ValueError(f"unknown protocol {protocol!r}; expected 'split' or 'grouped_cv'")
    return sorted(pooled & set(queries.loc[queries["split"].isin(list(splits)), "query_id"]))


def select_budgeted(query_pools: Mapping[str, QueryPool], selector: Selector | Callable[[str], Selector],
                    budgets: Sequence[int], covers: Callable[[QueryPool], np.ndarray] | None = None) -> pd.DataFrame:
    """BUDGETED_SELECTIONS of `selector` (or a function query_id -> selector, as per-fold rankers need) at
    every token budget over every pool; `covers` gives a pool's coverage matrix for the coverage family."""
    rows = []
    for query_id, query_pool in sorted(query_pools.items()):
        pool = query_pool.pool if covers is None else query_pool.with_covers(covers(query_pool))
        select = selector(query_id) if not isinstance(selector, Selector) else selector
        for budget in budgets:
            chosen = select(pool, Budget(tokens=int(budget)))
            rows += [(query_id, budget, rank, query_pool.doc_ids[i]) for rank, i in enumerate(chosen, start=1)]
    return _selections(rows)


def run_method(method: BudgetedMethod, query_pools: Mapping[str, QueryPool], budgets: Sequence[int], *,
               mmr_lambda: float, tau: float, ranker: LMVU | None = None, coverage: pd.DataFrame | None = None,
               trust: Trust | None = None) -> tuple[pd.DataFrame, dict]:
    """One method's BUDGETED_SELECTIONS over `query_pools` and what decided it (JSON-ready details).

    - exact oracles: oracle_selections (refused queries listed in the details);
    - "gold" covers: the gold matrix; "estimated"/"estimated_gold": the long-form `coverage` table
      (query_id, doc_id, subq_id, probability) over the queries it holds, and only while the estimator is
      trusted (`trust`, models/selection.estimator_trusted): below the gate the method keeps relevance order
      on those queries and says fell_back;
    - the others: their selector (`method_selector`)."""
    if method.oracle is not None:
        table, refused = oracle_selections(query_pools, method.oracle, budgets)
        return table, {"oracle_refused": [{"query_id": r.query_id, "reason": r.reason} for r in refused]}
    selector = method_selector(method, mmr_lambda=mmr_lambda, tau=tau, ranker=ranker)
    if method.covers == "gold":
        return select_budgeted(query_pools, selector, budgets, covers=lambda p: p.gold_labels().astype(float)), {}
    if method.covers is None:
        return select_budgeted(query_pools, selector, budgets), {}
    if coverage is None or trust is None:
        raise ValueError(f"{method.name} reads an estimated coverage matrix: give coverage and the estimator's trust")
    rows_of = dict(tuple(coverage.groupby("query_id", sort=False)))
    estimated = {q: p for q, p in query_pools.items() if q in rows_of}
    details = {"fell_back": not trust.trusted, "estimator_gate": trust.reason, "queries": len(estimated)}
    if not trust.trusted:
        return select_budgeted(estimated, RelevanceOrder(), budgets), details
    return select_budgeted(estimated, selector, budgets,
                           covers=lambda p: query_matrix(p.doc_ids, rows_of[p.query_id], ESTIMATED)), details


@dataclass(frozen=True)
class OracleRefusal:
    """A query whose viewpoint inventory is too large for an exact DP, with the oracle's message."""
    query_id: str
    reason: str


def oracle_selections(query_pools: Mapping[str, QueryPool], which: str, budgets: Sequence[int]
                      ) -> tuple[pd.DataFrame, list[OracleRefusal]]:
    """The exact `which` ("rvc1" or "rvc2") oracle's item set at every budget (models/oracles.py), in pool
    order, over the gold matrices. Queries without viewpoints have no RVC and are skipped; queries whose
    inventory the DP refuses are listed with the reason, never approximated."""
    oracle = {"rvc1": lambda p, b: rvc1_oracle(p.gold, p.pool.tokens, b, query_id=p.query_id),
              "rvc2": lambda p, b: rvc2_oracle(p.gold, p.pool.tokens, p.pool.source_units, b,
                                               query_id=p.query_id)}[which]
    rows, refused = [], []
    for query_id, query_pool in sorted(query_pools.items()):
        if query_pool.gold_labels().shape[1] == 0:
            continue
        try:
            results = [(budget, oracle(query_pool, int(budget))) for budget in budgets]
        except ValueError as error:
            refused.append(OracleRefusal(query_id, str(error)))
            continue
        rows += [(query_id, budget, rank, query_pool.doc_ids[i])
                 for budget, result in results for rank, i in enumerate(result.items, start=1)]
    return _selections(rows), refused


def _selections(rows: list[tuple]) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=list(BUDGETED_SELECTIONS.columns))
    return BUDGETED_SELECTIONS.conform(frame, source="budgeted selections")


def topic_folds(queries: pd.DataFrame, n_folds: int, seed: int) -> dict[str, int]:
    """query_id -> fold (0..n_folds-1) for topic-grouped cross-validation: the queries of one topic share a
    fold; topics are shuffled with `seed`, then each goes to the fold holding the fewest queries so far
    (ties to the lower fold), so folds are balanced in queries."""
    topics = queries.groupby("topic", sort=True)["query_id"].apply(list)
    if not 2 <= n_folds <= len(topics):
        raise ValueError(f"topic-grouped cross-validation needs 2 <= folds <= topics; got {n_folds} folds for "
                         f"{len(topics)} topics")
    order = np.random.default_rng(seed).permutation(len(topics))
    sizes = np.zeros(n_folds, dtype=int)
    fold_of = {}
    for position in order:
        fold = int(np.argmin(sizes))
        for query_id in topics.iloc[position]:
            fold_of[query_id] = fold
        sizes[fold] += len(topics.iloc[position])
    return fold_of


@dataclass(frozen=True)
class FoldRanker:
    """The LMVU ranker of one cross-validation fold: trained on `train`, C chosen on `dev` (another fold of
    the training topics), applied to the queries of `fold`."""
    fold: int
    trained: TrainedLMVU
    train: tuple[str, ...]
    dev: tuple[str, ...]


def cross_validated_lmvu(query_pools: Mapping[str, QueryPool], folds: Mapping[str, int], budgets: Sequence[int],
                         fit: Callable[[list[LabelledPool], list[LabelledPool]], TrainedLMVU]
                         ) -> tuple[pd.DataFrame, list[FoldRanker]]:
    """LMVU under topic-grouped cross-validation: for each fold f, a ranker fit on the other folds (C chosen
    on fold f + 1 mod K, trained on the rest; `fit(train, dev)`) selects for the queries of fold f, so every
    query is selected once by a ranker that never saw its topic."""
    n_folds = max(folds.values()) + 1
    rankers = []
    for fold in range(n_folds):
        dev_fold = (fold + 1) % n_folds
        train = [q for q in sorted(query_pools) if folds[q] not in (fold, dev_fold)]
        dev = [q for q in sorted(query_pools) if folds[q] == dev_fold]
        trained = fit(labelled_pools(query_pools, train), labelled_pools(query_pools, dev))
        rankers.append(FoldRanker(fold, trained, tuple(train), tuple(dev)))
    selections = select_budgeted(query_pools, lambda q: LMVU(rankers[folds[q]].trained.ranker), budgets)
    return selections, rankers


def labelled_pools(query_pools: Mapping[str, QueryPool], query_ids: Iterable[str]) -> list[LabelledPool]:
    """The LabelledPools of `query_ids` that have viewpoints (a query without any has no true gain)."""
    return [query_pools[q].labelled() for q in query_ids if query_pools[q].gold_labels().shape[1]]


def fit_lmvu(budgets: Sequence[int], **settings) -> Callable[[list[LabelledPool], list[LabelledPool]], TrainedLMVU]:
    """`train_lmvu` at the token budgets of the comparison, with the given training settings."""
    return lambda train, dev: train_lmvu(train, dev, [Budget(tokens=int(b)) for b in budgets], **settings)


def comparison_figures(selections: Mapping[str, pd.DataFrame], query_pools: Mapping[str, QueryPool],
                       nugget_links: pd.DataFrame, alpha: float) -> pd.DataFrame:
    """COMPARISON_FIGURES of every method's selections: per query and budget RVC1, RVC2, tokens, IOU against
    the gold evidence (pool documents linked to a nugget of the query), redundancy, and for ordered methods
    alpha-nDCG@10 and StRecall@10 of the selection order (ir_measures, models/metrics.py). Queries without
    viewpoints have no RVC; IOU is left out when nothing is selected and nothing is gold.

    A method is measured on every pool of `query_pools`, except the exact oracles and the methods on
    estimated coverage, which are measured on the queries their selections name (the oracle skips refused
    inventories; an estimated matrix exists for the evaluated splits only). A measured query with nothing
    selected at a budget (no item fits) scores 0 coverage at that budget."""
    rows = []
    no_qrels = pd.DataFrame({"query_id": [], "doc_id": [], "relevance": []})
    for name, table in sorted(selections.items()):
        method = METHOD[name]
        measured = (sorted(set(table["query_id"])) if method.oracle or method.covers in ("estimated", "estimated_gold")
                    else sorted(query_pools))
        chosen = {(q, b): r.sort_values("rank")["doc_id"].tolist()
                  for (q, b), r in table.groupby(["query_id", "budget"])}
        for budget in sorted(set(table["budget"])):
            for query_id in measured:
                rows += _set_measures(name, int(budget), query_pools[query_id], chosen.get((query_id, budget), []))
            if method.ordered:
                run = table[(table["budget"] == budget) & table["query_id"].isin(measured)]
                ranked = evaluate_run(run, nugget_links, no_qrels, k=RANK_CUTOFF, alpha=alpha)
                ranked = ranked[ranked["metric"].isin(RATE_METRICS)]
                scored = set(ranked["query_id"])
                rows += [(name, int(budget), q, query_pools[q].split, m, v)
                         for q, m, v in ranked[["query_id", "metric", "value"]].itertuples(index=False)]
                rows += [(name, int(budget), q, query_pools[q].split, m, 0.0) for q in measured if q not in scored
                         for m in (f"alpha_ndcg@{RANK_CUTOFF}", f"strecall@{RANK_CUTOFF}")]
    frame = pd.DataFrame(rows, columns=list(COMPARISON_FIGURES.columns))
    return COMPARISON_FIGURES.conform(frame, source="comparison_figures")


def _set_measures(method: str, budget: int, query_pool: QueryPool, doc_ids: list[str]) -> list[tuple]:
    index = {d: i for i, d in enumerate(query_pool.doc_ids)}
    chosen = np.array([index[d] for d in doc_ids], dtype=np.int64)
    pool, gold = query_pool.pool, query_pool.gold_labels()
    values = {"tokens": float(pool.tokens[chosen].sum()), "redundancy": redundancy(pool.embeddings, chosen)}
    evidence = query_pool.doc_ids[gold.any(axis=1)]
    if len(chosen) or len(evidence):
        values["iou"] = iou(doc_ids, evidence)
    if gold.shape[1]:
        values["rvc1"] = rvc1(gold, chosen)
        values["rvc2"] = rvc2(gold, pool.source_units, chosen)
    return [(method, budget, query_pool.query_id, query_pool.split, metric, value)
            for metric, value in values.items()]


def method_rvc1(method: BudgetedMethod, query_pools: Mapping[str, QueryPool], budgets: Sequence[int],
                nugget_links: pd.DataFrame, *, alpha: float, **settings) -> tuple[float, dict[int, float]]:
    """One method's RVC1 as the comparison reports it: its selections (`run_method` with `settings`) over
    `query_pools` (of one split) measured by `comparison_figures` and averaged over the queries with
    viewpoints per budget (models/report.method_means); (the mean over `budgets` of those means, budget ->
    mean; NaN where no query has viewpoints). The LMVU ranker's dev score for champion promotion, on the tune
    split's pools."""
    splits = sorted({p.split for p in query_pools.values()})
    if len(splits) > 1:
        raise ValueError(f"method_rvc1 scores the pools of one split; got {splits}")
    table, _ = run_method(method, query_pools, budgets, **settings)
    means = method_means(comparison_figures({method.name: table}, query_pools, nugget_links, alpha))
    rvc1_means = means[means["metric"] == "rvc1"].set_index("budget")["value"]
    by_budget = {int(b): float(rvc1_means.get(b, np.nan)) for b in budgets}
    return float(np.mean(list(by_budget.values()))), by_budget


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
    for metric, oracle in (("rvc1", "oracle_rvc1"), ("rvc2", "oracle_rvc2")):
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
            nugget_links: pd.DataFrame, *, alpha: float, baseline: str, seed: int) -> Comparison:
    """Every method's selections over the pools of `query_pools` (the reported queries) measured, averaged,
    set against the exact oracles and compared pairwise (`comparison_pairs`)."""
    reported = {name: table[table["query_id"].isin(set(query_pools))] for name, table in selections.items()}
    figures = comparison_figures(reported, query_pools, nugget_links, alpha)
    names = [m.name for m in BUDGETED_METHODS if m.name in reported]
    return Comparison(figures, summary_table(figures, names), headroom_table(figures),
                      paired_table(figures, comparison_pairs(names, baseline), seed))


def method_protocols(protocol: str, splits: Sequence[str], tune_split: str) -> dict[str, str]:
    """How each method met its training data under `protocol` (for the report)."""
    estimated = f"standard split: the estimator trained on train, selections for {'/'.join(splits)} queries only"
    trained = ("refit per topic-grouped fold (C chosen on another fold of the training topics)"
               if protocol == "grouped_cv" else f"fit on train, C chosen on {tune_split}")
    return {m.name: (trained if m.trained else estimated if m.covers in ("estimated", "estimated_gold")
                     else "gold labels (bound)" if m.covers == "gold" else "no training")
            for m in BUDGETED_METHODS}


def comparison_pairs(methods: Iterable[str], baseline: str = "relevance") -> list[tuple[str, str]]:
    """Every method against `baseline`, and LMVU against MMR (the issue's two questions)."""
    methods = list(methods)
    pairs = [(m, baseline) for m in methods if m != baseline and baseline in methods]
    if {"lmvu", "mmr"} <= set(methods):
        pairs.append(("lmvu", "mmr"))
    return pairs


def markdown(table: pd.DataFrame, digits: int = 4) -> str:
    """A table as Markdown for metadata and the closing note ("n/a" when empty)."""
    return table.round(digits).to_markdown() if len(table) else "n/a"

