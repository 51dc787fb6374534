"""Coverage-aware context selection (METHODS.md §1): greedy max-marginal coverage, its soft extension,
relevance order, the typed selectors that choose among them (`RelevanceSelection`, `GreedyCoverage`,
`SoftGreedyCoverage`) and the per-query driver that turns a pool and a coverage table (its columns named
by a `CoverageColumns`) into a run; and how far a selection may trust the coverage estimate it reads (the
blend with the fallback order, tuned on dev, and the estimator's trust gate).

Conventions shared by every selector here: a selection is an array of distinct document indices in
selection order; `tie_break` is a score per document (higher first, then lower index), which is also the
order in which the remaining documents fill the selection once nothing adds coverage. That order is the
selection's fallback: what it returns when the estimate carries no information.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple, Sequence

import numpy as np
import pandas as pd

from covlab.models.metrics import evaluate_run
from covlab.models.schemas import SELECTIONS



@dataclass(frozen=True)
class CoverageColumns:
    """Where a long-form coverage table (query_id, doc_id, <nugget>, <value>) keeps each pair's subquestion
    and its value M[d, v]."""
    nugget: str
    value: str


# An estimated COVERAGE_MATRIX (models/coverage.py): the estimator's probability per (document, subquestion).
ESTIMATED = CoverageColumns(nugget="subq_id", value="probability")
# A NUGGET_LINKS table: the gold grade per (document, nugget).
GOLD = CoverageColumns(nugget="nugget_id", value="grade")


def relevance_order(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the top-`k` documents by score, ties by lower index (the relevance baseline)."""
    scores = _scores(scores, "scores")
    _check_k(k)
    return np.argsort(-scores, kind="stable")[:k]


def greedy_coverage(covers: np.ndarray, tie_break: np.ndarray, k: int) -> np.ndarray:
    """Indices of min(k, n_docs) documents: each step the document covering the most uncovered
    subquestions (METHODS.md §1, LANCER code), ties by `tie_break` (higher first, then lower index); once
    no candidate adds coverage, the rest in `tie_break` order.

    `covers` is the binary matrix M[d, v] (n_docs, n_subquestions), bool or 0/1."""
    covers = np.asarray(covers)
    if covers.ndim != 2:
        raise ValueError(f"covers must be a 2-D (n_docs, n_subquestions) matrix; got shape {covers.shape}")
    if covers.dtype != bool and not np.isin(covers, (0, 1)).all():
        raise ValueError("covers must be boolean or 0/1; got values "
                         f"{np.unique(covers[~np.isin(covers, (0, 1))])[:5].tolist()}")
    # With 0/1 probabilities the expected new coverage is exactly the count of newly covered subquestions.
    return _greedy_expected_coverage(covers.astype(float), tie_break, k)


def soft_greedy_coverage(probs: np.ndarray, tie_break: np.ndarray, k: int) -> np.ndarray:
    """[chosen extension, METHODS.md §1] Greedy on expected coverage: each step the document maximising
    sum_j p_dj * prod_{s in S} (1 - p_sj), the expected number of newly covered subquestions under the
    estimator's probabilities p (n_docs, n_subquestions) in [0, 1]. Ties and fill as `greedy_coverage`;
    ties are exact float equality. Equals `greedy_coverage` when p is 0/1."""
    return _greedy_expected_coverage(_probabilities(probs), tie_break, k)


def blended_soft_greedy(probs: np.ndarray, tie_break: np.ndarray, k: int, weight: float) -> np.ndarray:
    """Soft greedy blended with its fallback order, so that an uninformative estimate degrades toward that
    order instead of away from it [chosen]. Each step the document maximising

        weight * g_d / m + (1 - weight) * f_d,

    g_d the expected number of newly covered subquestions (`soft_greedy_coverage`), m the number of
    subquestions, f_d = 1 - (r_d - 1) / n the fallback score of the document at rank r_d of the n in
    `tie_break` order. weight 0 is exactly the fallback order, weight 1 exactly `soft_greedy_coverage`;
    `choose_blend_weight` picks the weight on the tune split."""
    _check_weight(weight)
    return _greedy_expected_coverage(_probabilities(probs), tie_break, k, weight)


