"""Selection assets invoked directly on a hand-made pool with known answers: the asset keeps the evaluated
splits only, ranks from 1, and returns its table versioned by content."""

import pandas as pd
from dagster import AssetKey

from covlab.assets.selections import SELECTION_ASSETS
from covlab.models.schemas import NUGGET_LINKS, POOL_SCORES, POOLS, QUERIES
from covlab.models.versions import content_version
from covlab.resources.evaluation import EvaluationResource

EVALUATION = EvaluationResource(k=2)
QUERY_TABLE = QUERIES.conform(pd.DataFrame({"query_id": ["q1", "q2"], "text": ["one", "two"],
                                            "split": ["dev", "train"]}))  # q2 is not evaluated
DOCS = ["d1", "d2", "d3", "d4"]
BM25_POOLS = POOLS.conform(pd.DataFrame([{"query_id": q, "doc_id": d, "rank": r + 1, "score": 10.0 - r}
                                         for q in ("q1", "q2") for r, d in enumerate(DOCS)]))
# coverage-trained order d1, d2, d3, d4 (ties and fill of the oracle)
POOL_SCORE_TABLE = POOL_SCORES.conform(pd.DataFrame([{"query_id": q, "doc_id": d, "coverage_trained": 0.9 - 0.1 * i}
                                                      for q in ("q1", "q2") for i, d in enumerate(DOCS)]))
# q1's nuggets: d1 covers n1; d3 covers n1 and n2; d4 covers n3
LINKS = NUGGET_LINKS.conform(pd.DataFrame({"query_id": ["q1"] * 4, "doc_id": ["d1", "d3", "d3", "d4"],
                                           "nugget_id": ["n1", "n1", "n2", "n3"], "grade": [1] * 4}))


def _asset(name: str):
    return next(a for a in SELECTION_ASSETS if AssetKey(f"selection_{name}") in a.keys)


def _chosen(output) -> list[str]:
    return output.value.sort_values("rank")["doc_id"].tolist()


def test_bm25_selection_is_the_pool_s_first_k_of_the_evaluated_queries():
    output = _asset("bm25")(bm25_pools=BM25_POOLS, queries=QUERY_TABLE, evaluation=EVALUATION)
    assert list(output.value.columns) == ["query_id", "rank", "doc_id"]
    assert set(output.value["query_id"]) == {"q1"} and _chosen(output) == ["d1", "d2"]
    assert output.value["rank"].tolist() == [1, 2]
    assert output.data_version.value == content_version(output.value)
    assert output.metadata["queries"].value == 1 and output.metadata["ordered_by"].value == "bm25"


def test_oracle_greedy_takes_the_document_covering_most_then_the_one_adding_most():
    output = _asset("oracle_greedy")(bm25_pools=BM25_POOLS, scores=POOL_SCORE_TABLE, queries=QUERY_TABLE,
                                     coverage=LINKS, evaluation=EVALUATION)
    assert _chosen(output) == ["d3", "d4"]  # d3: n1 and n2; then d4 adds n3 (d1 adds nothing)
