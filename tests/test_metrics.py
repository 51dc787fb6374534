"""Evaluation through ir_measures (METHODS.md §5): hand-computed alpha-nDCG, StRecall and vital-only StRecall,
ndeval's greedy ideal and its tie-break, P@10 against a hand count, the multi-row-qrels trap, and properties over
random instances checked against the definition; the calibration measures (Brier score, expected calibration
error) on a hand-computed answer."""

import math

import ir_measures
import numpy as np
import pandas as pd
import pytest
from ir_measures import P, alpha_nDCG

from covlab.models.metrics import (PER_QUERY_METRICS, binary_qrels, brier_score, diversity_qrels, evaluate_run,
                                   expected_calibration_error, vital_nuggets)
from covlab.models.schemas import FULL_SUPPORT


def links_frame(covers: dict[str, dict[str, list[str]]]) -> pd.DataFrame:
    """query -> doc -> covered nuggets, as a NUGGET_LINKS table (grade 1)."""
    return pd.DataFrame([{"query_id": q, "doc_id": d, "nugget_id": n, "grade": 1}
                         for q, docs in covers.items() for d, nuggets in docs.items() for n in nuggets],
                        columns=["query_id", "doc_id", "nugget_id", "grade"])


def run_frame(rankings: dict[str, list[str]]) -> pd.DataFrame:
    return pd.DataFrame([{"query_id": q, "doc_id": d, "rank": r}
                         for q, docs in rankings.items() for r, d in enumerate(docs, start=1)])


def qrels_frame(links: pd.DataFrame) -> pd.DataFrame:
    return links[["query_id", "doc_id"]].drop_duplicates().assign(relevance=1)


def metric(per_query: pd.DataFrame, query_id: str, name: str) -> float:
    return per_query.loc[(per_query["query_id"] == query_id) & (per_query["metric"] == name), "value"].item()


def alpha_dcg(ranking: list[str], covers: dict[str, list[str]], alpha: float, k: int) -> float:
    """The definition (Clarke et al. 2008): gain = sum over nuggets of (1 - alpha)^(times seen above),
    discount log2(1 + rank)."""
    seen: dict[str, int] = {}
    total = 0.0
    for rank, doc in enumerate(ranking[:k], start=1):
        total += sum((1 - alpha) ** seen.get(n, 0) for n in covers.get(doc, [])) / math.log2(1 + rank)
        for n in covers.get(doc, []):
            seen[n] = seen.get(n, 0) + 1
    return total


def ndeval_ideal(covers: dict[str, list[str]], alpha: float) -> list[str]:
    """ndeval's ideal ranking: greedy on the gain, ties toward the lexicographically largest doc id."""
    left, ideal = sorted(covers), []
    while left:
        gains = {d: alpha_dcg(ideal + [d], covers, alpha, len(ideal) + 1) for d in left}
        best = max(left, key=lambda d: (round(gains[d], 12), d))
        ideal.append(best)
        left.remove(best)
    return ideal


# A 3-nugget toy: a covers n1, b covers n1 and n2, c covers n3; d is judged for n4 with grade 0 only.
TOY = {"q": {"a": ["n1"], "b": ["n1", "n2"], "c": ["n3"]}}


def toy_links() -> pd.DataFrame:
    zero = pd.DataFrame([{"query_id": "q", "doc_id": "d", "nugget_id": "n4", "grade": 0}])
    return pd.concat([links_frame(TOY), zero], ignore_index=True)


