"""Greedy coverage selection (METHODS.md §1) under a k budget: exhaustive search where greedy is provably
optimal, the (1 - 1/e) bound everywhere, the documented counterexample to "greedy beats relevance at every
prefix", tie-breaking and fill, the soft extension and its blend with the fallback order (models/selectors.py
`CoverageGreedy`, `Blend`, `RelevanceOrder` with `Budget(k=...)`), the estimator gate and the tuned blend
(models/trust.py), and the per-query driver (models/selection.py `ranked_pools`, `select_queries`) on the demo
dataset."""

import itertools

import numpy as np
import pandas as pd
import pytest

from covlab.models.pools import rank_within_queries
from covlab.models.schemas import SELECTIONS
from covlab.models.selection import GOLD, CoverageColumns, ranked_pools, select_queries
from covlab.models.selectors import Blend, Budget, CoverageGreedy, Pool, RelevanceOrder
from covlab.models.trust import Decision, EstimateTrust, choose_blend_weight, estimator_trusted, trusting

INSTANCES = 300


def greedy_coverage(covers: np.ndarray, tie_break: np.ndarray, k: int) -> np.ndarray:
    """Hard greedy coverage on a 0/1 matrix (tau 1: covered iff 1), ties and fill by `tie_break`, k items."""
    return CoverageGreedy(soft=False, tau=1.0)(Pool(relevance=tie_break, covers=covers), Budget(k=k)).items


def soft_greedy_coverage(probs: np.ndarray, tie_break: np.ndarray, k: int) -> np.ndarray:
    return CoverageGreedy(soft=True)(Pool(relevance=tie_break, covers=probs), Budget(k=k)).items


def blended_soft_greedy(probs: np.ndarray, tie_break: np.ndarray, k: int, weight: float) -> np.ndarray:
    return Blend(CoverageGreedy(soft=True), weight)(Pool(relevance=tie_break, covers=probs), Budget(k=k)).items


def relevance_order(scores: np.ndarray, k: int) -> np.ndarray:
    return RelevanceOrder()(Pool(relevance=scores), Budget(k=k)).items


