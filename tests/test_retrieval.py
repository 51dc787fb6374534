"""Whole-corpus retrieval and its evidence metrics (METHODS.md §4 "Metric"): exact top-k against a brute-force
sort, P@k / R@k / IE@k by hand and against ir_measures, and the paired summary."""

import ir_measures
import numpy as np
import pandas as pd
import pytest
from ir_measures import P, R

from covlab.models import retrieval
from covlab.models.retrieval import (RETRIEVAL_RUN, dense_top_k, evidence_metrics, ranking_problems, retrieval_summary,
                                     run_table, top_k)


def unit_rows(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    vectors = rng.normal(size=(n, d))
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def ranked(query_id: str, method: str, chunk_ids: list[str]) -> pd.DataFrame:
    return pd.DataFrame({"query_id": query_id, "method": method, "rank": range(1, len(chunk_ids) + 1),
                         "chunk_id": chunk_ids, "score": -np.arange(len(chunk_ids), dtype=float)})


def figures_by_key(rows: pd.DataFrame) -> dict:
    return {(q, m, metric): v for q, m, metric, v in rows.itertuples(index=False)}


# --- top-k ----------------------------------------------------------------------------------------------------

def test_top_k_equals_stable_descending_sort_under_many_ties():
    """Scores drawn from 4 values: most rows tie at the k-th score, where argpartition alone picks arbitrarily."""
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 4, size=(50, 30)).astype(float)
    for k in (1, 3, 7, 29, 30, 45):
        indices, values = top_k(scores, k)
        expected = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(indices, expected)
        np.testing.assert_array_equal(values, np.take_along_axis(scores, expected, axis=1))


def test_dense_top_k_equals_brute_force_for_any_batch_size():
    rng = np.random.default_rng(1)
    queries, chunks = unit_rows(rng, 37, 16), unit_rows(rng, 200, 16)
    cosines = queries @ chunks.T
    expected = np.argsort(-cosines, axis=1, kind="stable")[:, :7]
    for batch_size in (1, 5, 37, 256):
        indices, scores = dense_top_k(queries, chunks, k=7, batch_size=batch_size)
        np.testing.assert_array_equal(indices, expected)
        np.testing.assert_allclose(scores, np.take_along_axis(cosines, expected, axis=1))


def test_dense_top_k_breaks_ties_by_lower_chunk_index():
    """Chunks e0, e1, e0, e2, e1 against query e0: cosines 1, 0, 1, 0, 0 exactly."""
    basis = np.eye(3)
    indices, scores = dense_top_k(basis[[0]], basis[[0, 1, 0, 2, 1]], k=3)
    assert indices.tolist() == [[0, 2, 1]] and scores.tolist() == [[1.0, 1.0, 0.0]]


def test_dense_top_k_scores_one_batch_at_a_time(monkeypatch):
    rng = np.random.default_rng(2)
    seen = []

    def recording_top_k(scores, k):
        seen.append(scores.shape)
        return top_k(scores, k)

    monkeypatch.setattr(retrieval, "top_k", recording_top_k)
    dense_top_k(unit_rows(rng, 23, 8), unit_rows(rng, 40, 8), k=5, batch_size=10)
    assert seen == [(10, 40), (10, 40), (3, 40)]


def test_dense_top_k_refuses_vectors_that_are_not_unit():
    rng = np.random.default_rng(3)
    chunks = unit_rows(rng, 5, 4)
    chunks[3] *= 2
    with pytest.raises(ValueError, match="chunk_vectors row 3 has L2 norm 2"):
        dense_top_k(unit_rows(rng, 2, 4), chunks, k=2)


# --- run table ------------------------------------------------------------------------------------------------

def test_run_table_ranks_from_one():
    run = run_table("dense", ["q1", "q2"], np.array([[2, 0], [1, 2]]), np.array([[0.9, 0.5], [0.8, 0.1]]),
                    ["a", "b", "c"])
    assert list(run.columns) == list(RETRIEVAL_RUN.columns)
    assert run[["query_id", "rank", "chunk_id"]].values.tolist() == [["q1", 1, "c"], ["q1", 2, "a"],
                                                                     ["q2", 1, "b"], ["q2", 2, "c"]]
    assert run["score"].tolist() == [0.9, 0.5, 0.8, 0.1] and set(run["method"]) == {"dense"}


def test_run_table_refuses_an_index_outside_the_chunks():
    with pytest.raises(ValueError, match="query q2 has chunk index 3 at rank 2"):
        run_table("dense", ["q1", "q2"], np.array([[0, 1], [1, 3]]), np.zeros((2, 2)), ["a", "b", "c"])


# --- evidence metrics -----------------------------------------------------------------------------------------

