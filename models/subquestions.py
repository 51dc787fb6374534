"""Subquestion sets for a query (METHODS.md §1, "Decompose"): from gold nuggets, or grounded in the pool.

`grounded_subquestions` is a HEURISTIC offline stand-in for the LLM decomposer, not a method from the
paper: it clusters the sentences of the query's top pool documents and takes the sentence nearest each
cluster centre as a "subquestion". It needs no LLM, and on corpora where facets are stated in distinct
sentences it finds them; it cannot ask about facets that no pool sentence states.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np
import pandas as pd
from sklearn.cluster import KMeans

SUBQUESTIONS_COLUMNS = ["query_id", "subq_id", "text"]
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'])")


def split_sentences(text: str, min_words: int = 4) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text) if len(s.split()) >= min_words]


def gold_subquestions(nuggets: pd.DataFrame) -> pd.DataFrame:
    """The dataset's nuggets as subquestions (the gold-nugget bound); subq_id = nugget_id."""
    return nuggets.rename(columns={"nugget_id": "subq_id"})[SUBQUESTIONS_COLUMNS].reset_index(drop=True)


def grounded_subquestions(query_id: str, query_text: str, pool_texts: list[str],
                          embed: Callable[[list[str]], np.ndarray], n: int = 10,
                          max_query_similarity: float = 0.9, seed: int = 0) -> pd.DataFrame:
    """Up to `n` representative pool sentences of one query (see the module docstring: a heuristic).

    Sentences nearly restating the query (cosine > max_query_similarity) are dropped; duplicates are
    merged; clusters are ordered by size, largest first, so the most supported facets come first."""
    sentences = list(dict.fromkeys(s for text in pool_texts for s in split_sentences(text)))
    if not sentences:
        return pd.DataFrame(columns=SUBQUESTIONS_COLUMNS)
    vectors = embed([query_text] + sentences)
    query, vectors = vectors[0], vectors[1:]
    keep = vectors @ query <= max_query_similarity
    sentences = [s for s, k in zip(sentences, keep) if k]
    vectors = vectors[keep]
    clusters = min(n, len(sentences))
    if clusters == 0:
        return pd.DataFrame(columns=SUBQUESTIONS_COLUMNS)
    kmeans = KMeans(n_clusters=clusters, n_init=4, random_state=seed).fit(vectors)
    chosen = []
    for label in np.argsort(-np.bincount(kmeans.labels_, minlength=clusters), kind="stable"):
        members = np.flatnonzero(kmeans.labels_ == label)
        distances = np.linalg.norm(vectors[members] - kmeans.cluster_centers_[label], axis=1)
        chosen.append(sentences[members[int(np.argmin(distances))]])
    return pd.DataFrame({"query_id": query_id, "subq_id": [f"{query_id}/g{i}" for i in range(len(chosen))],
                         "text": chosen})
