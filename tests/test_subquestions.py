"""The offline decompositions (models/subquestions.py): the focused one's picks worked out by hand, the grounded
one's as the subquestions asset has always given them."""

import numpy as np
import pandas as pd
import pytest

from covlab.models.subquestions import (FocusSettings, focused_decomposition, focused_subquestions,
                                        grounded_decomposition)

QUERY = np.array([1.0, 0.0, 0.0])
# sentence -> unit vector; cosines to the query: restates 1.0, a 0.8, a_twin 0.8, b 0.7, c 0.5
VECTORS = {"restates": [1.0, 0.0, 0.0], "a": [0.8, 0.6, 0.0], "a_twin": [0.8, 0.6, 0.0],
           "b": [0.7, 0.0, np.sqrt(1 - 0.49)], "c": [0.5, -np.sqrt(0.75), 0.0]}


def _pick(settings: FocusSettings, sentences=tuple(VECTORS)) -> list[str]:
    vectors = np.array([VECTORS[s] for s in sentences])
    table = focused_subquestions("q1", QUERY, list(sentences), vectors, settings)
    assert list(table["subq_id"]) == [f"q1/f{i}" for i in range(len(table))]
    return list(table["text"])


def test_relevance_first_then_novelty_decides():
    # Step 1: a (0.8; ahead of its twin by position); the twin (cosine 1 to a) is dropped as a duplicate and
    # "restates" (cosine 1 > 0.9 to the query) never counts. Step 2 at lambda 0.5: b scores 0.5*0.7 - 0.5*0.56
    # = 0.07 (cos(a, b) = 0.56), c scores 0.5*0.5 - 0.5*0 = 0.25 (cos(a, c) < 0 adds no redundancy): c.
    assert _pick(FocusSettings(n=10, focus_lambda=0.5)) == ["a", "c", "b"]
    # At lambda 0.9 relevance weighs more: b 0.63 - 0.056 = 0.574 beats c 0.45.
    assert _pick(FocusSettings(n=10, focus_lambda=0.9)) == ["a", "b", "c"]
    assert _pick(FocusSettings(n=2, focus_lambda=0.5)) == ["a", "c"]


def test_duplicates_and_restatements_follow_their_thresholds():
    # With duplicates allowed (threshold 1), the twin comes back once a's redundancy no longer rules it out
    # by itself: at lambda 1 the order is pure relevance.
    assert _pick(FocusSettings(n=10, focus_lambda=1.0, duplicate_similarity=1.0)) == ["a", "a_twin", "b", "c"]
    assert _pick(FocusSettings(n=10, focus_lambda=1.0, max_query_similarity=1.0))[0] == "restates"
    assert _pick(FocusSettings(n=10, max_query_similarity=0.4)) == []  # every sentence restates the query
    assert _pick(FocusSettings(), sentences=()) == []


def test_every_distinct_text_is_encoded_once_for_the_whole_dataset():
    queries = pd.DataFrame({"query_id": ["q1", "q2"], "text": ["query", "query"]})
    pools = {"q1": ["Sentence a is here. Sentence b is here.", "Sentence a is here."],
             "q2": ["Sentence b is here. Sentence c is here."]}
    vectors = {"query": QUERY, "Sentence a is here.": VECTORS["a"], "Sentence b is here.": VECTORS["b"],
               "Sentence c is here.": VECTORS["c"]}
    calls = []

    def embed(texts):
        calls.append(list(texts))
        return np.array([vectors[t] for t in texts])

    table = focused_decomposition(queries, pools, embed, FocusSettings(n=10, focus_lambda=0.9))
    assert calls == [["query", "Sentence a is here.", "Sentence b is here.", "Sentence c is here."]]
    assert table.groupby("query_id")["text"].apply(list).to_dict() == {
        "q1": ["Sentence a is here.", "Sentence b is here."], "q2": ["Sentence b is here.", "Sentence c is here."]}
    empty = focused_decomposition(queries.head(1), {}, embed)
    assert empty.empty and list(empty.columns) == ["query_id", "subq_id", "text"]


@pytest.mark.parametrize("field, value", [("n", 0), ("focus_lambda", 1.5), ("duplicate_similarity", -0.1),
                                          ("max_query_similarity", 2.0)])
def test_settings_out_of_range_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"subquestions {field} must"):
        FocusSettings(**{field: value})


# Three queries, one without a pool; the first pool sentence of q2 restates its query (cosine 0.996).
GROUNDED_QUERIES = pd.DataFrame({"query_id": ["q1", "q2", "q3"], "text": [
    "How does the harbour town manage its fishing fleet?", "What do residents think about the new lighthouse?",
    "Who pays for the school buses?"]})
GROUNDED_POOLS = {
    "q1": ["The harbour town manages its fishing fleet through a council. Quotas are set every spring by vote. "
           "Boats must report their catch at the pier office. Old nets are recycled into fences.",
           "Fishermen complain that the quotas are too strict. The pier office opens at dawn every day. "
           "Young crews train on the older boats first.",
           "Storms close the harbour for weeks each winter. The council pays crews a small sum during closures."],
    "q2": ["What do the residents think about the new lighthouse? Residents say the new lighthouse is too bright at "
           "night. Some residents like the modern design. The old lighthouse keeper retired last year.",
           "Storms close the harbour for weeks each winter. Tourists photograph the lighthouse at sunset. "
           "The light can be seen from the northern island."]}


def test_grounded_decomposition_gives_the_subquestions_the_asset_gave_and_reports_progress():
    """The subquestions the asset's own loop over queries gave for these pools under the packaged MiniLM on CPU
    (n 2, seed 0; recorded before the loop moved here). Two clusters per query keep every pick clear of a tie,
    so the floats of another CPU give the same. Each query's texts are one encoder call, as they were."""
    import torch

    from covlab.models.biencoder import encode, load_biencoder
    from covlab.models.encoders import default_base_model

    model, tokenizer, _ = load_biencoder(default_base_model(), torch.device("cpu"))
    calls, reports = [], []

    def embed(texts):
        calls.append(texts)
        return encode(model, tokenizer, texts, device=torch.device("cpu"))

    table = grounded_decomposition(GROUNDED_QUERIES, GROUNDED_POOLS, embed, n=2, max_query_similarity=0.9, seed=0,
                                   progress=reports.append)
    assert table.to_dict("list") == {
        "query_id": ["q1", "q1", "q2", "q2"], "subq_id": ["q1/g0", "q1/g1", "q2/g0", "q2/g1"],
        "text": ["Boats must report their catch at the pier office.", "Old nets are recycled into fences.",
                 "Residents say the new lighthouse is too bright at night.",
                 "Storms close the harbour for weeks each winter."]}
    assert [len(texts) for texts in calls] == [10, 8] and [texts[0] for texts in calls] == list(
        GROUNDED_QUERIES["text"][:2])  # q3 has no sentences: nothing encoded
    assert reports and reports[-1].label == "grounded subquestions" and reports[-1].unit == "queries"
    assert (reports[-1].done, reports[-1].total) == (3, 3)
    assert grounded_decomposition(GROUNDED_QUERIES.head(0), {}, embed).empty
