"""Whole-corpus retrieval served (serving/retriever.py, POST /v1/retrieve): a student registered in a real MLflow
registry (SQLite) with the retrieval corpus its version carries ranks, for any query, what the pipeline's
student_runs ranks for the same query, bank and student (what mcompass_retrieval stores); a token budget keeps the
ranked chunks up to the first that does not fit; bad requests are refused naming the field; a moved alias swaps the
retriever in."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from fastapi.testclient import TestClient

from covlab.models.biencoder import load_first_stage
from covlab.models.mcompass import (RETRIEVAL_CORPUS, RetrievalCorpus, StudentSettings, TrainingSettings,
                                    load_students, save_students, student_runs, student_variants, train_students)
from covlab.models.protocol import Fold
from covlab.models.retrieval import dense_top_k
from covlab.models.selectors import Budget
from covlab.models.topics import BankEncoder, KMeansTopics, build_bank
from covlab.serving import ServingError
from covlab.serving.http import ServedMethods, create_app, no_version, registry_retrievers
from covlab.serving.retriever import RETRIEVERS, load_retriever

TOPICS = {"harbour": ["The harbour market sells fish from the night boats at dawn.",
                      "Ferries leave the harbour for the islands every hour.",
                      "Fishing boats unload their catch on the harbour quay.",
                      "The harbour master keeps the tide tables for sailors."],
          "trams": ["Trams to the old town run every ten minutes until midnight.",
                    "Tram tickets are sold on board and at the kiosks by the stops.",
                    "The tram depot opens its doors to visitors in spring.",
                    "Night trams replace the day lines after midnight."],
          "museum": ["The museum of old maps is closed on Mondays.",
                     "Entry to the map museum is free on the first Sunday.",
                     "The museum shows sea charts from the sixteenth century.",
                     "Guided tours of the museum start at ten and at two."]}
QUERIES = {"q-harbour-1": ("When do the ferries leave the harbour?", "harbour"),
           "q-harbour-2": ("Where can I buy fresh fish?", "harbour"),
           "q-trams-1": ("How late do the trams run?", "trams"),
           "q-trams-2": ("Where do I buy a tram ticket?", "trams"),
           "q-museum-1": ("Is the museum open on Monday?", "museum"),
           "q-museum-2": ("Does the museum have old sea charts?", "museum")}
SMALL = StudentSettings(top_l=4, top_m=2, abstraction_dim=16, abstraction_heads=2, hidden=(32, 16))
MAX_LENGTH = 64
QUERY = "What time is the last tram to the old town?"


def _chunks() -> pd.DataFrame:
    rows = [(f"{topic}-{i}", f"doc-{topic}-{i // 2}", text, 5 + 3 * i + len(topic))
            for topic, texts in TOPICS.items() for i, text in enumerate(texts)]
    table = pd.DataFrame(rows, columns=["chunk_id", "doc_id", "text", "tokens"])
    return table.assign(start=0, end=table["text"].str.len())


def register(tracking, dataset: str, corpus: RetrievalCorpus, students, folder, attach: bool = True):
    """A student set registered as covlab.<dataset>.mcompass_student with its corpus beside it, as mcompass_student
    registers it."""
    weights = save_students(students, folder, {"bank_content_hash": corpus.bank.content_hash()})
    with tracking.training_run(f"covlab.{dataset}.mcompass_student", {}, {}) as run:
        ref = run.register(weights, {})
    if attach:
        tracking.store().attach(ref, corpus.save(folder.parent / f"{folder.name}-corpus"), RETRIEVAL_CORPUS)
    return ref


@pytest.fixture(scope="module")
def corpus(tiny_model):
    encode = load_first_stage(tiny_model, batch_size=16, max_length=MAX_LENGTH, device=torch.device("cpu"))
    chunks = _chunks()
    bank = build_bank(chunks["chunk_id"].tolist(), chunks["text"].tolist(), encode(chunks["text"].tolist()),
                      KMeansTopics(3, seed=0), top_m=2)
    vectors = dict(zip(QUERIES, encode([text for text, _ in QUERIES.values()])))
    return RetrievalCorpus.of(bank, chunks.sample(frac=1.0, random_state=1), BankEncoder(tiny_model, MAX_LENGTH)), \
        vectors, encode


def train(corpus, vectors, seed: int):
    bank, chunks = corpus.bank, corpus.chunks
    topic_of = dict(zip(chunks["chunk_id"], chunks["chunk_id"].str.split("-").str[0]))
    pairs = pd.DataFrame([(q, c, float(topic_of[c] == topic), np.nan) for q, (_, topic) in QUERIES.items()
                          for c in bank.chunk_ids], columns=["query_id", "chunk_id", "label", "teacher_logit"])
    plan = [Fold(0, ("q-harbour-1", "q-trams-1", "q-museum-1"), ("q-harbour-2", "q-trams-2"), ("q-museum-2",))]
    return train_students(bank, vectors, pairs, plan, student_variants(SMALL),
                          TrainingSettings(epochs=2, batch_size=32, seed=seed))


@pytest.fixture(scope="module")
def registry(corpus, tmp_path_factory):
    from covlab.resources.tracking import TrackingResource

    bank_corpus, vectors, _ = corpus
    folder = tmp_path_factory.mktemp("retriever")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    tracking = TrackingResource(tracking_uri=uri, artifact_root=str(folder / "artifacts"))
    ref = register(tracking, "t", bank_corpus, train(bank_corpus, vectors, seed=0), folder / "students")
    return {"uri": uri, "tracking": tracking, "ref": ref, "folder": folder, "cache": folder / "cache"}


@pytest.fixture(scope="module")
def retriever(registry):
    return load_retriever("t", tracking_uri=registry["uri"], cache=registry["cache"])


def test_a_served_ranking_is_student_runs_for_the_same_query_bank_and_student(corpus, registry, retriever):
    bank_corpus, _, encode = corpus
    folds, students = load_students(registry["tracking"].store().download(registry["ref"]))
    vector = {"q": encode([QUERY])[0]}
    for method in RETRIEVERS:
        served = retriever.retrieve(QUERY, 5, method=method)
        if method == "dense":  # mcompass_retrieval's dense run: the bank's embeddings' cosine to the query's
            index, scores = dense_top_k(vector["q"][None], bank_corpus.bank.embeddings, 5)
            expected = pd.DataFrame({"chunk_id": bank_corpus.bank.chunk_ids[index[0]], "score": scores[0]})
        else:
            expected = student_runs(bank_corpus.bank, vector, [Fold(0, (), (), ("q",))],
                                    {key: model for key, model in students.items() if key == (0, method)}, depth=5)
        assert served.ids == expected["chunk_id"].tolist(), method
        np.testing.assert_allclose([c.score for c in served.chunks], expected["score"], rtol=1e-5, atol=1e-6)
        assert served.ended_by == "k" and served.method == method
    by_id = bank_corpus.chunks.set_index("chunk_id")
    for chunk in served.chunks:  # passages, not only ids
        assert (chunk.doc_id, chunk.text, chunk.tokens) == tuple(by_id.loc[chunk.id, ["doc_id", "text", "tokens"]])
    (provenance,) = served.provenance
    assert (provenance.name, provenance.version, provenance.alias) == ("covlab.t.mcompass_student", 1, "candidate")
    assert served.bank_content_hash == bank_corpus.bank.content_hash() == retriever.describe()["bank_content_hash"]


def test_a_token_budget_keeps_the_ranked_chunks_up_to_the_first_that_does_not_fit(retriever):
    ranking = retriever.retrieve(QUERY, 12)
    tokens = [c.tokens for c in ranking.chunks]
    budget = tokens[0] + tokens[1] + tokens[2] + 1  # the first three fit, the fourth does not (every chunk > 1)
    served = retriever.retrieve(QUERY, budget=Budget(tokens=budget))
    assert served.ids == ranking.ids[:3] and served.tokens == budget - 1 and served.ended_by == "tokens"
    assert served.budget == {"tokens": budget}
    everything = retriever.retrieve(QUERY, budget=Budget(tokens=10_000))
    assert everything.ids == ranking.ids and everything.ended_by == "corpus"
    assert retriever.retrieve(QUERY, budget=Budget(k=20)).ended_by == "corpus"  # only 12 chunks
    capped = retriever.retrieve(QUERY, budget=Budget(tokens=10_000), max_chunks=4)
    assert capped.ids == ranking.ids[:4] and capped.ended_by == "max_chunks"


@pytest.mark.parametrize("call, words", [
    (lambda r: r.retrieve("  ", 3), "query: expected a non-empty string"),
    (lambda r: r.retrieve(QUERY, 0), "k: expected a positive whole number of chunks, got 0"),
    (lambda r: r.retrieve(QUERY), "k: give exactly one of k and budget; got neither"),
    (lambda r: r.retrieve(QUERY, 3, budget=Budget(k=3)), "k: give exactly one of k and budget; got both"),
    (lambda r: r.retrieve(QUERY, 3, method="bm25"), "method: 'bm25' does not retrieve from a registered corpus; "
                                                    "served: ['dense', 'mcompass', 'mcompass_no_selector', "
                                                    "'mcompass_mean_pool']"),
])
def test_the_library_refuses_a_bad_request_naming_the_field(retriever, call, words):
    with pytest.raises(ServingError) as refused:
        call(retriever)
    assert str(refused.value) == words


def test_a_dataset_without_a_registered_student_or_its_corpus_is_refused_naming_what_is_there(corpus, registry):
    bank_corpus, vectors, _ = corpus
    with pytest.raises(ServingError, match=r"dataset: 'nope' has no registered MCompassRAG student "
                                           r"\(covlab.nope.mcompass_student\); datasets with one: \['t'\]"):
        load_retriever("nope", tracking_uri=registry["uri"], cache=registry["cache"])
    register(registry["tracking"], "bare", bank_corpus, train(bank_corpus, vectors, seed=0),
             registry["folder"] / "bare", attach=False)
    with pytest.raises(ServingError, match="covlab.bare.mcompass_student/1 carries no retrieval corpus beside its "
                                           "weights"):
        load_retriever("bare", tracking_uri=registry["uri"], cache=registry["cache"])


def test_an_encoder_other_than_the_bank_s_is_named(corpus):
    bank_corpus, _, encode = corpus
    assert bank_corpus.encoder_mismatch(encode) is None
    assert bank_corpus.encoder_mismatch(lambda texts: np.eye(len(texts), 8)) == (
        f"it embeds in 8 dimensions, the bank's chunks are embedded in {bank_corpus.bank.embeddings.shape[1]}")
    rotated = lambda texts: np.roll(encode(texts), 1, axis=1)  # noqa: E731  same dimension, another space
    assert "cosine of" in bank_corpus.encoder_mismatch(rotated)


@pytest.fixture(scope="module")
def client(registry):
    retrievers = registry_retrievers("t", tracking_uri=registry["uri"], cache=registry["cache"])
    with TestClient(create_app(ServedMethods((), lambda name: None, no_version), retrievers=retrievers)) as test:
        yield test


def test_v1_retrieve_answers_what_the_library_retrieves(client, retriever):
    for request, expected in (({"k": 4}, retriever.retrieve(QUERY, 4)),
                              ({"budget": {"tokens": 40}, "method": "dense"},
                               retriever.retrieve(QUERY, budget=Budget(tokens=40), method="dense")),
                              ({"budget": {"k": 2}, "method": "mcompass_mean_pool"},
                               retriever.retrieve(QUERY, budget=Budget(k=2), method="mcompass_mean_pool"))):
        answer = client.post("/v1/retrieve", json={"query": QUERY, "dataset": "t", **request})
        assert answer.status_code == 200, answer.text
        assert answer.json() == json.loads(json.dumps(expected.to_dict()))
    assert answer.json()["provenance"][0]["name"] == "covlab.t.mcompass_student"
    listed = client.get("/v1/methods").json()["retrievers"]
    assert [(r["dataset"], r["methods"], r["models"][0]["version"], r["models"][0]["alias"]) for r in listed] == [
        ("t", list(RETRIEVERS), 1, "candidate")]
    assert client.get("/healthz").json()["retrievers"] == ["t"]
    assert "RetrieveRequest" in client.get("/openapi.json").json()["components"]["schemas"]


@pytest.mark.parametrize("change, status, where, words", [
    ({"query": ""}, 422, ["body", "query"], "at least 1 character"),
    ({"k": 0}, 422, ["body", "k"], "greater than 0"),
    ({"k": -2}, 422, ["body", "k"], "greater than 0"),
    ({"budget": {"tokens": 0}, "k": None}, 422, ["body", "budget", "tokens"], "greater than 0"),
    ({"budget": {"k": 2}}, 422, ["body"], "exactly one of k and budget; got both"),
    ({"k": None}, 422, ["body"], "exactly one of k and budget; got neither"),
    ({"dataset": None}, 422, ["body", "dataset"], "Field required"),
    ({"limit": 3}, 422, ["body", "limit"], "Extra inputs"),
])
def test_v1_retrieve_refuses_a_bad_field_naming_it(client, change, status, where, words):
    body = {k: v for k, v in {"query": QUERY, "dataset": "t", "k": 3, **change}.items() if v is not None}
    answer = client.post("/v1/retrieve", json=body)
    assert answer.status_code == status, answer.text
    assert any(e["loc"] == where and words in e["msg"] for e in answer.json()["detail"]), answer.json()


@pytest.mark.parametrize("change, words", [
    ({"dataset": "nope"}, "dataset: 'nope' is not served here; served: ['t']; covlab serve --dataset D retrieves "
                          "from D's corpus; datasets with a registered mcompass_student: "),
    ({"method": "bm25"}, "method: 'bm25' does not retrieve from a registered corpus"),
    ({"query": "   "}, "query: expected a non-empty string"),
])
def test_v1_retrieve_answers_400_for_what_the_retriever_refuses(client, change, words):
    answer = client.post("/v1/retrieve", json={"query": QUERY, "dataset": "t", "k": 3, **change})
    assert answer.status_code == 400 and words in answer.json()["detail"], answer.text


def test_a_moved_alias_swaps_the_retriever_in(corpus, registry, tmp_path):
    bank_corpus, vectors, _ = corpus
    retrievers = registry_retrievers("t", tracking_uri=registry["uri"], cache=registry["cache"])
    assert retrievers.poll() == []
    ref = register(registry["tracking"], "t", bank_corpus, train(bank_corpus, vectors, seed=5), tmp_path / "v2")
    assert retrievers.poll() == [f"dataset t: covlab.t.mcompass_student alias candidate moved v1 -> v{ref.version}"]
    (loaded,) = retrievers.loaded()
    assert loaded.versions == {"covlab.t.mcompass_student": ref.version} and loaded.replaced == {
        "covlab.t.mcompass_student": 1}
