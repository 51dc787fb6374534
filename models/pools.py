"""Candidate-pool arithmetic that does not depend on the retriever."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from covlab.models.chunks import evidence
from covlab.models.schemas import POOLS


def merge_given_and_distractors(given: pd.DataFrame, hits: pd.DataFrame, distractors: int) -> pd.DataFrame:
    """Each query's given pool plus its first `distractors` BM25 hits that are not in it, re-ranked
    together by score (ties by doc_id)."""
    own = set(map(tuple, given[["query_id", "doc_id"]].itertuples(index=False)))
    outside = hits[[(q, d) not in own for q, d in hits[["query_id", "doc_id"]].itertuples(index=False)]]
    extra = outside.sort_values(["query_id", "rank"]).groupby("query_id").head(distractors)
    return rank_within_queries(pd.concat([given, extra], ignore_index=True))


def rank_within_queries(scored: pd.DataFrame) -> pd.DataFrame:
    """A POOLS table from (query_id, doc_id, score): rank 1 = highest score, ties by doc_id."""
    ordered = scored.sort_values(["query_id", "score", "doc_id"], ascending=[True, False, True], kind="stable")
    return POOLS.conform(ordered.assign(rank=ordered.groupby("query_id").cumcount() + 1))


def pools_from_chunk_run(run: pd.DataFrame, chunk_doc: Mapping[str, str], n: int | Mapping[str, int]) -> pd.DataFrame:
    """A POOLS table from one retriever's ranked chunks (query_id, chunk_id, rank, score; rank 1 first): each
    chunk stands for its document (`chunk_doc`: chunk id -> document id), a document enters at its first
    chunk in rank order with that chunk's score, its later chunks are passed over, and each query's pool is
    cut at its first `n` documents (one number for every query, or query id -> number; a query without one
    gets no pool), ranked 1.. in that order. Short-item corpora (chunk id == document id) keep the run as it
    is, cut at n."""
    sizes = n if isinstance(n, Mapping) else None
    for size in (sizes.values() if sizes is not None else [n]):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ValueError(f"pool sizes must be non-negative numbers of documents; got {size!r}")
    missing = [c for c in ("query_id", "chunk_id", "rank", "score") if c not in run.columns]
    if missing:
        raise ValueError(f"run is missing column(s) {missing}; expected one retriever's ranked chunks "
                         "(query_id, chunk_id, rank, score)")
    ordered = run.sort_values(["query_id", "rank"], kind="stable")
    doc_ids = ordered["chunk_id"].map(chunk_doc)
    unknown = ordered.loc[doc_ids.isna(), "chunk_id"]
    if len(unknown):
        raise ValueError(f"chunk(s) {sorted(set(unknown))[:5]} have no document; expected chunks of the corpus")
    documents = ordered.assign(doc_id=doc_ids).drop_duplicates(["query_id", "doc_id"])  # keeps the first
    place = documents.groupby("query_id").cumcount()
    cut = documents["query_id"].map(sizes).fillna(0) if sizes is not None else n
    pools = documents[place < cut]
    return POOLS.conform(pools.assign(rank=pools.groupby("query_id").cumcount() + 1), source="pools_from_chunk_run")


def evidence_documents(nugget_links: pd.DataFrame, qrels: pd.DataFrame) -> pd.DataFrame:
    """(query_id, doc_id) of every evidence document of a query: the rule of models/chunks.py `evidence` (a
    positive link grade or a positive relevance) on documents."""
    as_chunks = {"doc_id": "chunk_id"}
    pairs = evidence(nugget_links.rename(columns=as_chunks), qrels.rename(columns=as_chunks))
    return pairs.rename(columns={"chunk_id": "doc_id"})


def pool_agreement(pool: pd.DataFrame, reference: pd.DataFrame, evidence_docs: pd.DataFrame) -> dict:
    """How `pool` relates to a `reference` pool (both POOLS tables) over the queries of `pool`: their number,
    the mean pool size, the mean share of a pool's documents that the reference pool also holds (|P & R| /
    |P|), and, over the queries with evidence documents (`evidence_documents`), the mean share of a query's
    evidence documents inside each pool: the most of the evidence any selection from that pool can reach."""
    members = {name: frame.groupby("query_id")["doc_id"].apply(set).to_dict()
               for name, frame in (("pool", pool), ("reference", reference))}
    evident = evidence_docs.groupby("query_id")["doc_id"].apply(set).to_dict()
    queries = sorted(members["pool"])
    with_evidence = [q for q in queries if evident.get(q)]

    def mean(values: list[float]) -> float:
        return float(np.mean(values)) if values else float("nan")

    return {"queries": len(queries), "mean_pool_size": mean([len(members["pool"][q]) for q in queries]),
            "mean_overlap": mean([len(members["pool"][q] & members["reference"].get(q, set()))
                                  / len(members["pool"][q]) for q in queries]),
            "queries_with_evidence": len(with_evidence),
            "evidence_share": {name: mean([len(docs.get(q, set()) & evident[q]) / len(evident[q])
                                           for q in with_evidence]) for name, docs in members.items()}}
