"""MCompass pools for the coverage family: a chunk run becomes a document pool, how it relates to
the BM25 pool, and the comparison of the two pools under pool order and coverage greedy, by hand."""

import math

import pandas as pd
import pytest

from covlab.models.pools import evidence_documents, pool_agreement, pools_from_chunk_run
from covlab.models.registry import SelectorSettings, method
from covlab.models.report import compare_pools
from covlab.models.runs import run_method
from covlab.models.selection import ranked_pools, select_queries
from covlab.models.selectors import Budget, CoverageGreedy
from covlab.models.trust import EstimateTrust, trusting

POOL_ORDER = method("pool_order").name  # a pool's own rank order
SETTINGS = SelectorSettings(tau=0.3)


def run(rows):
    """A one-method run from (query_id, chunk_id, score) in rank order."""
    return pd.DataFrame(rows, columns=["query_id", "chunk_id", "score"]).assign(
        rank=lambda f: f.groupby("query_id").cumcount() + 1)


# d1 is a long document split into three chunks; d2, d3, d4 are one chunk each (chunk id == doc id)
CHUNK_DOC = {"d1#0": "d1", "d1#1": "d1", "d1#2": "d1", "d2": "d2", "d3": "d3", "d4": "d4"}


def test_chunks_of_a_split_document_collapse_to_its_first_place_in_rank_order():
    ranked = run([("q", "d1#1", 0.9), ("q", "d2", 0.8), ("q", "d1#0", 0.7), ("q", "d3", 0.6), ("q", "d1#2", 0.5),
                  ("q", "d4", 0.4)])
    pools = pools_from_chunk_run(ranked.sample(frac=1, random_state=3), CHUNK_DOC, 10)  # row order is not rank
    assert pools["doc_id"].tolist() == ["d1", "d2", "d3", "d4"]
    assert pools["rank"].tolist() == [1, 2, 3, 4]
    assert pools["score"].tolist() == [0.9, 0.8, 0.6, 0.4]  # each document's best (first) chunk
    assert list(pools.columns) == ["query_id", "doc_id", "rank", "score"]  # POOLS


def test_the_pool_is_cut_at_n_documents_not_n_chunks():
    ranked = run([("q", "d1#0", 3.0), ("q", "d1#1", 2.0), ("q", "d2", 1.0), ("q", "d3", 0.0),
                  ("p", "d4", 1.0), ("p", "d2", 0.5)])
    cut = pools_from_chunk_run(ranked, CHUNK_DOC, 2)
    assert cut.groupby("query_id")["doc_id"].apply(list).to_dict() == {"p": ["d4", "d2"], "q": ["d1", "d2"]}
    per_query = pools_from_chunk_run(ranked, CHUNK_DOC, {"q": 3, "p": 1})  # e.g. each query's BM25 pool size
    assert per_query.groupby("query_id")["doc_id"].apply(list).to_dict() == {"p": ["d4"], "q": ["d1", "d2", "d3"]}
    assert set(pools_from_chunk_run(ranked, CHUNK_DOC, {"q": 1})["query_id"]) == {"q"}  # no size: no pool
    with pytest.raises(ValueError, match="have no document"):
        pools_from_chunk_run(run([("q", "elsewhere", 1.0)]), CHUNK_DOC, 2)
    with pytest.raises(ValueError, match="non-negative"):
        pools_from_chunk_run(ranked, CHUNK_DOC, -1)