def _check_weight(weight: float) -> None:
    if not 0 <= weight <= 1:
        raise ValueError(f"weight must lie in [0, 1]; got {weight!r}")


def _probabilities(probs: np.ndarray) -> np.ndarray:
    probs = np.asarray(probs, dtype=float)
    if probs.ndim != 2:
        raise ValueError(f"probs must be a 2-D (n_docs, n_subquestions) matrix; got shape {probs.shape}")
    outside = ~((probs >= 0) & (probs <= 1))  # also catches NaN
    if outside.any():
        raise ValueError(f"probs must lie in [0, 1]; got {probs[outside][:5].tolist()}")
    return probs


def _greedy_expected_coverage(probs: np.ndarray, tie_break: np.ndarray, k: int, weight: float = 1.0) -> np.ndarray:
    """The greedy loop shared by the hard, soft and blended selectors. Rows are visited in tie-break order,
    so `argmax` (first maximum) resolves ties by tie_break, then index. The blended score is computed
    times m (weight * g + (1 - weight) * m * f, the same order), so that weight 1 adds an exact 0 and
    reproduces the unblended gains bit for bit."""
    n_docs, n_subquestions = probs.shape
    tie_break = _scores(tie_break, "tie_break")
    if tie_break.shape != (n_docs,):
        raise ValueError(f"tie_break must have one score per document ({n_docs}); got shape {tie_break.shape}")
    _check_k(k)
    order = relevance_order(tie_break, n_docs)
    ranked = probs[order]
    fallback = (1.0 - weight) * n_subquestions * (1.0 - np.arange(n_docs) / max(n_docs, 1))
    uncovered = np.ones(n_subquestions)  # prod_{s in S} (1 - p_sj): probability subquestion j is still open
    available = np.ones(n_docs, dtype=bool)
    chosen: list[int] = []
    size = min(k, n_docs)
    while len(chosen) < size:
        scores = np.where(available, weight * (ranked @ uncovered) + fallback, -np.inf)
        best = int(np.argmax(scores))
        if scores[best] <= 0:
            break
        chosen.append(best)
        available[best] = False
        uncovered *= 1.0 - ranked[best]
    chosen += np.flatnonzero(available)[: size - len(chosen)].tolist()
    return order[np.asarray(chosen, dtype=int)]