def test_alpha_ndcg_and_strecall_by_hand():
    """Run a, b, c with alpha = 0.5.
    DCG: a: n1 new -> 1/log2(2) = 1; b: n1 seen once -> 0.5, n2 new -> 1: 1.5/log2(3) = 0.946395;
         c: n3 new -> 1/log2(4) = 0.5.                         DCG@3 = 2.446395, DCG@2 = 1.946395.
    Ideal (greedy): b (gain 2); then c (1) beats a (0.5); then a (0.5):
         2/1 + 1/log2(3) + 0.5/log2(4) = 2 + 0.630930 + 0.25 = 2.880930; @2: 2.630930.
    alpha-nDCG@3 = 2.446395 / 2.880930 = 0.849168; @2 = 1.946395 / 2.630930 = 0.739812.
    StRecall: n4 has no relevant document, so it is not in the denominator: @2 a, b cover n1, n2 -> 2/3;
    @3 -> 3/3."""
    run = run_frame({"q": ["a", "b", "c"]})
    at3 = evaluate_run(run, toy_links(), qrels_frame(links_frame(TOY)), k=3)
    at2 = evaluate_run(run, toy_links(), qrels_frame(links_frame(TOY)), k=2)
    dcg3, idcg3 = 1 + 1.5 / math.log2(3) + 0.5, 2 + 1 / math.log2(3) + 0.25
    dcg2, idcg2 = 1 + 1.5 / math.log2(3), 2 + 1 / math.log2(3)
    assert metric(at3, "q", "alpha_ndcg@3") == pytest.approx(dcg3 / idcg3) == pytest.approx(0.849168, abs=1e-6)
    assert metric(at2, "q", "alpha_ndcg@2") == pytest.approx(dcg2 / idcg2) == pytest.approx(0.739812, abs=1e-6)
    assert metric(at2, "q", "strecall@2") == pytest.approx(2 / 3)
    assert metric(at3, "q", "strecall@3") == 1.0


def test_vital_strecall_by_hand():
    """TOY with n2, n3 and n4 vital, n1 okay, every link full support, plus a partial support of n2 by a; run a, b,
    c. n4's only judgment is grade 0, so like StRecall the vital-only measure leaves it out of the denominator: 2
    vital nuggets with a fully supporting document. @1: a covers n1 (okay) and supports n2 only partially, which
    TREC RAG's strict vital score does not count -> 0/2 = 0 (StRecall, any grade: 2/3); @2: b supports n2 fully ->
    1/2 (StRecall 2/3); @3: c adds n3 -> 2/2. q_okay's nuggets are all okay: no vital judgment, so 0 (a query
    without judgments for a measure scores 0)."""
    full = links_frame(TOY).assign(grade=FULL_SUPPORT)
    partial = links_frame({"q": {"a": ["n2"]}})  # grade 1
    links = pd.concat([full, partial, toy_links().tail(1), links_frame({"q_okay": {"a": ["m1"]}})],
                      ignore_index=True)
    vital = {("q", "n2"), ("q", "n3"), ("q", "n4")}
    run = run_frame({"q": ["a", "b", "c"], "q_okay": ["a"]})
    by_k = {k: evaluate_run(run, links, qrels_frame(links_frame(TOY)), k=k, vital=vital) for k in (1, 2, 3)}
    assert [metric(by_k[k], "q", f"vital_strecall@{k}") for k in (1, 2, 3)] == [0.0, 0.5, 1.0]
    assert [metric(by_k[k], "q", f"strecall@{k}") for k in (1, 2, 3)] == pytest.approx([2 / 3, 2 / 3, 1.0])
    assert metric(by_k[3], "q_okay", "vital_strecall@3") == 0.0
    assert metric(by_k[3], "q_okay", "strecall@3") == 1.0


def test_vital_strecall_is_strecall_when_every_nugget_is_vital_and_absent_without_grades():
    covers, rankings = random_diversity_instances(2, 100)
    links = links_frame(covers).assign(grade=FULL_SUPPORT)
    every = set(zip(links["query_id"], links["nugget_id"]))
    measured = evaluate_run(run_frame(rankings), links, qrels_frame(links), k=5, vital=every)
    wide = measured.pivot(index="query_id", columns="metric", values="value")
    assert (wide["vital_strecall@5"] == wide["strecall@5"]).all()
    ungraded = evaluate_run(run_frame(rankings), links, qrels_frame(links), k=5)  # no vital: the measure is left out
    assert "vital_strecall@5" not in set(ungraded["metric"])
    pd.testing.assert_frame_equal(ungraded, measured[measured["metric"] != "vital_strecall@5"].reset_index(drop=True))


