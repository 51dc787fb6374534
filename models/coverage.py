"""Tables of the Decompose, Estimate, Select pipeline (METHODS.md §1): pool x subquestion pairs, judged
coverage, estimator training pairs, estimated coverage matrices. Framework-free; assets call these."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pandas as pd

from covlab.models.runtime import DEFAULT_RUNTIME
from covlab.models.schemas import COVERAGE_MATRIX, JUDGMENTS, document_text

COVERED_RATING = 4  # CRUX: a rating >= 4 counts as covered
GOLD_RATING = (0, 5)  # [chosen] gold links as ratings: unlinked 0, linked 5


def document_texts(corpus: pd.DataFrame) -> dict[str, str]:
    """doc_id -> the text models read (schemas.document_text, as the BM25 index reads it)."""
    return {d: document_text(t, x) for d, t, x in corpus[["doc_id", "title", "text"]].itertuples(index=False)}


def queries_of(queries: pd.DataFrame, splits: Sequence[str]) -> pd.DataFrame:
    chosen = queries[queries["split"].isin(list(splits))]
    if chosen.empty:
        raise ValueError(f"no queries in split(s) {list(splits)}; the dataset has "
                         f"{sorted(queries['split'].unique())}")
    return chosen


def pool_pairs(pools: pd.DataFrame, subquestions: pd.DataFrame, queries: pd.DataFrame,
               depth: int | None = None) -> pd.DataFrame:
    """Every (pool document within `depth`, subquestion) pair of `queries`, with the query's split:
    (query_id, doc_id, subq_id, split), ordered by query, pool rank, subquestion."""
    pool = pools if depth is None else pools[pools["rank"] <= depth]
    pool = pool.merge(queries[["query_id", "split"]], on="query_id")
    pairs = pool[["query_id", "doc_id", "rank", "split"]].merge(subquestions[["query_id", "subq_id"]], on="query_id")
    return pairs.sort_values(["query_id", "rank", "subq_id"]).drop(columns="rank").reset_index(drop=True)


def gold_labels(pairs: pd.DataFrame, nugget_links: pd.DataFrame) -> np.ndarray:
    """Whether each (query_id, doc_id, subq_id = nugget id) pair is linked with a grade > 0."""
    linked = set(map(tuple, nugget_links.loc[nugget_links["grade"] > 0, ["query_id", "doc_id", "nugget_id"]]
                     .itertuples(index=False)))
    return np.array([(q, d, s) in linked for q, d, s in pairs[["query_id", "doc_id", "subq_id"]]
                     .itertuples(index=False)], dtype=bool)


def gold_judgments(pairs: pd.DataFrame, nugget_links: pd.DataFrame) -> pd.DataFrame:
    """Judge (pool document, nugget) pairs by the dataset's links ([chosen]: rating 5 if linked, else 0);
    pairs' subq_id must be nugget ids."""
    covered = gold_labels(pairs, nugget_links)
    return JUDGMENTS.conform(pairs.assign(covered=covered, rating=np.where(covered, GOLD_RATING[1], GOLD_RATING[0])))


def rated_judgments(pairs: pd.DataFrame, ratings: Sequence[int]) -> pd.DataFrame:
    """Judgments from LLM ratings 0-5: covered iff rating >= 4 (METHODS.md §1, CRUX)."""
    ratings = np.asarray(ratings, dtype=np.int64)
    return JUDGMENTS.conform(pairs.assign(rating=ratings, covered=ratings >= COVERED_RATING))


def labelled_pairs(judgments: pd.DataFrame, subquestions: pd.DataFrame, texts: dict[str, str]) -> pd.DataFrame:
    """Judgments with their texts: (query_id, doc_id, nugget_id, subquestion, text, label), the long
    coverage table the estimator and the bi-encoder train on."""
    text_of_subq = dict(zip(subquestions["subq_id"], subquestions["text"]))
    return pd.DataFrame({"query_id": judgments["query_id"].to_numpy(), "doc_id": judgments["doc_id"].to_numpy(),
                         "nugget_id": judgments["subq_id"].to_numpy(),
                         "subquestion": judgments["subq_id"].map(text_of_subq).to_numpy(),
                         "text": judgments["doc_id"].map(texts).to_numpy(),
                         "label": judgments["covered"].astype("int64").to_numpy()})