def coverage_curve(covers: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Number of subquestions covered by the first 1, 2, ..., len(order) documents of `order`."""
    covers = np.asarray(covers, dtype=bool)
    order = np.asarray(order, dtype=int)
    if covers.ndim != 2:
        raise ValueError(f"covers must be a 2-D (n_docs, n_subquestions) matrix; got shape {covers.shape}")
    if len(order) == 0:
        return np.zeros(0, dtype=int)
    return np.logical_or.accumulate(covers[order], axis=0).sum(axis=1)


@dataclass(frozen=True)
class RelevanceSelection:
    """The relevance baseline: the first k documents in fallback order (`relevance_order` of `tie_break`);
    reads no coverage."""
    name: ClassVar[str] = "relevance"

    def __call__(self, values: np.ndarray, tie_break: np.ndarray, k: int) -> np.ndarray:
        return relevance_order(tie_break, k)


@dataclass(frozen=True)
class GreedyCoverage:
    """Greedy max-marginal coverage (METHODS.md §1) on the binary matrix M[d, v] = value >= `threshold`
    (gold links: grade >= 1; judgments: rating >= 4; estimator: p >= tau = 0.3), blended with the fallback
    order by `weight` (`blended_soft_greedy` on the 0/1 matrix): weight 1, the default, is
    `greedy_coverage` itself, weight 0 the fallback order."""
    threshold: float
    weight: float = 1.0
    name: ClassVar[str] = "greedy"

    def __post_init__(self):
        _check_weight(self.weight)

    def __call__(self, values: np.ndarray, tie_break: np.ndarray, k: int) -> np.ndarray:
        return blended_soft_greedy((values >= self.threshold).astype(float), tie_break, k, self.weight)


@dataclass(frozen=True)
class SoftGreedyCoverage:
    """[chosen extension, METHODS.md §1] Soft greedy on the values themselves (probabilities in [0, 1]),
    blended with the fallback order by `weight` (`blended_soft_greedy`): weight 1, the default, is
    `soft_greedy_coverage` itself, weight 0 the fallback order."""
    weight: float = 1.0
    name: ClassVar[str] = "soft_greedy"

    def __post_init__(self):
        _check_weight(self.weight)

    def __call__(self, values: np.ndarray, tie_break: np.ndarray, k: int) -> np.ndarray:
        return blended_soft_greedy(values, tie_break, k, self.weight)


# The selectors that read a coverage table, blended with their fallback order by their `weight`.
CoverageSelector = GreedyCoverage | SoftGreedyCoverage
# Every k-document selector (the token-budgeted ones are models/budgeted.Selector): called as
# selector(values, tie_break, k) on one query's M[d, v] values (n_docs, n_subquestions), it returns the indices
# of the documents it selects.
KSelector = RelevanceSelection | CoverageSelector


def select_per_query(pool: pd.DataFrame, selector: KSelector, k: int, coverage: pd.DataFrame | None = None,
                     columns: CoverageColumns = GOLD) -> pd.DataFrame:
    """A SELECTIONS run: for every query of `pool` (a POOLS table), the `k` documents `selector` chooses.

    Ties and fill follow the pool rank (rank 1 first): a reranked pool carries the bi-encoder order.
    `coverage` is long-form (query_id, doc_id, <columns.nugget>, <columns.value>); the default columns read
    a NUGGET_LINKS table. A coverage selector needs it; `RelevanceSelection` reads none. The subquestions
    of a query are those named in its coverage rows; pool documents without rows cover nothing; a query
    without rows falls back to the pool order."""
    if not isinstance(selector, KSelector):
        raise TypeError(f"expected a selector (RelevanceSelection, GreedyCoverage or SoftGreedyCoverage); "
                        f"got {selector!r}")
    _check_k(k)
    pool = _ranked_pool(pool)
    by_query = _coverage_by_query(coverage, selector, columns)
    frames = []
    for query_id, docs in pool.groupby("query_id", sort=True):
        doc_ids = docs["doc_id"].to_numpy()
        chosen = selector(query_matrix(doc_ids, by_query.get(query_id), columns),
                          -docs["rank"].to_numpy(dtype=float), k)
        frames.append(pd.DataFrame({"query_id": query_id, "rank": np.arange(1, len(chosen) + 1),
                                    "doc_id": doc_ids[chosen]}))
    return SELECTIONS.conform(pd.concat(frames, ignore_index=True) if frames else SELECTIONS.empty(),
                              source="select_per_query")


@dataclass(frozen=True)
class BlendChoice:
    """The blend weight of a coverage selector chosen on the tune split, with its evidence: the mean
    `metric` of every candidate weight there. The weight-0 score is the fallback order's own."""
    weight: float
    scores: dict[float, float]
    metric: str
    split: str
    queries: int

    @property
    def fallback_score(self) -> float:
        return self.scores[0.0]

    def evidence(self) -> dict:
        """JSON-ready: the chosen weight, the split and metric it was chosen by, the score of every weight."""
        return {"weight": self.weight, "split": self.split, "metric": self.metric, "queries": self.queries,
                "fallback_score": self.fallback_score, "chosen_score": self.scores[self.weight],
                "scores": {str(w): s for w, s in self.scores.items()}}


def choose_blend_weight(pool: pd.DataFrame, queries: pd.DataFrame, split: str, coverage: pd.DataFrame,
                        nugget_links: pd.DataFrame, weights: Sequence[float], k: int, alpha: float,
                        selector: CoverageSelector = SoftGreedyCoverage(),
                        columns: CoverageColumns = ESTIMATED) -> BlendChoice:
    """[chosen] The weight of `selector` (each candidate in `weights` replaces its own) with the best mean
    alpha-nDCG@k against the gold nuggets (models/metrics.py, ndeval) on the `split` queries of `pool`,
    ties toward the smaller weight (the fallback). `weights` must include 0, the pool order itself, so the
    chosen rule never scores below the fallback on that split. `queries` is a QUERIES table (query_id,
    split); `coverage` is long-form as in `select_per_query`, the default columns an estimated
    COVERAGE_MATRIX's."""
    grid = sorted({float(w) for w in weights})
    if 0.0 not in grid or not all(0 <= w <= 1 for w in grid):
        raise ValueError(f"blend weights must lie in [0, 1] and include 0 (the fallback order); got {list(weights)}")
    tuned = queries.loc[queries["split"] == split, "query_id"]
    tune_pool = pool[pool["query_id"].isin(tuned)]
    if tune_pool.empty:
        raise ValueError(f"no pooled queries in split {split!r} to choose the blend weight on; pooled splits "
                         f"are {sorted(queries.loc[queries['query_id'].isin(pool['query_id']), 'split'].unique())}")
    metric = f"alpha_ndcg@{k}"
    no_document_judgments = pd.DataFrame({"query_id": [], "doc_id": [], "relevance": []})  # alpha-nDCG reads links
    scores = {}
    for w in grid:
        run = select_per_query(tune_pool, replace(selector, weight=w), k, coverage, columns)
        measured = evaluate_run(run, nugget_links, no_document_judgments, k=k, alpha=alpha)
        scores[w] = float(measured.loc[measured["metric"] == metric, "value"].mean())
    best = max(grid, key=lambda w: (scores[w], -w))
    return BlendChoice(weight=best, scores=scores, metric=metric, split=split,
                       queries=int(tune_pool["query_id"].nunique()))


@dataclass(frozen=True)
class EstimateTrust:
    """What a selection on an estimated coverage matrix reads to decide how far to follow it
    (`select_trusting_estimate`): the estimator's dev ROC-AUC and the gate it must reach, the QUERIES table
    and the split the blend weight is tuned on with its gold nugget links, the candidate weights, and alpha
    of the alpha-nDCG that tunes them."""
    dev_auc: float
    min_dev_auc: float
    queries: pd.DataFrame
    tune_split: str
    nugget_links: pd.DataFrame
    weights: Sequence[float]
    alpha: float


def select_trusting_estimate(pool: pd.DataFrame, selector: CoverageSelector, k: int, coverage: pd.DataFrame,
                             columns: CoverageColumns, trust: EstimateTrust) -> tuple[pd.DataFrame, dict]:
    """A selection on an estimated coverage matrix that is never worse than its fallback, the pool order:
    below the estimator gate (`estimator_trusted`) the pool order itself; above it `selector` blended with
    the pool order by the weight chosen on the tune split (`choose_blend_weight`; it replaces the
    selector's own). Returns the run and the decision for metadata: fell_back, estimator_gate,
    estimator_dev_auc, and blend_weight with its dev evidence (`blend`) when the estimate is followed."""
    gate = estimator_trusted(trust.dev_auc, trust.min_dev_auc)
    decision = {"fell_back": not gate.trusted, "estimator_gate": gate.reason,
                "estimator_dev_auc": float(trust.dev_auc)}
    if not gate.trusted:
        return select_per_query(pool, RelevanceSelection(), k), decision
    choice = choose_blend_weight(pool, trust.queries, trust.tune_split, coverage, trust.nugget_links, trust.weights,
                                 k, trust.alpha, selector, columns)
    decision.update(blend_weight=choice.weight, blend=choice.evidence())
    return select_per_query(pool, replace(selector, weight=choice.weight), k, coverage, columns), decision


def select_method(pool: pd.DataFrame, selector: KSelector, k: int, coverage: pd.DataFrame | None = None,
                  columns: CoverageColumns = GOLD, trust: EstimateTrust | None = None) -> tuple[pd.DataFrame, dict]:
    """One method's SELECTIONS run over `pool` and its decision for metadata: with `trust` (the coverage is
    an estimate) through the estimator gate and the tuned blend (`select_trusting_estimate`), else
    `select_per_query` with an empty decision. The selection assets and the pool comparison both select
    through it."""
    if trust is None:
        return select_per_query(pool, selector, k, coverage, columns), {}
    return select_trusting_estimate(pool, selector, k, coverage, columns, trust)


class Trust(NamedTuple):
    """Whether a selection may follow the coverage estimator, and why (for metadata and messages)."""
    trusted: bool
    reason: str


def estimator_trusted(dev_auc: float, threshold: float) -> Trust:
    """The estimator gate [chosen]: a coverage estimator is followed only when its dev ROC-AUC reaches
    `threshold`; below it (or when it is not a number) selections keep their fallback order and the
    estimator is not promoted."""
    if not math.isfinite(dev_auc):
        return Trust(False, f"dev ROC-AUC is {dev_auc!r}, not a figure; the estimator cannot be judged")
    if dev_auc < threshold:
        return Trust(False, f"dev ROC-AUC {dev_auc:.4f} < {threshold:.4f}: the estimate is too close to chance "
                            "to select by")
    return Trust(True, f"dev ROC-AUC {dev_auc:.4f} >= {threshold:.4f}")


def _ranked_pool(pool: pd.DataFrame) -> pd.DataFrame:
    missing = [c for c in ("query_id", "doc_id", "rank") if c not in pool.columns]
    if missing:
        raise ValueError(f"pool is missing column(s) {missing}; expected a POOLS table (query_id, doc_id, rank, score)")
    for key in (["query_id", "doc_id"], ["query_id", "rank"]):
        duplicated = pool.duplicated(key)
        if duplicated.any():
            raise ValueError(f"pool has duplicate {'/'.join(key)} {tuple(pool.loc[duplicated, key].iloc[0])}; "
                             "expected one row per document and distinct ranks per query")
    return pool.sort_values(["query_id", "rank"], kind="stable")


def _coverage_by_query(coverage: pd.DataFrame | None, selector: KSelector,
                       columns: CoverageColumns) -> dict[str, pd.DataFrame]:
    if not isinstance(selector, CoverageSelector):
        return {}
    expected = ["query_id", "doc_id", columns.nugget, columns.value]
    if coverage is None:
        raise ValueError(f"{selector!r} needs a coverage table ({', '.join(expected)})")
    missing = [c for c in expected if c not in coverage.columns]
    if missing:
        raise ValueError(f"coverage is missing column(s) {missing}; expected columns {expected}")
    not_numeric = pd.to_numeric(coverage[columns.value], errors="coerce").isna().to_numpy()
    if not_numeric.any():
        first = int(not_numeric.argmax())
        raise ValueError(f"coverage.{columns.value} must be numeric; record {first} has "
                         f"{coverage[columns.value].iloc[first]!r}")
    duplicated = coverage.duplicated(expected[:3])
    if duplicated.any():
        raise ValueError(f"coverage has duplicate query_id/doc_id/{columns.nugget} "
                         f"{tuple(coverage.loc[duplicated, expected[:3]].iloc[0])}; expected one value per pair")
    return dict(tuple(coverage[expected].groupby("query_id", sort=False)))


def query_matrix(doc_ids: np.ndarray, rows: pd.DataFrame | None, columns: CoverageColumns) -> np.ndarray:
    """M[d, v] for one query: pool documents in pool order x the query's subquestions; absent pairs are 0."""
    if rows is None:
        return np.zeros((len(doc_ids), 0))
    wide = rows.pivot(index="doc_id", columns=columns.nugget, values=columns.value)
    return wide.reindex(index=doc_ids).fillna(0).to_numpy(dtype=float)


def _scores(values: np.ndarray, name: str) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    if values.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one score per document); got shape {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError(f"{name} must be finite; got {values[~np.isfinite(values)][:5].tolist()}")
    return values


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be a non-negative integer; got {k!r}")