@pytest.fixture
def toy():
    """q1: evidence c1, c3 among five 100-token chunks (the budget never binds).
    q2: evidence d1, d3, d4; d1-d3 have 400 tokens, d4 has 10. With a 1024-token budget dense keeps d1, d2
    (800 tokens); d3 would make 1200, so the walk stops there and d4, which would still fit, is not added.
    bm25 ranks only d3, d4 for q2 (410 tokens, both kept) and nothing for q1.
    q3 is evaluated but has no evidence; q4 has evidence and run rows but is not evaluated."""
    tokens = pd.Series({"c1": 100, "c2": 100, "c3": 100, "c4": 100, "c5": 100,
                        "d1": 400, "d2": 400, "d3": 400, "d4": 10})
    evidence = pd.DataFrame({"query_id": ["q1", "q1", "q2", "q2", "q2", "q4"],
                             "chunk_id": ["c1", "c3", "d3", "d1", "d4", "c2"]})
    run = pd.concat([ranked("q1", "dense", ["c1", "c2", "c3", "c4", "c5"]),
                     ranked("q2", "dense", ["d1", "d2", "d3", "d4"]),
                     ranked("q2", "bm25", ["d3", "d4"]),
                     ranked("q3", "dense", ["c1"]),
                     ranked("q4", "dense", ["c2"])], ignore_index=True)
    return run, evidence, tokens


def test_evidence_metrics_by_hand(toy):
    run, evidence, tokens = toy
    figures = evidence_metrics(run, evidence, tokens, query_ids=["q1", "q2", "q3"])
    got = figures_by_key(figures.rows)
    expected = {
        # q1 dense: evidence at ranks 1 and 3 of 5
        ("q1", "dense"): {"P@1": 1, "R@1": 1 / 2, "P@3": 2 / 3, "R@3": 1, "P@5": 2 / 5, "R@5": 1},
        # q1 bm25: ranked nothing, so it found nothing
        ("q1", "bm25"): {"P@1": 0, "R@1": 0, "P@3": 0, "R@3": 0, "P@5": 0, "R@5": 0},
        # q2 dense: kept d1, d2; only d1 is evidence, whatever the cutoff
        ("q2", "dense"): {"P@1": 1, "R@1": 1 / 3, "P@3": 1 / 3, "R@3": 1 / 3, "P@5": 1 / 5, "R@5": 1 / 3},
        # q2 bm25: d3, d4 kept, both evidence
        ("q2", "bm25"): {"P@1": 1, "R@1": 1 / 3, "P@3": 2 / 3, "R@3": 2 / 3, "P@5": 2 / 5, "R@5": 2 / 3},
    }
    ie = {("q1", "dense"): (1 / 2, 2 / 3, 2 / 5), ("q1", "bm25"): (0, 0, 0),
          ("q2", "dense"): (1 / 3, 1 / 9, 1 / 15), ("q2", "bm25"): (1 / 3, 4 / 9, 4 / 15)}
    for (q, m), (ie1, ie3, ie5) in ie.items():
        expected[q, m] |= {"IE@1": ie1, "IE@3": ie3, "IE@5": ie5, "IE": (ie1 + ie3 + ie5) / 3}
    assert set(got) == {(q, m, metric) for (q, m), values in expected.items() for metric in values}
    for (q, m), values in expected.items():
        for metric, value in values.items():
            assert got[q, m, metric] == pytest.approx(value), (q, m, metric)
    assert figures.without_evidence == ["q3"]


def test_a_larger_budget_lets_the_cut_chunks_count(toy):
    """With 1300 tokens q2's dense run keeps d1, d2, d3 (1200) and d4 (1210): P@3 = 2/3, R@5 = 1."""
    run, evidence, tokens = toy
    got = figures_by_key(evidence_metrics(run, evidence, tokens, ["q2"], token_budget=1300).rows)
    assert got["q2", "dense", "P@3"] == pytest.approx(2 / 3)
    assert got["q2", "dense", "R@5"] == pytest.approx(1.0)


def test_unknown_chunk_is_refused(toy):
    run, evidence, tokens = toy
    run = pd.concat([run, ranked("q1", "bm25", ["c9"])], ignore_index=True)
    with pytest.raises(ValueError, match="ranks chunk c9 that chunk_tokens does not hold"):
        evidence_metrics(run, evidence, tokens, ["q1", "q2"])


def test_no_evaluated_query_with_evidence_gives_no_rows(toy):
    run, evidence, tokens = toy
    figures = evidence_metrics(run, evidence, tokens, ["q3"])
    assert figures.rows.empty and list(figures.rows.columns) == ["query_id", "method", "metric", "value"]
    assert figures.without_evidence == ["q3"]


