"""BM25 pools: Lucene's formula by hand on a tiny corpus, agreement with bm25s on the demo corpus, and
the `given` pool mode."""

import math

import numpy as np
import pandas as pd
import pytest

from covlab.models.pools import merge_given_and_distractors
from covlab.resources.lucene import LuceneResource, configure_jvm

TINY = pd.DataFrame({
    "doc_id": ["d1", "d2", "d3", "d4"], "title": "",
    "text": ["apple banana apple", "banana cherry", "cherry cherry cherry grape", "grape melon kiwi lemon"],
    "source_unit": ["d1", "d2", "d3", "d4"]})


def lucene_bm25(query_terms, doc_terms, corpus_terms, k1=0.9, b=0.4):
    """Lucene's BM25Similarity: sum over query terms of idf * tf / (tf + k1 * (1 - b + b * dl / avgdl)),
    idf = ln(1 + (N - df + 0.5) / (df + 0.5)); Lucene 8+ drops the (k1 + 1) factor."""
    n = len(corpus_terms)
    avgdl = sum(len(d) for d in corpus_terms) / n
    score = 0.0
    for term in query_terms:
        tf = doc_terms.count(term)
        if tf == 0:
            continue
        df = sum(term in d for d in corpus_terms)
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        score += idf * tf / (tf + k1 * (1 - b + b * len(doc_terms) / avgdl))
    return score


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    target = tmp_path_factory.mktemp("lucene") / "tiny"
    LuceneResource().build_index(TINY, target)
    return target


def test_scores_and_order_match_lucene_formula_by_hand(tiny_index):
    queries = pd.DataFrame({"query_id": ["q"], "text": ["apple cherry"], "split": ["test"]})
    pools = LuceneResource().top_n(tiny_index, queries, n=10)
    corpus_terms = [t.split() for t in TINY["text"]]
    expected = {d: lucene_bm25(["apple", "cherry"], terms, corpus_terms) for d, terms in zip(TINY["doc_id"], corpus_terms)}
    # by hand: d1 = ln(1 + 3.5/1.5) * 2 / (2 + 0.9 * (0.6 + 0.4 * 3 / 3.25)) = 1.6297...
    assert expected["d1"] == pytest.approx(math.log(1 + 3.5 / 1.5) * 2 / (2 + 0.9 * (0.6 + 0.4 * 3 / 3.25)))
    assert pools["doc_id"].tolist() == ["d1", "d3", "d2"]  # d4 matches no query term
    for doc_id, score in zip(pools["doc_id"], pools["score"]):
        assert score == pytest.approx(expected[doc_id], abs=1e-4)
    assert pools["rank"].tolist() == [1, 2, 3]


def test_given_mode_scores_each_candidate_exactly(tiny_index):
    queries = pd.DataFrame({"query_id": ["q"], "text": ["apple cherry"], "split": ["test"]})
    candidates = pd.DataFrame({"query_id": ["q", "q", "q"], "doc_id": ["d4", "d2", "d3"]})
    pools = LuceneResource().score_pairs(tiny_index, queries, candidates)
    corpus_terms = [t.split() for t in TINY["text"]]
    assert pools["doc_id"].tolist() == ["d3", "d2", "d4"]  # only candidates, BM25 order, unmatched last
    for doc_id, score in zip(pools["doc_id"], pools["score"]):
        terms = corpus_terms[int(doc_id[1]) - 1]
        assert score == pytest.approx(lucene_bm25(["apple", "cherry"], terms, corpus_terms), abs=1e-5)


def test_k1_and_b_reach_the_searcher(tiny_index):
    queries = pd.DataFrame({"query_id": ["q"], "text": ["cherry"], "split": ["test"]})
    pools = LuceneResource(k1=1.2, b=0.75).top_n(tiny_index, queries, n=2)
    corpus_terms = [t.split() for t in TINY["text"]]
    assert pools["score"].iloc[0] == pytest.approx(lucene_bm25(["cherry"], corpus_terms[2], corpus_terms, 1.2, 0.75),
                                                   abs=1e-4)


def test_distractors_are_added_from_outside_the_given_pool():
    given = pd.DataFrame({"query_id": ["q", "q"], "doc_id": ["a", "b"], "rank": [1, 2], "score": [3.0, 1.0]})
    hits = pd.DataFrame({"query_id": ["q"] * 4, "doc_id": ["a", "x", "y", "z"], "rank": [1, 2, 3, 4],
                         "score": [3.0, 2.0, 0.5, 0.4]})
    pools = merge_given_and_distractors(given, hits, distractors=2)
    assert pools["doc_id"].tolist() == ["a", "x", "b", "y"]
    assert pools["rank"].tolist() == [1, 2, 3, 4]