def test_pool_agreement_counts_overlap_and_evidence_by_hand():
    pool = pd.DataFrame({"query_id": ["q", "q", "q", "q", "p", "p"], "doc_id": ["a", "b", "c", "d", "a", "e"],
                         "rank": [1, 2, 3, 4, 1, 2], "score": 1.0})
    reference = pd.DataFrame({"query_id": ["q", "q", "p", "r"], "doc_id": ["a", "x", "y", "a"], "rank": [1, 2, 1, 1],
                              "score": 1.0})
    links = pd.DataFrame({"query_id": ["q", "q", "q"], "doc_id": ["b", "x", "z"], "nugget_id": ["n1", "n2", "n3"],
                          "grade": [1, 1, 0]})  # grade 0: z is no evidence
    qrels = pd.DataFrame({"query_id": ["q", "p"], "doc_id": ["c", "e"], "relevance": [2, 0]})
    evidence = evidence_documents(links, qrels)
    assert sorted(map(tuple, evidence.values)) == [("q", "b"), ("q", "c"), ("q", "x")]
    figures = pool_agreement(pool, reference, evidence)
    assert figures["queries"] == 2 and figures["mean_pool_size"] == 3.0  # r has no pool of its own
    assert figures["mean_overlap"] == pytest.approx((1 / 4 + 0 / 2) / 2)
    assert figures["queries_with_evidence"] == 1  # p's only judged document has relevance 0
    assert figures["evidence_share"] == {"pool": pytest.approx(2 / 3), "reference": pytest.approx(1 / 3)}


def test_run_method_is_select_queries_through_the_gate_and_the_tuned_blend():
    """coverage_greedy's run_method: with the gate alone (no blend weights) and a trusted estimator, the
    selector on the pools' own matrices; with blend weights, the selector and decision `trusting` gives, above
    and below the gate; the estimated matrix given as a long-form table or carried by the pools alike."""
    pool = pd.DataFrame({"query_id": ["q"] * 3 + ["d"] * 3, "doc_id": ["a", "b", "c"] * 2, "rank": [1, 2, 3] * 2,
                         "score": 0.0})
    matrix = pd.DataFrame({"query_id": ["q", "q", "d", "d"], "doc_id": ["c", "b", "c", "b"],
                           "subq_id": ["s1", "s2", "s1", "s2"], "probability": [0.9, 0.8, 0.9, 0.8]})
    queries = pd.DataFrame({"query_id": ["q", "d"], "split": ["test", "dev"]})
    links = pd.DataFrame({"query_id": ["d", "d"], "doc_id": ["c", "b"], "nugget_id": ["s1", "s2"], "grade": [1, 1]})
    entry, selector, budget = method("coverage_greedy"), CoverageGreedy(soft=False, tau=0.3), Budget(k=2)
    pools = ranked_pools(pool, queries, matrix)
    gate_only = EstimateTrust(dev_auc=0.9, min_dev_auc=0.65, tune_split="dev", nugget_links=None, weights=None,
                              alpha=0.5)
    plain = run_method(entry, pools, [budget], SETTINGS, trust=gate_only)
    assert plain.table.equals(select_queries(pools, selector, [budget]).table)
    assert plain.decisions[2].blend is None and not plain.decisions[2].fell_back
    # By hand, per query (d first): b covers s2 and c s1 at tau 0.3, one new each; the tie goes to b (rank 2).
    assert plain.table["doc_id"].tolist() == ["b", "c", "b", "c"]
    from_table = run_method(entry, ranked_pools(pool, queries), [budget], SETTINGS, coverage=matrix, trust=gate_only)
    assert from_table.table.equals(plain.table)
    for dev_auc in (0.9, 0.5):
        trust = EstimateTrust(dev_auc=dev_auc, min_dev_auc=0.65, tune_split="dev", nugget_links=links,
                              weights=[0.0, 1.0], alpha=0.5)
        run_ = run_method(entry, pools, [budget], SETTINGS, trust=trust)
        expected_selector, expected_decision = trusting(selector, trust, pools, budget)
        assert run_.table.equals(select_queries(pools, expected_selector, [budget]).table)
        assert run_.decisions == {2: expected_decision}
        assert run_.decisions[2].fell_back is (dev_auc < 0.65)
        assert run_.details()["fell_back"] is (dev_auc < 0.65)


