"""Evaluation of selection runs with ir_measures only (METHODS.md §5): alpha-nDCG@k and StRecall@k from
ndeval (pyndeval provider) over per-nugget diversity qrels, and for datasets whose nuggets are graded vital or okay
(TREC RAG 2024) StRecall@k over the vital nuggets alone; P@k and nDCG@k from pytrec_eval over
one-judgment-per-document qrels; and the calibration of coverage probabilities against 0/1 labels (Brier
score, expected calibration error), as the estimator's training and checks report it.

Behaviour worth knowing (checked in tests/test_metrics.py):
- ndeval builds the ideal ranking greedily, ties toward the lexicographically largest doc id; that ideal is
  not always optimal, so alpha-nDCG can exceed 1 for a ranking better than ndeval's ideal.
- The diversity qrels (one row per document and nugget) must never reach P@k or nDCG@k: pytrec_eval
  collapses the rows silently (P@10 0.275 instead of 0.6125 on ArgKP dev, no warning).
- Each measure is evaluated in its own ir_measures call: the pyndeval provider consumes the run once, so
  two measures that need different ndeval settings (alpha_nDCG with alpha != 0.5 next to StRecall) would
  leave the second one silently at 0.
- Both libraries skip queries without judgments. Here every query of the run gets a row: a query without
  any judgment for a measure scores 0 for it (nothing relevant can be retrieved), explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ir_measures
import numpy as np
import pandas as pd
from ir_measures import P, StRecall, alpha_nDCG, nDCG

from covlab.models.schemas import FULL_SUPPORT, PER_QUERY_METRICS

NDEVAL_MAX_CUTOFF = 20  # ndeval's compiled limit
CALIBRATION_BINS = 10  # equal-width probability bins of the expected calibration error
# The rank cutoff of the ranked-list measures (alpha-nDCG, StRecall) of a token-budgeted selection, which has
# no k of its own (METHODS.md §5).
RANK_CUTOFF = 10


@dataclass(frozen=True)
class Measure:
    """A measure by name, with an optional rank cutoff, as ir_measures names its measures: `ALPHA_NDCG @ 10`
    is the measure whose rows every table calls "alpha_ndcg@10" (`str(measure)`, its one spelling)."""
    name: str
    cutoff: int | None = None
    description: str = ""

    def __matmul__(self, cutoff: int) -> Measure:
        return replace(self, cutoff=int(cutoff))

    def __str__(self) -> str:
        return self.name if self.cutoff is None else f"{self.name}@{self.cutoff}"


ALPHA_NDCG = Measure("alpha_ndcg", description="alpha-nDCG (Clarke et al. 2008; ndeval's greedy ideal), METHODS.md §5")
STRECALL = Measure("strecall", description="subtopic recall: covered nuggets / nuggets with a relevant document")
VITAL_STRECALL = Measure("vital_strecall", description="subtopic recall over the vital nuggets only (TREC RAG 2024's "
                         "strict vital score): vital nuggets fully supported in the top k / vital nuggets with a fully "
                         "supporting document")
PRECISION = Measure("p", description="precision over the document judgments (pytrec_eval)")
NDCG = Measure("ndcg", description="nDCG over the document judgments (pytrec_eval)")
RVC1 = Measure("rvc1", description="share of viewpoints with at least one selected supporting item (METHODS.md §2)")
RVC2 = Measure("rvc2", description="1/2 per viewpoint for one supporting source unit, 1 for two or more (§2)")
IOU = Measure("iou", description="|S ∩ G| / |S ∪ G| against the gold evidence items (METHODS.md §3)")
REDUNDANCY = Measure("redundancy", description="mean pairwise cosine inside the selection (METHODS.md §3)")
TOKENS = Measure("tokens", description="tokens the selection spends")
EVIDENCE_PRECISION = Measure("P", description="retrieved evidence chunks / k (MCompassRAG, METHODS.md §4)")
EVIDENCE_RECALL = Measure("R", description="retrieved evidence chunks / the query's evidence chunks (§4)")
IE = Measure("IE", description="P@k x R@k (METHODS.md §4); without a cutoff, its mean over the cutoffs")


def diversity_qrels(nugget_links: pd.DataFrame) -> list[ir_measures.Qrel]:
    """One qrel per (query, doc, nugget) with `iteration` = nugget id: the subtopic qrels ndeval reads
    (a grade >= 1 counts as covering). For alpha-nDCG and StRecall only, never for P@k or nDCG@k."""
    _require(nugget_links, ("query_id", "doc_id", "nugget_id", "grade"), "nugget_links")
    return [ir_measures.Qrel(str(q), str(d), int(g), str(n)) for q, d, n, g in
            nugget_links[["query_id", "doc_id", "nugget_id", "grade"]].itertuples(index=False)]


def binary_qrels(qrels: pd.DataFrame) -> list[ir_measures.Qrel]:
    """One qrel per (query, doc) — the document judgments P@k and nDCG@k need (relevance as given:
    P counts relevance >= 1, nDCG uses it as gain). Duplicate pairs are refused: that is the multi-row
    trap pytrec_eval would swallow silently."""
    _require(qrels, ("query_id", "doc_id", "relevance"), "qrels")
    duplicated = qrels.duplicated(["query_id", "doc_id"])
    if duplicated.any():
        first = tuple(qrels.loc[duplicated, ["query_id", "doc_id"]].iloc[0])
        raise ValueError(f"qrels has duplicate query_id/doc_id {first}; expected one judgment per document "
                         "(per-nugget rows belong in diversity_qrels)")
    return [ir_measures.Qrel(str(q), str(d), int(r)) for q, d, r in
            qrels[["query_id", "doc_id", "relevance"]].itertuples(index=False)]


def vital_nuggets(nuggets: pd.DataFrame) -> set[tuple[str, str]] | None:
    """(query_id, nugget_id) of every nugget graded vital; None when the nuggets carry no importance (the optional
    column of models/schemas.py NUGGETS), which leaves the vital-only measure out."""
    if "importance" not in nuggets.columns:
        return None
    vital = nuggets[nuggets["importance"] == "vital"]
    return set(zip(vital["query_id"].astype(str), vital["nugget_id"].astype(str)))


def evaluate_run(run: pd.DataFrame, nugget_links: pd.DataFrame, qrels: pd.DataFrame, k: int = 10,
                 alpha: float = 0.5, vital: set[tuple[str, str]] | None = None) -> pd.DataFrame:
    """PER_QUERY_METRICS for a run (query_id, doc_id, rank; rank 1 first): alpha_ndcg@k and strecall@k
    (ndeval, alpha as given), p@k and ndcg@k (pytrec_eval), and with `vital` ((query_id, nugget_id) of the vital
    nuggets, `vital_nuggets`) vital_strecall@k: StRecall over the full-support links (grade FULL_SUPPORT) of those
    nuggets alone. Every query of the
    run gets every metric; judgments of queries outside the run are ignored."""
    if not 1 <= k <= NDEVAL_MAX_CUTOFF:
        raise ValueError(f"k must be between 1 and {NDEVAL_MAX_CUTOFF} (ndeval's cutoff limit); got {k}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must lie in [0, 1]; got {alpha}")
    scored = _scored_run(run)
    query_ids = sorted(set(scored["query_id"]))
    in_run = set(query_ids)
    links = nugget_links[nugget_links["query_id"].isin(in_run)]
    judged = qrels[qrels["query_id"].isin(in_run)]
    measures = {  # name -> (measure, qrels); each measure its own call (module docstring)
        str(ALPHA_NDCG @ k): (alpha_nDCG(alpha=alpha) @ k, diversity_qrels(links)),
        str(STRECALL @ k): (StRecall @ k, diversity_qrels(links)),
        str(PRECISION @ k): (P @ k, binary_qrels(judged)),
        str(NDCG @ k): (nDCG @ k, binary_qrels(judged)),
    }
    if vital is not None:  # TREC RAG's strict vital score: a vital nugget is met by a passage that fully supports it
        nuggets = pd.MultiIndex.from_arrays([links["query_id"].astype(str), links["nugget_id"].astype(str)])
        strict = links[nuggets.isin(list(vital)) & (links["grade"] >= FULL_SUPPORT)]
        measures[str(VITAL_STRECALL @ k)] = (StRecall @ k, diversity_qrels(strict))
    rows = []
    for name, (measure, measure_qrels) in measures.items():
        values = ({m.query_id: m.value for m in ir_measures.iter_calc([measure], measure_qrels, scored)}
                  if measure_qrels else {})
        rows += [{"query_id": q, "metric": name, "value": float(values.get(q, 0.0))} for q in query_ids]
    return PER_QUERY_METRICS.conform(pd.DataFrame(rows, columns=list(PER_QUERY_METRICS.columns)),
                                     source="evaluate_run")


def brier_score(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean squared difference between p(covered) and the 0/1 label."""
    labels, probs = _labelled(labels, probs)
    return float(np.mean((probs - labels) ** 2))


