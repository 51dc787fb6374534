"""Whole-corpus retrieval for MCompassRAG (METHODS.md §4): exact top-k selection, the run table every
retriever (student, dense cosine, BM25, ablations) writes, and the evidence metrics the paper reports.

Evidence metric (METHODS.md §4 "Metric"): the ranked chunks are added to the context in rank order until
the token budget is spent. Here that is a truncation: the walk stops at the first chunk that does not fit,
and no later (smaller) chunk is tried in its place. P@k is the number of evidence chunks among the kept
chunks within the first k positions divided by k, R@k the same count divided by the query's number of
evidence chunks, IE@k = P@k * R@k, and IE the mean of IE@k over the cutoffs.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd

from covlab.models.metrics import EVIDENCE_PRECISION, EVIDENCE_RECALL, IE
from covlab.models.schemas import EVIDENCE_METRICS, RETRIEVAL_RUN
from covlab.models.statistics import paired_comparison

DEFAULT_KS = (1, 3, 5)
TOKEN_BUDGET = 1024  # the paper's 1K-token context budget
UNIT_NORM_TOLERANCE = 1e-3  # how far an embedding's L2 norm may stray from 1 (float16/float32 rounding)


class EvidenceFigures(NamedTuple):
    """EVIDENCE_METRICS rows of the evaluated queries that have evidence, and the evaluated queries without
    any (no recall can be defined for them, so they are reported rather than scored)."""
    rows: pd.DataFrame
    without_evidence: list[str]


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a 2-D score array (batch x n), the indices and scores of its k highest scores, highest
    first, equal scores by lower index. k larger than n returns all n columns.

    np.argpartition finds the k best in linear time but picks arbitrarily among scores equal to the k-th;
    a row with more such ties than places is re-picked by lowest index, so the result equals a stable
    descending sort of the whole row, cut at k."""
    scores = np.asarray(scores)
    if scores.ndim != 2:
        raise ValueError(f"scores must be a 2-D array (batch x candidates); got shape {scores.shape}")
    if k < 1:
        raise ValueError(f"k must be a positive number of results; got {k}")
    if np.isnan(scores).any():
        raise ValueError(f"scores row {int(np.flatnonzero(np.isnan(scores).any(axis=1))[0])} holds NaN; "
                         "expected comparable numbers")
    batch, n = scores.shape
    k = min(k, n)
    if k == n:
        chosen = np.broadcast_to(np.arange(n), (batch, n))
    else:
        chosen = np.argpartition(scores, n - k, axis=1)[:, n - k:]
        kth = np.take_along_axis(scores, chosen, axis=1).min(axis=1)
        for row in np.flatnonzero((scores >= kth[:, None]).sum(axis=1) > k):
            above = np.flatnonzero(scores[row] > kth[row])
            tied = np.flatnonzero(scores[row] == kth[row])[:k - len(above)]
            chosen[row] = np.concatenate([above, tied])
    values = np.take_along_axis(scores, chosen, axis=1)
    order = np.lexsort((chosen, -values.astype(float)), axis=1)  # float: negation must not wrap unsigned ints
    return np.take_along_axis(chosen, order, axis=1), np.take_along_axis(values, order, axis=1)