def coverage_curve(covers: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Number of subquestions covered by the first 1, 2, ..., len(order) documents of `order`."""
    covers = np.asarray(covers, dtype=bool)
    if len(order) == 0:
        return np.zeros(0, dtype=int)
    return np.logical_or.accumulate(covers[np.asarray(order, dtype=int)], axis=0).sum(axis=1)



def best_coverage(covers: np.ndarray, size: int) -> int:
    """Exhaustive: the most subquestions any `size` documents cover together."""
    if size == 0 or covers.shape[1] == 0:
        return 0
    return max(int(covers[list(c)].any(axis=0).sum()) for c in itertools.combinations(range(len(covers)), size))


def random_instances(seed: int, make_covers):
    rng = np.random.default_rng(seed)
    for _ in range(INSTANCES):
        n_docs, n_subquestions = int(rng.integers(1, 8)), int(rng.integers(1, 7))
        covers = make_covers(rng, n_docs, n_subquestions)
        tie_break = rng.integers(0, 3, size=n_docs).astype(float)  # few values: many ties
        yield covers, tie_break


def dense_covers(rng, n_docs, n_subquestions):
    return rng.random((n_docs, n_subquestions)) < rng.uniform(0.1, 0.7)


def single_subquestion_covers(rng, n_docs, n_subquestions):
    """Each document covers at most one subquestion."""
    covers = np.zeros((n_docs, n_subquestions), dtype=bool)
    covering = rng.random(n_docs) < 0.8
    covers[np.flatnonzero(covering), rng.integers(0, n_subquestions, size=int(covering.sum()))] = True
    return covers


def disjoint_covers(rng, n_docs, n_subquestions):
    """Each subquestion is covered by at most one document."""
    covers = np.zeros((n_docs, n_subquestions), dtype=bool)
    owner = rng.integers(-1, n_docs, size=n_subquestions)  # -1: nobody covers it
    covers[owner[owner >= 0], np.flatnonzero(owner >= 0)] = True
    return covers


def test_greedy_equals_exhaustive_for_one_document():
    for covers, tie_break in random_instances(0, dense_covers):
        chosen = greedy_coverage(covers, tie_break, 1)
        assert coverage_curve(covers, chosen)[0] == best_coverage(covers, 1)


@pytest.mark.parametrize("make_covers", [single_subquestion_covers, disjoint_covers])
def test_greedy_equals_exhaustive_at_every_prefix_where_it_is_optimal(make_covers):
    for covers, tie_break in random_instances(1, make_covers):
        curve = coverage_curve(covers, greedy_coverage(covers, tie_break, len(covers)))
        assert curve.tolist() == [best_coverage(covers, i) for i in range(1, len(covers) + 1)]


def test_greedy_is_within_one_minus_one_over_e_of_the_best_at_every_prefix():
    bound = 1 - 1 / np.e
    for covers, tie_break in random_instances(2, dense_covers):
        curve = coverage_curve(covers, greedy_coverage(covers, tie_break, len(covers)))
        for i, covered in enumerate(curve, start=1):
            assert covered >= bound * best_coverage(covers, i)


def test_greedy_adds_a_subquestion_each_step_until_everything_coverable_is_covered():
    """Hence greedy never covers fewer than relevance order at prefix 1, nor at any prefix of at least
    as many documents as there are coverable subquestions (it has covered all of them by then)."""
    rng = np.random.default_rng(30)
    for covers, tie_break in random_instances(3, dense_covers):
        coverable = int(covers.any(axis=0).sum())
        prefixes = np.arange(1, len(covers) + 1)
        greedy = coverage_curve(covers, greedy_coverage(covers, tie_break, len(covers)))
        assert (greedy >= np.minimum(prefixes, coverable)).all()
        assert greedy[-1] == coverable
        relevance = coverage_curve(covers, relevance_order(rng.random(len(covers)), len(covers)))
        assert greedy[0] >= relevance[0]
        assert (greedy[prefixes >= coverable] >= relevance[prefixes >= coverable]).all()


def test_greedy_covers_at_least_relevance_at_every_prefix_with_single_subquestion_documents():
    rng = np.random.default_rng(4)
    for covers, tie_break in random_instances(4, single_subquestion_covers):
        relevance_scores = rng.random(len(covers))
        greedy = coverage_curve(covers, greedy_coverage(covers, tie_break, len(covers)))
        relevance = coverage_curve(covers, relevance_order(relevance_scores, len(covers)))
        assert (greedy >= relevance).all()


def test_greedy_can_trail_relevance_at_a_middle_prefix():
    """Known answer: the issue's "never fewer than relevance at every prefix" is false in general.
    A = {1,2,3,4}, B = {1,2,5}, C = {3,4,6}; relevance order B, C, A.
    greedy: A (4 new), then B or C (1 new each; B ranks higher) -> 4, 5, 6 covered.
    relevance: B, C -> 3, 6, 6 covered: ahead at prefix 2."""
    covers = np.array([[1, 1, 1, 1, 0, 0],   # A
                       [1, 1, 0, 0, 1, 0],   # B
                       [0, 0, 1, 1, 0, 1]],  # C
                      dtype=bool)
    relevance_scores = np.array([1.0, 3.0, 2.0])
    greedy = greedy_coverage(covers, relevance_scores, 3)
    assert greedy.tolist() == [0, 1, 2]
    assert coverage_curve(covers, greedy).tolist() == [4, 5, 6]
    assert coverage_curve(covers, relevance_order(relevance_scores, 3)).tolist() == [3, 6, 6]


def test_fill_after_saturation_follows_tie_break_order():
    covers = np.array([[0, 0], [1, 0], [0, 0], [1, 1], [0, 0]], dtype=bool)
    tie_break = np.array([5.0, 1.0, 4.0, 0.0, 4.0])
    # doc 3 covers both; nothing adds coverage afterwards -> fill by tie_break: 0 (5), 2 and 4 (4, lower
    # index first), 1 (1).
    assert greedy_coverage(covers, tie_break, 5).tolist() == [3, 0, 2, 4, 1]
    assert greedy_coverage(covers, tie_break, 3).tolist() == [3, 0, 2]


def test_ties_break_by_tie_break_then_lower_index():
    covers = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 1, 0]], dtype=bool)
    assert greedy_coverage(covers, np.array([0.0, 0.0, 0.0, 0.0]), 4).tolist() == [0, 1, 2, 3]
    assert greedy_coverage(covers, np.array([0.0, 0.0, 0.0, 1.0]), 4).tolist() == [3, 0, 2, 1]
    assert greedy_coverage(covers, np.array([0.2, 0.5, 0.9, 0.5]), 4).tolist() == [2, 1, 0, 3]


def test_coverage_beats_tie_break():
    covers = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=bool)
    assert greedy_coverage(covers, np.array([10.0, 0.0, 5.0]), 3).tolist() == [1, 2, 0]


def test_soft_greedy_equals_hard_greedy_on_binary_probabilities():
    for covers, tie_break in random_instances(5, dense_covers):
        for k in (1, 3, len(covers) + 2):
            assert (soft_greedy_coverage(covers.astype(float), tie_break, k).tolist()
                    == greedy_coverage(covers, tie_break, k).tolist())


def test_soft_greedy_maximises_expected_new_coverage():
    """Known answer where soft and tau-binarised greedy part ways.
    Soft, step 1: d0 0.35 + 0.35 = 0.70, d1 0.95, d2 0.80 -> d1. Open probabilities (0.05, 1, 1):
    d0 0.35*0.05 + 0.35 = 0.3675, d2 0.8 -> d2, then d0.
    Hard at tau = 0.3: d0 covers {0, 1}, d1 {0}, d2 {2} -> d0 (2 new), d2 (1 new), then d1 as fill."""
    probs = np.array([[0.35, 0.35, 0.0],
                      [0.95, 0.0, 0.0],
                      [0.0, 0.0, 0.8]])
    assert soft_greedy_coverage(probs, np.zeros(3), 3).tolist() == [1, 2, 0]
    assert greedy_coverage(probs >= 0.3, np.zeros(3), 3).tolist() == [0, 2, 1]


def soft_instances(seed: int):
    """Random probabilities, some exactly 0 or 1, with tied tie-break scores."""
    rng = np.random.default_rng(seed)
    for _ in range(INSTANCES):
        n_docs, n_subquestions = int(rng.integers(1, 12)), int(rng.integers(0, 7))
        probs = rng.random((n_docs, n_subquestions))
        probs[rng.random(probs.shape) < 0.2] = 0.0
        probs[rng.random(probs.shape) < 0.1] = 1.0
        yield probs, rng.integers(0, 4, size=n_docs).astype(float)


def test_blend_weight_one_is_exactly_soft_greedy_and_weight_zero_exactly_the_fallback_order():
    for probs, tie_break in soft_instances(7):
        for k in (1, 4, len(probs) + 2):
            assert (blended_soft_greedy(probs, tie_break, k, 1.0).tolist()
                    == soft_greedy_coverage(probs, tie_break, k).tolist())
            assert blended_soft_greedy(probs, tie_break, k, 0.0).tolist() == relevance_order(tie_break, k).tolist()


def test_blend_trades_expected_gain_against_fallback_rank():
    """Known answer, 2 subquestions, fallback order d0, d1, d2 (f = 1, 2/3, 1/3), score = w g / 2 + (1 - w) f.
    Step 1 gains: d0 0.2, d1 1.0, d2 2.0.
    w = 0.5: d0 0.05 + 0.5 = 0.55, d1 0.25 + 0.333 = 0.583, d2 0.5 + 0.167 = 0.667 -> d2; then everything is
    covered (gains 0): fallback order d0, d1.
    w = 0.25: d0 0.025 + 0.75 = 0.775, d1 0.125 + 0.5 = 0.625, d2 0.25 + 0.25 = 0.5 -> d0; open (0.9, 0.9):
    d1 gain 0.9 -> 0.1125 + 0.5 = 0.6125, d2 gain 1.8 -> 0.225 + 0.25 = 0.475 -> d1, then d2.
    w = 1 is soft greedy: d2, then nothing is open and the fallback order fills."""
    probs = np.array([[0.1, 0.1], [1.0, 0.0], [1.0, 1.0]])
    tie_break = np.array([3.0, 2.0, 1.0])
    assert blended_soft_greedy(probs, tie_break, 3, 0.5).tolist() == [2, 0, 1]
    assert blended_soft_greedy(probs, tie_break, 3, 0.25).tolist() == [0, 1, 2]
    assert blended_soft_greedy(probs, tie_break, 3, 1.0).tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match=r"weight must lie in \[0, 1\]"):
        blended_soft_greedy(probs, tie_break, 3, 1.5)


QUERIES = pd.DataFrame({"query_id": ["a", "b", "t"], "split": ["dev", "dev", "test"]})
LINKS = pd.DataFrame({"query_id": ["a", "a", "b", "b", "t", "t"], "doc_id": ["a1", "a4", "b1", "b4", "t1", "t4"],
                      "nugget_id": ["a-n1", "a-n2", "b-n1", "b-n2", "t-n1", "t-n2"], "grade": 1})


def tune_pools(points_at: str):
    """Two tune queries whose pool order puts the second nugget's only document last (rank 4), and a test
    query, with an estimate that points at document `points_at` for that nugget."""
    docs = ["1", "2", "3", "4"]
    pool = pd.DataFrame({"query_id": np.repeat(["a", "b", "t"], 4), "doc_id": [f"{q}{d}" for q in "abt" for d in docs],
                         "rank": np.tile([1, 2, 3, 4], 3), "score": 0.0})
    estimate = pd.DataFrame([{"query_id": q, "doc_id": f"{q}{d}", "subq_id": f"{q}-n2",
                              "probability": 0.9 if d == points_at else 0.1} for q in "abt" for d in docs])
    return ranked_pools(pool, QUERIES, estimate)


def test_choose_blend_weight_keeps_the_fallback_unless_the_estimate_helps_on_the_tune_split():
    """An estimate that points at the second nugget's document lifts alpha-nDCG on dev: some w > 0 wins. An
    estimate that points at a document covering nothing can only lose: w = 0, the fallback, is kept."""
    soft = CoverageGreedy(soft=True)
    helpful = choose_blend_weight(soft, tune_pools("4"), "dev", Budget(k=2), LINKS, [0, 0.5, 1], alpha=0.5)
    assert helpful.weight > 0 and helpful.queries == 2 and helpful.split == "dev"
    assert helpful.scores[helpful.weight] > helpful.fallback_score
    misleading = choose_blend_weight(soft, tune_pools("2"), "dev", Budget(k=2), LINKS, [0, 0.5, 1], alpha=0.5)
    assert misleading.weight == 0.0 and misleading.scores[1.0] < misleading.fallback_score
    evidence = misleading.evidence()
    assert evidence["weight"] == 0.0 and evidence["metric"] == "alpha_ndcg@2"
    assert set(evidence["scores"]) == {"0.0", "0.5", "1.0"} and evidence["chosen_score"] == evidence["fallback_score"]
    with pytest.raises(ValueError, match="include 0"):
        choose_blend_weight(soft, tune_pools("4"), "dev", Budget(k=2), LINKS, [0.5, 1], alpha=0.5)
    with pytest.raises(ValueError, match="no pooled queries in split 'train'"):
        choose_blend_weight(soft, tune_pools("4"), "train", Budget(k=2), LINKS, [0, 1], alpha=0.5)


def test_estimator_gate():
    assert estimator_trusted(0.65, 0.65).trusted and estimator_trusted(0.9, 0.65).trusted
    low = estimator_trusted(0.545, 0.65)
    assert not low.trusted and "0.5450 < 0.6500" in low.reason
    assert not estimator_trusted(float("nan"), 0.65).trusted


def test_trusting_falls_back_below_the_gate_and_blends_above_it():
    """Below the gate relevance order itself; above it the Blend at the weight chosen on the tune split (the
    helpful estimate's choice above), or the selector itself when no weights are given."""
    soft, pools = CoverageGreedy(soft=True), tune_pools("4")
    trust = EstimateTrust(dev_auc=0.9, min_dev_auc=0.65, tune_split="dev", nugget_links=LINKS,
                          weights=[0, 0.5, 1], alpha=0.5)
    chosen = choose_blend_weight(soft, pools, "dev", Budget(k=2), LINKS, [0, 0.5, 1], alpha=0.5)
    selector, decision = trusting(soft, trust, pools, Budget(k=2))
    assert selector == Blend(soft, chosen.weight) and not decision.fell_back and decision.blend == chosen
    assert decision.metadata() == {"fell_back": False, "estimator_gate": "dev ROC-AUC 0.9000 >= 0.6500",
                                   "estimator_dev_auc": 0.9, "blend_weight": chosen.weight,
                                   "blend": chosen.evidence()}
    low = EstimateTrust(0.545, 0.65, "dev", LINKS, [0, 0.5, 1], 0.5)
    selector, decision = trusting(soft, low, pools, Budget(k=2))
    assert selector == RelevanceOrder() and decision.fell_back and decision.blend is None
    assert decision == Decision(True, "dev ROC-AUC 0.5450 < 0.6500: the estimate is too close to chance to "
                                      "select by", 0.545)
    assert "blend_weight" not in decision.metadata()
    gate_only = EstimateTrust(0.9, 0.65, "dev", None, None, 0.5)
    assert trusting(soft, gate_only, pools, Budget(k=2))[0] is soft
    with pytest.raises(ValueError, match="gold nugget links of the tune split"):
        trusting(soft, EstimateTrust(0.9, 0.65, "dev", None, [0, 1], 0.5), pools, Budget(k=2))


def test_k_larger_than_pool_returns_every_document_once():
    for covers, tie_break in random_instances(6, dense_covers):
        for select in (greedy_coverage, soft_greedy_coverage):
            chosen = select(covers, tie_break, len(covers) + 5)
            assert sorted(chosen.tolist()) == list(range(len(covers)))


def test_no_subquestions_falls_back_to_tie_break_order():
    tie_break = np.array([0.1, 0.7, 0.3, 0.7])
    for select in (greedy_coverage, soft_greedy_coverage):
        assert select(np.zeros((4, 0)), tie_break, 3).tolist() == [1, 3, 2]
        assert select(np.zeros((0, 0)), np.zeros(0), 3).tolist() == []
    assert greedy_coverage(np.ones((3, 2), dtype=bool), np.zeros(3), 0).tolist() == []


def test_relevance_order_and_coverage_curve_known_answers():
    assert relevance_order(np.array([0.3, 0.9, 0.3, 0.1]), 3).tolist() == [1, 0, 2]
    covers = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=bool)
    assert coverage_curve(covers, np.array([0, 2, 1])).tolist() == [1, 1, 2]
    assert coverage_curve(covers, np.array([], dtype=int)).tolist() == []


@pytest.mark.parametrize("call, message", [
    (lambda: greedy_coverage(np.ones(3, dtype=bool), np.zeros(3), 1), r"covers must be an \(n_items=3, n_viewpoints\)"),
    (lambda: greedy_coverage(np.full((2, 2), 2), np.zeros(2), 1), r"probabilities in \[0, 1\] or 0/1"),
    (lambda: greedy_coverage(np.ones((2, 2), dtype=bool), np.zeros(3), 1), r"covers must be an \(n_items=3"),
    (lambda: greedy_coverage(np.ones((2, 2), dtype=bool), np.array([0.0, np.nan]), 1), "relevance must be 2 finite"),
    (lambda: greedy_coverage(np.ones((2, 2), dtype=bool), np.zeros(2), -1), "non-negative integer"),
    (lambda: soft_greedy_coverage(np.array([[0.5, 1.5]]), np.zeros(1), 1), r"\[0, 1\]"),
    (lambda: soft_greedy_coverage(np.array([[0.5, np.nan]]), np.zeros(1), 1), r"\[0, 1\]"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.fixture(scope="module")
def demo_pools(demo_dataset):
    """The demo's candidates ranked by a fixed pseudo-relevance (doc id order reversed)."""
    candidates = demo_dataset.candidates
    return rank_within_queries(candidates.assign(score=-candidates["doc_id"].str[-4:].astype(int).astype(float)))


def k_selections(pools, selector, k: int) -> pd.DataFrame:
    """A SELECTIONS run (query_id, rank, doc_id): `selector` at Budget(k) over every pool."""
    return SELECTIONS.conform(select_queries(pools, selector, [Budget(k=k)]).table, source="selections")


def test_select_queries_matches_the_array_selectors(demo_dataset, demo_pools):
    links = demo_dataset.nugget_links
    pools = ranked_pools(demo_pools, demo_dataset.queries, links, GOLD)
    for selector in (RelevanceOrder(), CoverageGreedy(soft=False, tau=1.0), CoverageGreedy(soft=True)):
        run = k_selections(pools, selector, 10)
        assert list(run.columns) == list(SELECTIONS.columns)
        assert set(run["query_id"]) == set(demo_pools["query_id"])
        for query_id, selected in run.groupby("query_id"):
            pool = demo_pools[demo_pools["query_id"] == query_id].sort_values("rank")
            assert selected["rank"].tolist() == list(range(1, 11))
            doc_ids = pool["doc_id"].tolist()
            nuggets = sorted(links.loc[links["query_id"] == query_id, "nugget_id"].unique())
            covered = {(d, n) for d, n in links.loc[links["query_id"] == query_id, ["doc_id", "nugget_id"]]
                       .itertuples(index=False)}
            covers = np.array([[(d, n) in covered for n in nuggets] for d in doc_ids])
            expected = (relevance_order(-pool["rank"].to_numpy(float), 10) if selector == RelevanceOrder()
                        else greedy_coverage(covers, -pool["rank"].to_numpy(float), 10))
            assert selected["doc_id"].tolist() == [doc_ids[i] for i in expected]
            if selector != RelevanceOrder():  # every demo nugget has a covering document and there are <= 10
                assert coverage_curve(covers, expected)[-1] == len(nuggets)


POOL = pd.DataFrame({"query_id": ["q1"] * 3 + ["q2"] * 2, "doc_id": ["a", "b", "c", "x", "y"],
                     "rank": [1, 2, 3, 1, 2], "score": [3.0, 2.0, 1.0, 2.0, 1.0]})
POOL_QUERIES = pd.DataFrame({"query_id": ["q1", "q2"], "split": ["test", "test"]})


def test_select_queries_thresholds_and_missing_coverage():
    coverage = pd.DataFrame({"query_id": ["q1"] * 4, "doc_id": ["a", "b", "c", "c"],
                             "subquestion_id": ["s1", "s1", "s2", "s1"],
                             "probability": [0.2, 0.35, 0.9, 0.9]})
    columns = CoverageColumns(nugget="subquestion_id", value="probability")
    pools = ranked_pools(POOL, POOL_QUERIES, coverage, columns)
    run = k_selections(pools, CoverageGreedy(soft=False, tau=0.3), 2)
    # q1: c covers s1 and s2 at tau = 0.3; then nothing new -> fill by rank (a). q2 has no rows: by rank.
    assert run.values.tolist() == [["q1", 1, "c"], ["q1", 2, "a"], ["q2", 1, "x"], ["q2", 2, "y"]]
    soft = k_selections(pools, CoverageGreedy(soft=True), 3)
    # c first (1.8); then open (0.1, 0.1): a 0.2*0.1 = 0.02 < b 0.35*0.1 = 0.035 -> b, a.
    assert soft.loc[soft["query_id"] == "q1", "doc_id"].tolist() == ["c", "b", "a"]
    # The run's own table keeps the budget (k) of every row.
    assert select_queries(pools, CoverageGreedy(soft=True), [Budget(k=3)]).table["budget"].tolist() == [3] * 5


def test_select_queries_names_bad_input():
    pool = POOL[POOL["query_id"] == "q1"].iloc[:2].assign(rank=[1, 1])
    with pytest.raises(ValueError, match="duplicate query_id/rank"):
        ranked_pools(pool, POOL_QUERIES)
    pool["rank"] = [1, 2]
    with pytest.raises(ValueError, match="coverage_hard_tau1 needs the pool's covers; this pool has none"):
        select_queries(ranked_pools(pool, POOL_QUERIES), CoverageGreedy(soft=False, tau=1.0), [Budget(k=1)])
    links = pd.DataFrame({"query_id": ["q1", "q1"], "doc_id": ["a", "a"], "nugget_id": ["n", "n"], "grade": [1, 1]})
    with pytest.raises(ValueError, match="duplicate query_id/doc_id/nugget_id"):
        ranked_pools(pool, POOL_QUERIES, links, GOLD)
    with pytest.raises(ValueError, match=r"weight must lie in \[0, 1\]"):
        Blend(CoverageGreedy(soft=True), 1.5)
    with pytest.raises(ValueError, match="pool query 'q1' is not in the queries table"):
        ranked_pools(pool, POOL_QUERIES[POOL_QUERIES["query_id"] == "q2"])


def test_select_queries_names_a_value_that_is_no_selector():
    pools = ranked_pools(POOL, POOL_QUERIES)
    with pytest.raises(TypeError, match=r"(?i)selector.*'greedy'"):
        select_queries(pools, "greedy", [Budget(k=1)])