def test_vital_nuggets_reads_the_optional_importance_column():
    plain = pd.DataFrame({"query_id": ["q", "q"], "nugget_id": ["n1", "n2"], "text": ["x", "y"]})
    assert vital_nuggets(plain) is None
    assert vital_nuggets(plain.assign(importance=["okay", "vital"])) == {("q", "n2")}
    assert vital_nuggets(plain.assign(importance=["okay", "okay"])) == set()


def test_ndeval_ideal_breaks_ties_toward_the_largest_doc_id_and_can_be_beaten():
    """a covers {n0, n3}, b {n1, n2}, c {n2, n3}: all gain 2 at rank 1.
    ndeval's ideal picks c (largest id); then a and b tie at 1 + 0.5 = 1.5 -> b:
        ideal DCG@2 = 2 + 1.5/log2(3) = 2.946395.
    The ranking a, b covers four nuggets once each: DCG@2 = 2 + 2/log2(3) = 3.261860, and
    alpha-nDCG@2 = 3.261860 / 2.946395 = 1.107068 > 1. The ranking c, b is ndeval's ideal: exactly 1."""
    covers = {"q": {"a": ["n0", "n3"], "b": ["n1", "n2"], "c": ["n2", "n3"]}}
    links = links_frame(covers)
    better = evaluate_run(run_frame({"q": ["a", "b"]}), links, qrels_frame(links), k=2)
    ideal = evaluate_run(run_frame({"q": ["c", "b"]}), links, qrels_frame(links), k=2)
    expected = (2 + 2 / math.log2(3)) / (2 + 1.5 / math.log2(3))
    assert metric(better, "q", "alpha_ndcg@2") == pytest.approx(expected) == pytest.approx(1.107068, abs=1e-6)
    assert metric(ideal, "q", "alpha_ndcg@2") == pytest.approx(1.0)


def random_diversity_instances(seed: int, n_queries: int, single_nugget_docs: bool = False):
    """Queries with 2-7 judged documents over 1-5 nuggets (each query has at least one covering link),
    plus one unjudged document, ranked at random."""
    rng = np.random.default_rng(seed)
    covers, rankings = {}, {}
    for qi in range(n_queries):
        query, n_nuggets = f"q{qi:03d}", int(rng.integers(1, 6))
        docs = {}
        for di in range(int(rng.integers(2, 8))):
            if single_nugget_docs:
                nuggets = [f"n{rng.integers(0, n_nuggets)}"] if rng.random() < 0.8 else []
            else:
                nuggets = [f"n{j}" for j in range(n_nuggets) if rng.random() < 0.4]
            docs[f"d{di}"] = nuggets
        docs["d0"] = docs["d0"] or ["n0"]
        covers[query] = {d: n for d, n in docs.items() if n}
        rankings[query] = list(rng.permutation(list(docs) + ["unjudged"]))
    return covers, rankings


@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_alpha_ndcg_agrees_with_the_definition_and_ndeval_ideal_scores_one(alpha):
    covers, rankings = random_diversity_instances(0, 200)
    links = links_frame(covers)
    k = 5
    observed = evaluate_run(run_frame(rankings), links, qrels_frame(links), k=k, alpha=alpha)
    ideal_rankings = {q: ndeval_ideal(c, alpha) for q, c in covers.items()}
    ideal = evaluate_run(run_frame(ideal_rankings), links, qrels_frame(links), k=k, alpha=alpha)
    for query, query_covers in covers.items():
        expected = (alpha_dcg(rankings[query], query_covers, alpha, k)
                    / alpha_dcg(ideal_rankings[query], query_covers, alpha, k))
        assert metric(observed, query, f"alpha_ndcg@{k}") == pytest.approx(expected)
        assert metric(ideal, query, f"alpha_ndcg@{k}") == pytest.approx(1.0)
        relevant = {n for nuggets in query_covers.values() for n in nuggets}
        found = {n for d in rankings[query][:k] for n in query_covers.get(d, [])}
        assert metric(observed, query, f"strecall@{k}") == pytest.approx(len(found) / len(relevant))
    assert (observed["value"] >= 0).all()