def dense_top_k(query_vectors: np.ndarray, chunk_vectors: np.ndarray, k: int,
                batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Exact cosine top-k of every query over all chunks: indices into `chunk_vectors` and cosines, each
    n_queries x min(k, n_chunks), highest first, ties by lower chunk index.

    Both sides must already be L2-normalised (cosine = dot product): normalising here would copy the whole
    chunk matrix. Queries are scored `batch_size` at a time, so the score matrix held at once is
    batch_size x n_chunks, never n_queries x n_chunks."""
    if k < 1:
        raise ValueError(f"k must be a positive number of results; got {k}")
    query_vectors, chunk_vectors = np.asarray(query_vectors), np.asarray(chunk_vectors)
    for name, vectors in (("query_vectors", query_vectors), ("chunk_vectors", chunk_vectors)):
        if vectors.ndim != 2:
            raise ValueError(f"{name} must be a 2-D array (rows x dimensions); got shape {vectors.shape}")
        _require_unit_rows(vectors, name)
    if query_vectors.shape[1] != chunk_vectors.shape[1]:
        raise ValueError(f"query_vectors have {query_vectors.shape[1]} dimensions but chunk_vectors "
                         f"{chunk_vectors.shape[1]}; expected embeddings of the same encoder")
    if len(chunk_vectors) == 0:
        raise ValueError("chunk_vectors is empty; expected at least one chunk to retrieve from")
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive number of queries; got {batch_size}")
    width = min(k, len(chunk_vectors))
    indices = np.empty((len(query_vectors), width), dtype=np.int64)
    cosines = np.empty((len(query_vectors), width), dtype=np.result_type(query_vectors, chunk_vectors))
    for start in range(0, len(query_vectors), batch_size):
        batch = slice(start, start + batch_size)
        indices[batch], cosines[batch] = top_k(query_vectors[batch] @ chunk_vectors.T, k)
    return indices, cosines


def within_token_budget(chunk_tokens: Sequence[int], token_budget: int) -> int:
    """How many of the ranked chunks whose token counts these are (in rank order) enter a context of
    `token_budget` tokens: the chunks in rank order up to the first that does not fit (module docstring), as
    `evidence_metrics` keeps them."""
    return int(np.searchsorted(np.cumsum(np.asarray(chunk_tokens, dtype=np.int64)), token_budget, side="right"))


def run_table(method: str, query_ids: Sequence[str], indices: np.ndarray, scores: np.ndarray,
              chunk_ids: Sequence[str]) -> pd.DataFrame:
    """RETRIEVAL_RUN of one method from top-k output: row i of `indices` (positions in `chunk_ids`) and
    `scores` ranks the chunks of query_ids[i], rank 1 first."""
    query_ids, chunk_ids = np.asarray(query_ids, dtype=object), np.asarray(chunk_ids, dtype=object)
    indices, scores = np.asarray(indices), np.asarray(scores)
    if indices.ndim != 2 or indices.shape != scores.shape or len(indices) != len(query_ids):
        raise ValueError(f"{method}: expected indices and scores of shape (len(query_ids), k) = "
                         f"({len(query_ids)}, k); got {indices.shape} and {scores.shape}")
    outside = (indices < 0) | (indices >= len(chunk_ids))
    if outside.any():
        row, column = np.argwhere(outside)[0]
        raise ValueError(f"{method}: query {query_ids[row]} has chunk index {indices[row, column]} at rank "
                         f"{column + 1}; expected an index into the {len(chunk_ids)} chunk ids")
    n_queries, k = indices.shape
    run = pd.DataFrame({"query_id": np.repeat(query_ids, k), "method": method,
                        "rank": np.tile(np.arange(1, k + 1), n_queries),
                        "chunk_id": chunk_ids[indices.ravel()], "score": scores.ravel()})
    return RETRIEVAL_RUN.conform(run, source=f"run_table({method})")


def evidence_metric_names(ks: Sequence[int] = DEFAULT_KS) -> list[str]:
    """The metrics evidence_metrics reports, in report order: P@k, R@k, IE@k for each k, then IE."""
    return [str(measure @ k) for measure in (EVIDENCE_PRECISION, EVIDENCE_RECALL, IE) for k in ks] + [str(IE)]


def evidence_metrics(run: pd.DataFrame, evidence: pd.DataFrame, chunk_tokens: pd.Series,
                     query_ids: Sequence[str], ks: Sequence[int] = DEFAULT_KS,
                     token_budget: int = TOKEN_BUDGET) -> EvidenceFigures:
    """P@k, R@k, IE@k and IE (module docstring) of every method in `run` on every evaluated query.

    `evidence` holds (query_id, chunk_id) pairs; `chunk_tokens` maps chunk id to its token count. A run's
    rank orders its rows and the cutoff k counts positions in that order. A method that ranked nothing for
    an evaluated query scores 0 on it (it retrieved no evidence). Evaluated queries without evidence are
    left out of the rows and listed in `without_evidence`; run rows and evidence of other queries do not
    enter the figures (the run is still checked whole)."""
    _require(run, tuple(RETRIEVAL_RUN.columns), "run")
    _require(evidence, ("query_id", "chunk_id"), "evidence")
    ks = _cutoffs(ks)
    if token_budget < 1:
        raise ValueError(f"token_budget must be a positive number of tokens; got {token_budget}")
    evaluated = [str(q) for q in query_ids]
    repeated = pd.Index(evaluated)[pd.Index(evaluated).duplicated()]
    if len(repeated):
        raise ValueError(f"query_ids has duplicates {repeated[:5].tolist()}; expected each evaluated query once")
    tokens = _token_counts(chunk_tokens)
    run = run.astype({"query_id": str, "method": str, "chunk_id": str})
    unknown = ~run["chunk_id"].isin(tokens.index)
    if unknown.any():
        first = run[unknown].iloc[0]
        raise ValueError(f"run ({first['method']}, query {first['query_id']}) ranks chunk {first['chunk_id']} "
                         "that chunk_tokens does not hold; expected a token count for every retrieved chunk")
    for key in (["query_id", "method", "rank"], ["query_id", "method", "chunk_id"]):
        duplicated = run.duplicated(key)
        if duplicated.any():
            raise ValueError(f"run has duplicate {'/'.join(key)} {tuple(run.loc[duplicated, key].iloc[0])}; "
                             "expected each chunk once per query and method, with distinct ranks")

    gold = evidence[["query_id", "chunk_id"]].astype(str).drop_duplicates()
    n_evidence = gold[gold["query_id"].isin(evaluated)].groupby("query_id").size()
    scored = [q for q in evaluated if q in n_evidence.index]
    methods = sorted(run["method"].unique())
    grid = pd.MultiIndex.from_product([scored, methods], names=["query_id", "method"])

    ranked = run[run["query_id"].isin(scored)].sort_values(["query_id", "method", "rank"], kind="stable")
    position = ranked.groupby(["query_id", "method"], sort=False).cumcount() + 1
    # Token counts are non-negative, so the running total exceeds the budget from the first chunk that does
    # not fit onwards: `kept` is exactly the prefix that fits (truncation, no skipping).
    chunk_tokens_in_rank = ranked["chunk_id"].map(tokens).astype("int64")
    spent = chunk_tokens_in_rank.groupby([ranked["query_id"], ranked["method"]], sort=False).cumsum()
    kept = spent <= token_budget
    is_evidence = pd.MultiIndex.from_frame(ranked[["query_id", "chunk_id"]]).isin(
        pd.MultiIndex.from_frame(gold))
    found = ranked.assign(found=kept & is_evidence)

    values = {}
    for k in ks:
        hits = (found[position <= k].groupby(["query_id", "method"])["found"].sum()
                .reindex(grid, fill_value=0).to_numpy(dtype=float))
        p, r, ie = str(EVIDENCE_PRECISION @ k), str(EVIDENCE_RECALL @ k), str(IE @ k)
        values[p] = hits / k
        values[r] = hits / n_evidence.reindex(grid.get_level_values("query_id")).to_numpy(dtype=float)
        values[ie] = values[p] * values[r]
    values[str(IE)] = np.mean([values[str(IE @ k)] for k in ks], axis=0)
    wide = pd.DataFrame({name: values[name] for name in evidence_metric_names(ks)}, index=grid)
    rows = wide.stack().rename("value").rename_axis(["query_id", "method", "metric"]).reset_index()
    return EvidenceFigures(EVIDENCE_METRICS.conform(rows, source="evidence_metrics"),
                           [q for q in evaluated if q not in n_evidence.index])


def retrieval_summary(rows: pd.DataFrame, baseline: str = "dense",
                      seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(summary, paired) from EVIDENCE_METRICS rows.

    summary: the mean of each metric over the queries, one row per method (index `method`, sorted), metrics
    as columns in the order they appear in `rows`. paired: for each other method and each IE metric
    (IE@k, IE), paired_comparison (models/statistics.py) of the method's per-query values (a) against the
    baseline's (b), one row per (method, metric) with columns method, baseline, metric and the
    comparison's fields; with no method besides the baseline it has only the first three columns."""
    _require(rows, tuple(EVIDENCE_METRICS.columns), "rows")
    duplicated = rows.duplicated(["query_id", "method", "metric"])
    if duplicated.any():
        first = tuple(rows.loc[duplicated, ["query_id", "method", "metric"]].iloc[0])
        raise ValueError(f"rows has duplicate query_id/method/metric {first}; expected one value each")
    methods = sorted(rows["method"].unique())
    if baseline not in methods:
        raise ValueError(f"baseline {baseline!r} has no rows; expected one of the methods {methods}")
    metrics = list(pd.unique(rows["metric"]))
    summary = (rows.groupby(["method", "metric"])["value"].mean().unstack("metric")
               .reindex(index=methods, columns=metrics).rename_axis(columns=None))

    per_query = rows.set_index(["method", "metric", "query_id"])["value"].sort_index()
    compared = [m for m in metrics if m == str(IE) or m.startswith(f"{IE.name}@")]
    records = [{"method": method, "baseline": baseline, "metric": metric,
                **paired_comparison(per_query.loc[(method, metric)], per_query.loc[(baseline, metric)], seed=seed)}
               for method in methods if method != baseline for metric in compared]
    paired = pd.DataFrame(records) if records else pd.DataFrame(columns=["method", "baseline", "metric"])
    return summary, paired


def _require_unit_rows(vectors: np.ndarray, name: str) -> None:
    norms = np.sqrt(np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64))
    off = np.flatnonzero(np.abs(norms - 1) > UNIT_NORM_TOLERANCE)
    if len(off):
        raise ValueError(f"{name} row {off[0]} has L2 norm {norms[off[0]]:.4g}; expected unit vectors "
                         "(L2-normalised embeddings)")