def random_retrieval(seed: int, n_queries: int = 30, n_chunks: int = 60, depth: int = 8):
    """Runs of two methods over random chunks of 10 tokens (the 1024-token budget never binds) and 0-6
    evidence chunks per query."""
    rng = np.random.default_rng(seed)
    chunk_ids = [f"c{i}" for i in range(n_chunks)]
    query_ids = [f"q{i}" for i in range(n_queries)]
    run = pd.concat([run_table(method, query_ids, np.stack([rng.permutation(n_chunks)[:depth]
                                                           for _ in query_ids]),
                               np.tile(-np.arange(depth, dtype=float), (n_queries, 1)), chunk_ids)
                     for method in ("dense", "student")], ignore_index=True)
    evidence = pd.DataFrame([(q, chunk_ids[c]) for q in query_ids
                             for c in rng.choice(n_chunks, size=rng.integers(0, 7), replace=False)],
                            columns=["query_id", "chunk_id"])
    return run, evidence, pd.Series(10, index=chunk_ids), query_ids


def test_precision_and_recall_agree_with_ir_measures():
    run, evidence, tokens, query_ids = random_retrieval(seed=4)
    figures = evidence_metrics(run, evidence, tokens, query_ids)
    got = figures_by_key(figures.rows)
    qrels = [ir_measures.Qrel(q, c, 1) for q, c in evidence.itertuples(index=False)]
    measures = [P @ 1, P @ 3, P @ 5, R @ 1, R @ 3, R @ 5]
    for method in ("dense", "student"):
        own = run[run["method"] == method]
        scored = pd.DataFrame({"query_id": own["query_id"].astype(str), "doc_id": own["chunk_id"].astype(str),
                               "score": -own["rank"].astype(float)})
        reference = list(ir_measures.iter_calc(measures, qrels, scored))
        assert {m.query_id for m in reference} == set(evidence["query_id"])
        for m in reference:
            assert got[m.query_id, method, str(m.measure)] == pytest.approx(m.value), (m.query_id, method, m.measure)
    assert set(figures.without_evidence) == set(query_ids) - set(evidence["query_id"])
    assert figures.without_evidence  # the draw includes queries without evidence


# --- summary --------------------------------------------------------------------------------------------------

def test_retrieval_summary_means_and_paired_differences():
    run, evidence, tokens, query_ids = random_retrieval(seed=5)
    run = pd.concat([run, run[run["method"] == "dense"].assign(method="bm25")], ignore_index=True)
    rows = evidence_metrics(run, evidence, tokens, query_ids).rows
    summary, paired = retrieval_summary(rows, baseline="dense", seed=0)

    assert summary.index.tolist() == ["bm25", "dense", "student"]
    assert summary.columns.tolist() == ["P@1", "P@3", "P@5", "R@1", "R@3", "R@5", "IE@1", "IE@3", "IE@5", "IE"]
    means = rows.groupby(["method", "metric"])["value"].mean()
    for method in summary.index:
        for metric in summary.columns:
            assert summary.loc[method, metric] == pytest.approx(means[method, metric])

    assert [tuple(r) for r in paired[["method", "metric"]].itertuples(index=False)] == [
        (m, metric) for m in ("bm25", "student") for metric in ("IE@1", "IE@3", "IE@5", "IE")]
    assert set(paired["baseline"]) == {"dense"}
    for row in paired.itertuples(index=False):
        a = rows[(rows["method"] == row.method) & (rows["metric"] == row.metric)]["value"]
        b = rows[(rows["method"] == "dense") & (rows["metric"] == row.metric)]["value"]
        assert row.mean_difference == pytest.approx(a.mean() - b.mean())
        assert row.n == len(a) == len(b)
    copy = paired[paired["method"] == "bm25"]  # bm25 is a copy of the baseline: every query ties
    assert (copy["mean_difference"] == 0).all() and (copy["ties"] == copy["n"]).all()


def test_retrieval_summary_refuses_a_missing_baseline():
    run, evidence, tokens, query_ids = random_retrieval(seed=6)
    rows = evidence_metrics(run, evidence, tokens, query_ids).rows
    with pytest.raises(ValueError, match="baseline 'bm25' has no rows"):
        retrieval_summary(rows, baseline="bm25")


def test_ranking_problems():
    run = pd.DataFrame({"query_id": ["q"] * 3, "method": ["m"] * 3, "rank": [1, 2, 3], "chunk_id": ["a", "b", "c"],
                        "score": [3.0, 2.0, 1.0]})
    assert ranking_problems(run, {"a", "b", "c"}) == []
    assert ranking_problems(run, {"a", "b"}) == ["chunk 'c' is not a chunk of the corpus"]
    assert ranking_problems(run.assign(rank=[1, 2, 4]), {"a", "b", "c"}) == ["m / q: ranks are not 1..3"]
    assert ranking_problems(run.assign(chunk_id=["a", "a", "c"]), {"a", "c"}) == ["m / q: a chunk is ranked twice"]
