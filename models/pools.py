"""Candidate-pool arithmetic that does not depend on the retriever."""

from __future__ import annotations

import pandas as pd

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