def expected_calibration_error(labels: np.ndarray, probs: np.ndarray, bins: int = CALIBRATION_BINS) -> float:
    """ECE over `bins` equal-width probability bins: sum over bins of (share of pairs) * |mean p - covered
    share| (Naeini et al. 2015; the last bin includes p = 1)."""
    labels, probs = _labelled(labels, probs)
    which = np.minimum((probs * bins).astype(int), bins - 1)
    error = 0.0
    for b in np.unique(which):
        inside = which == b
        error += inside.mean() * abs(probs[inside].mean() - labels[inside].mean())
    return float(error)


def _labelled(labels: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    labels, probs = np.asarray(labels, dtype=float), np.asarray(probs, dtype=float)
    if labels.shape != probs.shape or labels.ndim != 1 or len(labels) == 0:
        raise ValueError(f"labels and probabilities must be equal-length non-empty 1-D arrays; got shapes "
                         f"{labels.shape} and {probs.shape}")
    if not np.isin(labels, (0, 1)).all() or not ((probs >= 0) & (probs <= 1)).all():
        raise ValueError("labels must be 0/1 and probabilities lie in [0, 1]")
    return labels, probs


def _scored_run(run: pd.DataFrame) -> pd.DataFrame:
    """The run as ir_measures' (query_id, doc_id, score) with score = -rank, so that both libraries'
    descending-score order is exactly our rank order."""
    _require(run, ("query_id", "doc_id", "rank"), "run")
    for key in (["query_id", "doc_id"], ["query_id", "rank"]):
        duplicated = run.duplicated(key)
        if duplicated.any():
            raise ValueError(f"run has duplicate {'/'.join(key)} {tuple(run.loc[duplicated, key].iloc[0])}; "
                             "expected each document once per query with distinct ranks")
    ordered = run.sort_values(["query_id", "rank"], kind="stable")  # pyndeval groups consecutive query rows
    return pd.DataFrame({"query_id": ordered["query_id"].astype(str).to_numpy(),
                         "doc_id": ordered["doc_id"].astype(str).to_numpy(),
                         "score": -ordered["rank"].to_numpy(dtype=float)})


def _require(frame: pd.DataFrame, columns: tuple[str, ...], name: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{name} is missing column(s) {missing}; expected columns {list(columns)}")