def test_alpha_ndcg_at_most_one_when_documents_cover_one_nugget_each():
    """With single-nugget documents the greedy ideal is optimal (each document's gain depends on its own
    nugget only), so no ranking can exceed it."""
    covers, rankings = random_diversity_instances(1, 200, single_nugget_docs=True)
    links = links_frame(covers)
    values = evaluate_run(run_frame(rankings), links, qrels_frame(links), k=5)
    assert values["value"].between(0, 1 + 1e-12).all()


def test_each_measure_is_evaluated_separately():
    """alpha != 0.5 puts alpha_nDCG and StRecall in different ndeval invocations; one combined
    ir_measures call then leaves one of them at 0. Ours matches the measure evaluated alone."""
    links = toy_links()
    run = run_frame({"q": ["a", "b", "c"]})
    scored = run.assign(score=-run["rank"].astype(float))[["query_id", "doc_id", "score"]]
    alone = ir_measures.calc_aggregate([alpha_nDCG(alpha=0.3) @ 3], diversity_qrels(links), scored)
    ours = metric(evaluate_run(run, links, qrels_frame(links_frame(TOY)), k=3, alpha=0.3), "q", "alpha_ndcg@3")
    assert ours == pytest.approx(alone[alpha_nDCG(alpha=0.3) @ 3]) and ours > 0


def test_p_at_10_on_demo_equals_a_hand_count(demo_dataset):
    """A run of each demo query's candidates in reverse doc-id order (distractors and near-duplicates
    first) plus an off-topic unjudged document at rank 3, cut at 12; one query keeps only 4 documents."""
    candidates = demo_dataset.candidates.sort_values(["query_id", "doc_id"], ascending=[True, False])
    rankings = {q: list(g["doc_id"][:11]) for q, g in candidates.groupby("query_id")}
    for docs in rankings.values():
        docs.insert(2, "demo-x000")
    short = sorted(rankings)[0]
    rankings[short] = rankings[short][:4]
    qrels = demo_dataset.qrels
    per_query = evaluate_run(run_frame(rankings), demo_dataset.nugget_links, qrels, k=10)
    relevant = set(map(tuple, qrels.loc[qrels["relevance"] >= 1, ["query_id", "doc_id"]].to_numpy()))
    hand_counts = {q: sum((q, d) in relevant for d in docs[:10]) for q, docs in rankings.items()}
    for query, count in hand_counts.items():
        assert metric(per_query, query, "p@10") == pytest.approx(count / 10)
    assert 0 < np.mean(list(hand_counts.values())) < 10  # the run mixes relevant and non-relevant documents


def test_multi_row_qrels_trap_is_avoided():
    """Judged coverage has one row per (doc, subquestion), ratings below the bar as grade 0. Fed to P@k,
    pytrec_eval keeps one arbitrary row per document: b's last row is grade 0, so P@2 halves. evaluate_run
    takes P@k from the document qrels."""
    links = pd.DataFrame({"query_id": ["q"] * 4, "doc_id": ["a", "a", "b", "b"], "nugget_id": ["n1", "n2"] * 2,
                          "grade": [0, 1, 1, 0]})
    qrels = pd.DataFrame({"query_id": ["q", "q"], "doc_id": ["a", "b"], "relevance": [1, 1]})
    run = run_frame({"q": ["a", "b"]})
    scored = run.assign(score=-run["rank"].astype(float))[["query_id", "doc_id", "score"]]
    trapped = ir_measures.calc_aggregate([P @ 2], diversity_qrels(links), scored)[P @ 2]
    assert trapped == 0.5
    assert metric(evaluate_run(run, links, qrels, k=2), "q", "p@2") == 1.0
    with pytest.raises(ValueError, match="one judgment per document"):
        binary_qrels(links.rename(columns={"grade": "relevance"}))