def training_pairs(judgments: pd.DataFrame, subquestions: pd.DataFrame, texts: dict[str, str], split: str,
                   negatives_per_positive: float | None, seed: int, max_pairs: int | None = None) -> pd.DataFrame:
    """Labelled pairs of one split for the estimator: every covered pair and, when `negatives_per_positive`
    is set, a seeded sample of that many uncovered pairs per covered one; then, when `max_pairs` is set, a
    seeded sample of at most that many pairs."""
    rows = judgments[judgments["split"] == split]
    if rows.empty:
        raise ValueError(f"no judged pairs in split {split!r}; judged splits are {sorted(judgments['split'].unique())}")
    positives, negatives = rows[rows["covered"]], rows[~rows["covered"]]
    if negatives_per_positive is not None and len(negatives) > negatives_per_positive * len(positives):
        negatives = negatives.sample(n=int(negatives_per_positive * max(len(positives), 1)), random_state=seed)
    chosen = pd.concat([positives, negatives])
    if max_pairs is not None and len(chosen) > max_pairs:
        chosen = chosen.sample(n=max_pairs, random_state=seed)
    chosen = chosen.sort_values(["query_id", "doc_id", "subq_id"])
    return labelled_pairs(chosen, subquestions, texts).reset_index(drop=True)


def held_out_figures(score: Callable[[list[tuple[str, str]]], np.ndarray],
                     pairs: pd.DataFrame) -> dict[str, float] | None:
    """A coverage estimator's figures on labelled (subquestion, text) `pairs`, as its training measures its kept
    epoch on dev: dev_auc (ROC-AUC), dev_brier, dev_ece; None when the pairs lack a covered or an uncovered pair
    (ROC-AUC is then undefined)."""
    from sklearn.metrics import roc_auc_score

    from covlab.models.metrics import brier_score, expected_calibration_error

    if pairs.empty or pairs["label"].nunique() < 2:
        return None
    probs = score(list(zip(pairs["subquestion"], pairs["text"])))
    labels = pairs["label"].to_numpy()
    return {"dev_auc": float(roc_auc_score(labels, probs)), "dev_brier": brier_score(labels, probs),
            "dev_ece": expected_calibration_error(labels, probs)}


def estimate_coverage(pairs: pd.DataFrame, subquestions: pd.DataFrame, texts: dict[str, str],
                      score: Callable[[list[tuple[str, str]]], np.ndarray]) -> pd.DataFrame:
    """The estimated coverage matrix: `score` (the estimator) over every (subquestion, document) pair."""
    text_of_subq = dict(zip(subquestions["subq_id"], subquestions["text"]))
    probabilities = score(list(zip(pairs["subq_id"].map(text_of_subq), pairs["doc_id"].map(texts))))
    return COVERAGE_MATRIX.conform(pairs.assign(probability=np.asarray(probabilities, dtype=np.float64)))


class KnownPairs:
    """Coverage probabilities another estimated matrix already holds, by (subquestion text, document text): a
    scorer wrapped by `reusing` takes a pair's probability from here and scores only the pairs not found, so that
    a pair two matrices share (the BM25 and the MCompass pools hold many of the same documents) is scored once.
    Only pairs the other matrix scored are known: a first stage's pruned pairs hold 0.0 there, and a scored pair
    is never exactly 0.0 (a sigmoid), so 0.0 is read as not scored. Valid only for a matrix of the same estimator
    version scored on the same runtime (the caller checks). `reused` counts the pairs answered from here."""

    def __init__(self, matrix: pd.DataFrame, subquestions: pd.DataFrame, texts: dict[str, str]):
        scored = matrix[matrix["probability"] > 0.0]
        text_of_subq = dict(zip(subquestions["subq_id"], subquestions["text"]))
        self.probabilities = dict(zip(zip(scored["subq_id"].map(text_of_subq), scored["doc_id"].map(texts)),
                                      scored["probability"].astype(np.float64)))
        self.reused = 0

    def reusing(self, score: Callable[[list[tuple[str, str]]], np.ndarray]
                ) -> Callable[[list[tuple[str, str]]], np.ndarray]:
        """`score` answering the known pairs from this table, in one call for the others."""
        def scored(pairs: list[tuple[str, str]]) -> np.ndarray:
            out = np.array([self.probabilities.get(pair, np.nan) for pair in pairs], dtype=np.float64)
            missing = np.flatnonzero(np.isnan(out))
            self.reused += len(pairs) - len(missing)
            if len(missing):
                out[missing] = np.asarray(score([pairs[i] for i in missing]), dtype=np.float64)
            return out

        return scored


def check_prune_top_m(top_m: int) -> int:
    """The first stage keeps at least one document per subquestion: `top_m`, or a ValueError naming it."""
    if top_m < 1:
        raise ValueError(f"prune_top_m must be >= 1, got {top_m}")
    return top_m