@pytest.fixture
def two_pools():
    """Three queries (q1 dev, q2 and q3 test), each with evidence documents a (nugget n1) and b (n2) and
    distractors x, y, z. The BM25 pool misses b and puts x first; the MCompass pool holds a, b first. A
    fourth query only the BM25 pool has is compared by neither."""
    queries = pd.DataFrame({"query_id": ["q1", "q2", "q3", "q4"], "split": ["dev", "test", "test", "test"]})
    evaluated = ["q1", "q2", "q3"]

    def pools(order, ids):
        return pd.DataFrame([{"query_id": q, "doc_id": f"{q}{d}", "rank": r, "score": -r}
                             for q in ids for r, d in enumerate(order, start=1)])

    links = pd.DataFrame([{"query_id": q, "doc_id": f"{q}{d}", "nugget_id": f"{q}{n}", "grade": 1}
                          for q in [*evaluated, "q4"] for d, n in (("a", "n1"), ("b", "n2"))])
    qrels = links[["query_id", "doc_id"]].assign(relevance=1)
    pools_by_source = {"bm25": pools("xayz", [*evaluated, "q4"]), "mcompass": pools("xyab", evaluated)}
    # an estimate equal to the gold: p = 1 on the linked pairs, 0 on every other (pool document, nugget)
    nuggets = links[["query_id", "nugget_id"]].drop_duplicates()
    matrices = {source: pool[["query_id", "doc_id"]].merge(nuggets, on="query_id").merge(links, how="left")
                .assign(probability=lambda m: m["grade"].fillna(0).astype(float))
                .rename(columns={"nugget_id": "subq_id"})[["query_id", "doc_id", "subq_id", "probability"]]
                for source, pool in pools_by_source.items()}
    return queries, links, qrels, pools_by_source, matrices


def compare(two_pools, dev_auc):
    queries, links, qrels, pools, matrices = two_pools
    trust = EstimateTrust(dev_auc=dev_auc, min_dev_auc=0.65, tune_split="dev", nugget_links=links,
                          weights=[0.0, 1.0], alpha=0.5)
    return compare_pools(pools, matrices, "coverage_greedy", SETTINGS, trust, links, qrels, queries,
                         ["dev", "test"], "test", "bm25", k=2, alpha=0.5)


def test_compare_pools_scores_both_selections_of_both_pools_by_hand(two_pools):
    compared = compare(two_pools, dev_auc=0.9)
    per_query = compared.per_query
    assert set(per_query["method"]) == {"bm25:pool_order", "bm25:coverage_greedy", "mcompass:pool_order",
                                        "mcompass:coverage_greedy"}
    assert set(per_query["query_id"]) == {"q1", "q2", "q3"} and set(per_query["metric"]) == {"alpha_ndcg@2",
                                                                                          "strecall@2"}
    strecall = tuple(compared.summary[("strecall@2", source)].to_dict() for source in ("bm25", "mcompass"))
    # k = 2 in pool order: BM25 (x, a) covers n1 of 2, MCompass (x, y) nothing; greedy on the exact estimate
    # takes a from BM25 (b is not in it) and a and b from MCompass
    assert strecall == ({POOL_ORDER: 0.5, "coverage_greedy": 0.5}, {POOL_ORDER: 0.0, "coverage_greedy": 1.0})
    assert compared.decisions["bm25"]["fell_back"] is False and compared.decisions["mcompass"]["blend_weight"] == 1.0
    paired = compared.paired.set_index(["selection", "metric"])
    assert set(paired["source"]) == {"mcompass"} and len(paired) == 4
    assert paired.loc[("coverage_greedy", "strecall@2"), ["n", "mean_difference", "wins"]].tolist() == [2, 0.5, 2]
    assert paired.loc[(POOL_ORDER, "strecall@2"), ["mean_difference", "losses"]].tolist() == [-0.5, 2]


def test_below_the_gate_coverage_greedy_is_the_pool_order_of_each_pool(two_pools):
    compared = compare(two_pools, dev_auc=0.5)
    wide = compared.per_query.pivot_table(index=["query_id", "metric"], columns="method", values="value")
    for source in ("bm25", "mcompass"):
        assert compared.decisions[source]["fell_back"] is True
        assert wide[f"{source}:coverage_greedy"].equals(wide[f"{source}:{POOL_ORDER}"])
    assert not math.isnan(compared.summary.loc["coverage_greedy", ("alpha_ndcg@2", "mcompass")])