def test_top10_agrees_with_bm25s_on_the_demo_corpus(tmp_path, demo_dataset):
    """Our Lucene BM25 and bm25s's Lucene variant give each demo query the same top-10 scores and the same top-10
    documents, up to which of the documents tied at the 10th score make the cut (the demo's distractors restate
    the question, so several share that score and each engine breaks the tie its own way)."""
    bm25s = pytest.importorskip("bm25s")
    configure_jvm()
    from pyserini.analysis import Analyzer, get_lucene_analyzer

    lucene = LuceneResource()
    lucene.build_index(demo_dataset.corpus, tmp_path / "demo")
    pools = lucene.top_n(tmp_path / "demo", demo_dataset.queries, n=10)
    analyzer = Analyzer(get_lucene_analyzer())  # the same analyzed tokens on both sides
    retriever = bm25s.BM25(method="lucene", k1=0.9, b=0.4)
    retriever.index([analyzer.analyze(t) for t in demo_dataset.corpus["text"]], show_progress=False)
    doc_ids = np.array(demo_dataset.corpus["doc_id"])
    for qid, text in zip(demo_dataset.queries["query_id"], demo_dataset.queries["text"]):
        results, scores = retriever.retrieve([analyzer.analyze(text)], k=10, show_progress=False)
        ours = pools[pools["query_id"] == qid].sort_values("rank")
        np.testing.assert_allclose(ours["score"].to_numpy(), scores[0], atol=1e-3, err_msg=qid)
        cutoff = scores[0][-1] + 1e-3
        above = lambda ids, values: {d for d, v in zip(ids, values) if v > cutoff}  # noqa: E731
        assert above(ours["doc_id"], ours["score"]) == above(doc_ids[results[0]], scores[0]), qid


def test_jvm_heap_is_capped_by_config(tmp_path, demo_dataset):
    """The JVM starts once per process, so a fresh interpreter builds an index with max_heap_mb=256 and
    reports the JVM's own maximum heap."""
    import subprocess
    import sys

    script = (
        "import sys, pandas as pd\n"
        "from covlab.resources.lucene import LuceneResource\n"
        "corpus = pd.read_parquet(sys.argv[1])\n"
        "LuceneResource(max_heap_mb=256).build_index(corpus, sys.argv[2])\n"
        "from pyserini.pyclass import autoclass\n"
        "print(autoclass('java.lang.Runtime').getRuntime().maxMemory() // 2**20)\n")
    corpus = tmp_path / "corpus.parquet"
    demo_dataset.corpus.head(20).to_parquet(corpus)
    done = subprocess.run([sys.executable, "-c", script, str(corpus), str(tmp_path / "index")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 200 <= int(done.stdout.strip().splitlines()[-1]) <= 256


@pytest.mark.parametrize("n", [0, -5, 10**23])
def test_a_pool_depth_out_of_range_is_refused_in_config_naming_the_key(n):
    """bm25_pools' `n` below 1 or past MAX_POOL_DEPTH is a config error naming `n` and the bound, before any
    Lucene call (the JVM failed deep inside batch_search on these)."""
    from dagster import DagsterInstance, asset, materialize
    from pydantic import ValidationError

    from covlab.assets.pools import MAX_POOL_DEPTH, PoolConfig
    from covlab.orchestration.failures import failure_line

    with pytest.raises(ValidationError) as error:
        PoolConfig(n=n)
    [problem] = error.value.errors()
    assert problem["loc"] == ("n",)
    assert (f"less than or equal to {MAX_POOL_DEPTH}" if n > 0 else "greater than or equal to 1") in problem["msg"]
    assert PoolConfig(n=1).n == 1 and PoolConfig(n=MAX_POOL_DEPTH).n == MAX_POOL_DEPTH

    @asset
    def pool_probe(config: PoolConfig) -> int:  # the config class as Dagster validates a run's config
        return config.n

    with DagsterInstance.ephemeral() as instance:
        with pytest.raises(Exception) as raised:
            materialize([pool_probe], instance=instance, run_config={"ops": {"pool_probe": {"config": {"n": n}}}})
        [run] = instance.get_runs()
        line = failure_line(raised.value, instance, run.run_id, {})
    assert line.startswith("asset pool_probe config: n: Input should be") and f"got {n}" in line


@pytest.mark.parametrize("settings,key", [({"threads": -3}, "threads"), ({"threads": 0}, "threads"),
                                          ({"k1": -0.1}, "k1"), ({"b": 1.5}, "b")])
def test_invalid_lucene_settings_are_refused_naming_the_key(settings, key):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as error:
        LuceneResource(**settings)
    assert [problem["loc"] for problem in error.value.errors()] == [(key,)]
    assert LuceneResource(threads=1).threads == 1


def test_distractors_below_minus_one_are_refused():
    from pydantic import ValidationError

    from covlab.assets.pools import PoolConfig

    with pytest.raises(ValidationError, match="distractors"):
        PoolConfig(distractors=-2)