def test_every_run_query_is_reported_and_only_those():
    """q_unjudged has no judgments at all: ndeval and pytrec_eval skip it; we report 0 for every metric.
    q_other is judged but not in the run: it is left out (judgments outside the run are ignored)."""
    links = pd.concat([toy_links(), links_frame({"q_other": {"z": ["m1", "m2"]}})], ignore_index=True)
    qrels = qrels_frame(links)
    run = run_frame({"q": ["a", "b"], "q_unjudged": ["a"]})
    per_query = evaluate_run(run, links, qrels, k=10)
    assert list(per_query.columns) == list(PER_QUERY_METRICS.columns)
    assert set(per_query["query_id"]) == {"q", "q_unjudged"}
    assert set(per_query["metric"]) == {"alpha_ndcg@10", "strecall@10", "p@10", "ndcg@10"}
    assert (per_query.loc[per_query["query_id"] == "q_unjudged", "value"] == 0).all()
    assert len(per_query) == 8


def test_rank_not_row_order_decides():
    links = toy_links()
    qrels = qrels_frame(links_frame(TOY))
    ordered = evaluate_run(run_frame({"q": ["a", "b", "c"]}), links, qrels, k=3)
    shuffled = evaluate_run(run_frame({"q": ["a", "b", "c"]}).iloc[[2, 0, 1]], links, qrels, k=3)
    reversed_ranks = evaluate_run(run_frame({"q": ["c", "b", "a"]}), links, qrels, k=3)
    assert ordered["value"].tolist() == shuffled["value"].tolist()
    assert metric(reversed_ranks, "q", "alpha_ndcg@3") != metric(ordered, "q", "alpha_ndcg@3")


@pytest.mark.parametrize("kwargs, message", [
    ({"k": 21}, "between 1 and 20"),
    ({"alpha": 1.5}, r"alpha must lie in \[0, 1\]"),
    ({"run": run_frame({"q": ["a", "a"]})}, "duplicate query_id/doc_id"),
    ({"run": run_frame({"q": ["a"]}).drop(columns="rank")}, r"missing column\(s\) \['rank'\]"),
])
def test_bad_input_is_named(kwargs, message):
    arguments = {"run": run_frame({"q": ["a"]}), "nugget_links": toy_links(),
                 "qrels": qrels_frame(links_frame(TOY)), **kwargs}
    with pytest.raises(ValueError, match=message):
        evaluate_run(**arguments)


def test_brier_score_and_expected_calibration_error_known_answers():
    labels = np.array([1, 0, 1, 0])
    probs = np.array([0.9, 0.1, 0.6, 0.6])
    # Brier: (0.01 + 0.01 + 0.16 + 0.36) / 4 = 0.135.
    assert brier_score(labels, probs) == pytest.approx(0.135)
    # ECE, 10 bins: {0.1} 1/4 * |0.1 - 0|, {0.6, 0.6} 2/4 * |0.6 - 0.5|, {0.9} 1/4 * |0.9 - 1| -> 0.1.
    assert expected_calibration_error(labels, probs) == pytest.approx(0.1)
    assert expected_calibration_error(np.array([1, 0]), np.array([1.0, 0.0])) == 0.0  # p = 1 in the last bin
    with pytest.raises(ValueError, match="equal-length"):
        brier_score(labels, probs[:3])
    with pytest.raises(ValueError, match="0/1"):
        expected_calibration_error(np.array([2]), np.array([0.5]))