def first_stage_keep(pairs: pd.DataFrame, subquestions: pd.DataFrame, texts: dict[str, str],
                     embed: Callable[[list[str]], np.ndarray], top_m: int) -> np.ndarray:
    """Which pairs a cheap first stage keeps [chosen]: each subquestion's `top_m` pool documents by cosine
    under a bi-encoder (`embed`: texts -> unit vectors), ties by pair order (pool rank). Every distinct
    subquestion and document text is encoded once. Returns a boolean mask over `pairs`' rows."""
    check_prune_top_m(top_m)
    text_of_subq = dict(zip(subquestions["subq_id"], subquestions["text"]))
    questions, documents = pairs["subq_id"].map(text_of_subq), pairs["doc_id"].map(texts)
    distinct = list(dict.fromkeys([*questions, *documents]))
    vectors = embed(distinct)
    row = {text: i for i, text in enumerate(distinct)}
    cosine = np.einsum("ij,ij->i", vectors[questions.map(row).to_numpy()], vectors[documents.map(row).to_numpy()])
    ordered = pairs[["query_id", "subq_id"]].assign(negative=-cosine, order=np.arange(len(pairs)))
    ordered = ordered.sort_values(["query_id", "subq_id", "negative", "order"], kind="stable")
    keep = np.zeros(len(pairs), dtype=bool)
    keep[ordered["order"].to_numpy()[ordered.groupby(["query_id", "subq_id"]).cumcount().to_numpy() < top_m]] = True
    return keep


def estimate_coverage_pruned(pairs: pd.DataFrame, subquestions: pd.DataFrame, texts: dict[str, str],
                             score: Callable[[list[tuple[str, str]]], np.ndarray],
                             embed: Callable[[list[str]], np.ndarray], top_m: int) -> tuple[pd.DataFrame, np.ndarray]:
    """The estimated coverage matrix with a first stage [chosen]: the estimator scores only the pairs that
    `first_stage_keep` keeps (each subquestion's top_m documents by bi-encoder cosine); every other pair
    gets probability 0.0, i.e. counts as not covered without being scored. Returns (matrix over all
    `pairs`, the kept mask). Kept pairs get exactly the probability the full matrix gives them."""
    keep = first_stage_keep(pairs, subquestions, texts, embed, top_m)
    probability = np.zeros(len(pairs), dtype=np.float64)
    kept = pairs[keep]
    if len(kept):
        probability[keep] = estimate_coverage(kept, subquestions, texts, score)["probability"].to_numpy()
    return COVERAGE_MATRIX.conform(pairs.assign(probability=probability)), keep


def save_estimator(trained, directory: str) -> None:
    """Save a trained estimator, cross-encoder or bi-encoder matcher, where load_estimator_scorer reads it."""
    from covlab.models import cross_encoder, matcher

    if isinstance(trained, matcher.TrainedMatcher):
        matcher.save_matcher(trained, directory)
    else:
        cross_encoder.save_cross_encoder(trained, None, directory)


def load_estimator_scorer(directory: str, *, batch_size: int, device, autocast_dtype=None,
                          progress: Callable[[str], None] | None = None, runtime: str = DEFAULT_RUNTIME
                          ) -> Callable[[list[tuple[str, str]]], np.ndarray]:
    """A saved coverage estimator, cross-encoder or bi-encoder matcher (by its covlab.json kind), as a
    function from (subquestion, document) pairs to coverage probabilities. A cross-encoder reads long
    documents as it was trained to (its saved window selection, models/windows.py), and runs, with its window
    scorer, on `runtime` (models/runtime.py); a matcher runs on torch."""
    from covlab.models import cross_encoder, matcher
    from covlab.models.encoders import read_info
    from covlab.models.windows import WindowSelection, select_windows

    if read_info(directory).get("kind") == matcher.KIND:
        return matcher.load_matcher_scorer(directory, batch_size=batch_size, device=device,
                                           autocast_dtype=autocast_dtype, progress=progress)
    model, tokenizer, info = cross_encoder.load_cross_encoder(directory, device, runtime)
    max_length, windows = info.get("max_length", 256), WindowSelection.from_info(info.get("windows"))

    def score(pairs: list[tuple[str, str]]) -> np.ndarray:
        read = select_windows(pairs, tokenizer, max_length, windows, batch_size=batch_size, device=device,
                              autocast_dtype=autocast_dtype, progress=progress, runtime=runtime)
        return cross_encoder.score_pairs(model, tokenizer, [(q, t) for (q, _), t in zip(pairs, read)],
                                         batch_size=batch_size, max_length=max_length, device=device,
                                         autocast_dtype=autocast_dtype, progress=progress)

    return score


def rank_pool_by(pools: pd.DataFrame, scores: pd.DataFrame, column: str) -> pd.DataFrame:
    """The pool re-ranked by the score `column` of `scores` (RELEVANCE_SCORES or POOL_SCORES, as
    models/registry.py PoolOrder names them; ties by the original rank): the order that
    breaks ties and fills the rest in greedy selection."""
    merged = pools.merge(scores[["query_id", "doc_id", column]], on=["query_id", "doc_id"])
    ordered = merged.sort_values(["query_id", column, "rank"], ascending=[True, False, True], kind="stable")
    return ordered.assign(rank=ordered.groupby("query_id").cumcount() + 1)[["query_id", "doc_id", "rank"]]
