"""Subquestion sets for a query (METHODS.md §1, "Decompose"): from gold nuggets, or grounded in the pool.

Two HEURISTIC offline stand-ins for the LLM decomposer, neither a method from the paper; both need no LLM
and cannot ask about facets that no pool sentence states:
- `grounded_subquestions` clusters the sentences of the query's top pool documents and takes the sentence
  nearest each cluster centre, largest cluster first: facets of the pool, whatever their relation to the
  question. `grounded_decomposition` runs it over every query;
- `focused_subquestions` picks pool sentences one at a time by relevance to the query and novelty among
  those already picked (maximal marginal relevance over sentences), dropping near-duplicates of each pick:
  facets of the question, as the pool states them. `focused_decomposition` runs it over every query with each
  distinct sentence encoded once per dataset.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from sklearn.cluster import KMeans

from covlab.models.encoders import Progress, ProgressReport

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


def grounded_decomposition(queries: pd.DataFrame, pool_texts: Mapping[str, Sequence[str]],
                           embed: Callable[[list[str]], np.ndarray], *, n: int = 10,
                           max_query_similarity: float = 0.9, seed: int = 0,
                           progress: Callable[[ProgressReport], None] | None = None) -> pd.DataFrame:
    """`grounded_subquestions` for every query of `queries` (query_id, text) over its pool documents' texts
    (`pool_texts`: query_id -> texts, best first), with done/total, rate and ETA in queries sent to `progress`.

    Each query's texts are encoded in a call of their own, the query and its sentences, unlike the focused
    decomposition's one call per dataset: an encoder's floats move in the last digits with the batch a text
    shares, and the pick of a two-sentence cluster (both members equidistant from its centre) follows those
    digits, so one call per dataset would change the subquestions of many queries (in a trial on ArgKP, 15 of
    62)."""
    tracker = Progress("grounded subquestions", len(queries), progress, unit="queries")
    frames = []
    for query_id, text in zip(queries["query_id"], queries["text"]):
        frames.append(grounded_subquestions(query_id, text, list(pool_texts.get(query_id, [])), embed, n=n,
                                            max_query_similarity=max_query_similarity, seed=seed))
        tracker.update(1)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=SUBQUESTIONS_COLUMNS)


# The pool documents, best first, whose sentences the offline decompositions read (the subquestions asset's
# pool_depth default, and what a served selection decomposes over).
POOL_DEPTH = 20


@dataclass(frozen=True)
class FocusSettings:
    """The focused decomposition's settings [chosen, untuned]: `n` subquestions per query; a pick maximises
    `focus_lambda` * cos(s, q) - (1 - `focus_lambda`) * max cos(s, picked); a sentence with cosine above
    `duplicate_similarity` to a pick is dropped as its duplicate, one above `max_query_similarity` to the query
    as a restatement of the question (it names no facet)."""
    n: int = 10
    focus_lambda: float = 0.7
    duplicate_similarity: float = 0.9
    max_query_similarity: float = 0.9

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"subquestions n must be at least 1; got {self.n}")
        for name in ("focus_lambda", "duplicate_similarity", "max_query_similarity"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"subquestions {name} must lie in [0, 1]; got {value}")


def focused_subquestions(query_id: str, query_vector: np.ndarray, sentences: Sequence[str], vectors: np.ndarray,
                         settings: FocusSettings = FocusSettings()) -> pd.DataFrame:
    """Up to `settings.n` of a query's pool `sentences` (unit-length `vectors`, one row each), in pick order:
    each step the sentence with the best relevance-minus-redundancy score (FocusSettings) among those neither
    restating the query nor duplicating a pick; ties go to the earlier sentence."""
    relevance = vectors @ query_vector if len(sentences) else np.empty(0)
    alive = relevance <= settings.max_query_similarity
    redundancy = np.zeros(len(sentences))
    picked: list[int] = []
    while alive.any() and len(picked) < settings.n:
        score = settings.focus_lambda * relevance - (1 - settings.focus_lambda) * redundancy
        pick = int(np.argmax(np.where(alive, score, -np.inf)))
        picked.append(pick)
        similarity = vectors @ vectors[pick]
        redundancy = np.maximum(redundancy, similarity)
        alive &= similarity <= settings.duplicate_similarity
        alive[pick] = False
    return pd.DataFrame({"query_id": query_id, "subq_id": [f"{query_id}/f{i}" for i in range(len(picked))],
                         "text": [sentences[i] for i in picked]}, columns=SUBQUESTIONS_COLUMNS)


def focused_decomposition(queries: pd.DataFrame, pool_texts: Mapping[str, Sequence[str]],
                          embed: Callable[[list[str]], np.ndarray],
                          settings: FocusSettings = FocusSettings()) -> pd.DataFrame:
    """`focused_subquestions` for every query of `queries` (query_id, text) over the sentences of its pool
    documents' texts (`pool_texts`: query_id -> texts, best first), with every distinct query and sentence text
    of the dataset encoded in one `embed` call."""
    sentences = {q: list(dict.fromkeys(s for text in pool_texts.get(q, []) for s in split_sentences(text)))
                 for q in queries["query_id"]}
    distinct = list(dict.fromkeys([*queries["text"], *(s for found in sentences.values() for s in found)]))
    vectors = embed(distinct)
    row = {text: i for i, text in enumerate(distinct)}
    frames = [focused_subquestions(q, vectors[row[t]], sentences[q], vectors[[row[s] for s in sentences[q]]]
                                   .reshape(len(sentences[q]), vectors.shape[1]), settings)
              for q, t in zip(queries["query_id"], queries["text"])]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=SUBQUESTIONS_COLUMNS)