def _cutoffs(ks: Sequence[int]) -> list[int]:
    ks = list(ks)
    if not ks or len(set(ks)) != len(ks) or any(int(k) != k or k < 1 for k in ks):
        raise ValueError(f"ks must be distinct positive integer cutoffs; got {ks}")
    return [int(k) for k in ks]


def _token_counts(chunk_tokens: pd.Series) -> pd.Series:
    """chunk_tokens with string chunk ids, refused when ids repeat or counts are missing or negative."""
    tokens = pd.Series(chunk_tokens.to_numpy(), index=chunk_tokens.index.astype(str))
    repeated = tokens.index[tokens.index.duplicated()]
    if len(repeated):
        raise ValueError(f"chunk_tokens has duplicate chunk ids {repeated[:5].tolist()}; "
                         "expected one token count per chunk")
    counts = pd.to_numeric(tokens, errors="coerce")
    bad = counts.isna() | (counts < 0) | (counts != counts.round())
    if bad.any():
        raise ValueError(f"chunk {tokens.index[bad][0]} has token count {tokens[bad].iloc[0]}; "
                         "expected a non-negative integer")
    return counts.astype("int64")


def _require(frame: pd.DataFrame, columns: tuple[str, ...], name: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{name} is missing column(s) {missing}; expected columns {list(columns)}")


def ranking_problems(run: pd.DataFrame, chunk_ids: set[str]) -> list[str]:
    """What keeps a RETRIEVAL_RUN from being one ranking per (method, query) over known chunks (empty when
    nothing): ranks 1..n in order, no chunk twice, no chunk outside `chunk_ids`."""
    problems = [f"chunk {c!r} is not a chunk of the corpus" for c in sorted(set(run["chunk_id"]) - chunk_ids)[:5]]
    for (method, query_id), ranked in run.groupby(["method", "query_id"], sort=True):
        if sorted(ranked["rank"]) != list(range(1, len(ranked) + 1)):
            problems.append(f"{method} / {query_id}: ranks are not 1..{len(ranked)}")
        if ranked["chunk_id"].duplicated().any():
            problems.append(f"{method} / {query_id}: a chunk is ranked twice")
    return problems
