"""MCompassRAG's student (models/mcompass.py): the loss by hand, the properties METHODS.md §4 and the issue
name (order-free scores, dense reduction, seeded identity), pair sampling, the estimator teacher, the students
of each fold of the evaluation protocol (models/protocol.py) and their runs."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from covlab.models.mcompass import (STUDENT, BankTensors, MCompassStudent, PairSettings, StudentSettings,
                                    TrainingSettings, distillation_loss, estimator_teacher, heldout_ie, llm_teacher,
                                    load_student, load_students, rating_logit, retrieve, sample_pairs, save_student,
                                    save_students, student_runs, student_variants, train_student, train_students)
from covlab.models.protocol import EvaluationProtocol, Fold
from covlab.models.topics import TopicBank

torch.set_num_threads(1)
SMALL = StudentSettings(top_l=8, top_m=3, abstraction_dim=16, abstraction_heads=2, hidden=(32, 16))


def unit(matrix):
    return (matrix / np.linalg.norm(matrix, axis=1, keepdims=True)).astype(np.float32)


def clustered_bank(n_topics=4, per_topic=15, dim=12, seed=0):
    """A bank whose chunks sit around `n_topics` directions; theta is the softmax over cosines to them."""
    rng = np.random.default_rng(seed)
    centroids = unit(rng.normal(size=(n_topics, dim)))
    topic = np.repeat(np.arange(n_topics), per_topic)
    embeddings = unit(centroids[topic] + 0.3 * rng.normal(size=(len(topic), dim)))
    logits = embeddings @ centroids.T / 0.05
    theta = np.exp(logits - logits.max(axis=1, keepdims=True))
    theta = (theta / theta.sum(axis=1, keepdims=True)).astype(np.float32)
    ids = np.array([f"c{i:03d}" for i in range(len(topic))])
    return TopicBank(chunk_ids=ids, embeddings=embeddings, centroids=centroids, theta=theta, top_m=3), topic


def test_distillation_loss_by_hand():
    z, y, t = torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.0, float("nan")])
    bce = (math.log(2) + math.log(1 + math.exp(2.0))) / 2
    # the only taught pair has z = z_t: its KL is 0, so the loss is the weighted BCE
    assert distillation_loss(z, y, t, alpha=0.5, tau=1.0).item() == pytest.approx(0.5 * bce, rel=1e-6)
    # KL(Bern(0.5) || Bern(sigmoid(2))) at tau = 2: z/tau = 1
    q = 1 / (1 + math.exp(-1.0))
    kl = 0.5 * math.log(0.5 / q) + 0.5 * math.log(0.5 / (1 - q))
    got = distillation_loss(torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([0.0]), alpha=0.5, tau=2.0)
    assert got.item() == pytest.approx(0.5 * math.log(1 + math.exp(-2.0)) + 0.5 * 4 * kl, rel=1e-6)
    assert distillation_loss(z, y, torch.full((2,), float("nan")), 0.5, 1.0).item() == pytest.approx(0.5 * bce)


def test_rating_logit_is_monotone_and_symmetric():
    logits = rating_logit(np.arange(6))
    assert np.all(np.diff(logits) > 0) and logits[0] == pytest.approx(-logits[5])


@pytest.mark.parametrize("abstraction", ["transformer", "mean"])
def test_scores_do_not_depend_on_corpus_order(abstraction):
    bank, _ = clustered_bank()
    torch.manual_seed(0)
    model = MCompassStudent(12, 4, StudentSettings(**{**SMALL.__dict__, "abstraction": abstraction})).eval()
    queries = torch.as_tensor(unit(np.random.default_rng(1).normal(size=(3, 12))))
    order = np.random.default_rng(2).permutation(len(bank.chunk_ids))
    shuffled = TopicBank(chunk_ids=bank.chunk_ids[order], embeddings=bank.embeddings[order],
                         centroids=bank.centroids, theta=bank.theta[order], top_m=3)
    plain = model.score_corpus(queries, BankTensors.of(bank, torch.device("cpu")))
    moved = model.score_corpus(queries, BankTensors.of(shuffled, torch.device("cpu")))
    torch.testing.assert_close(moved, plain[:, order], rtol=1e-5, atol=1e-5)


def test_without_the_topic_part_the_student_is_a_dense_scorer():
    bank, _ = clustered_bank()
    zeroed = TopicBank(chunk_ids=bank.chunk_ids, embeddings=bank.embeddings, centroids=bank.centroids,
                       theta=bank.theta, top_m=3)
    torch.manual_seed(0)
    model = MCompassStudent(12, 4, SMALL).eval()
    tensors = BankTensors.of(zeroed, torch.device("cpu"))
    tensors = BankTensors(tensors.embeddings, torch.zeros_like(tensors.centroids), tensors.theta,
                          torch.zeros_like(tensors.mixed), torch.zeros_like(tensors.topics))
    queries = torch.as_tensor(unit(np.random.default_rng(1).normal(size=(2, 12))))
    # a plain MLP on [e_q ; e_c ; e_q . e_c] with the scorer's weights of those columns
    dense = torch.nn.Sequential(torch.nn.Linear(25, 32), *model.head)
    with torch.no_grad():
        dense[0].weight.copy_(torch.cat([model.query_layer.weight[:, :12], model.chunk_layer.weight[:, :12],
                                         model.similarity_layer.weight[:, :1]], dim=1))
        dense[0].bias.copy_(model.query_layer.bias)
        e_q, e_c = queries.repeat_interleave(60, 0), tensors.embeddings.repeat(2, 1)
        cosine = (e_q * e_c).sum(1, keepdim=True)
        expected = (dense.eval()(torch.cat([e_q, e_c, cosine], dim=1))
                    + model.similarity_skip.weight[0, 0] * cosine).reshape(2, 60)
    torch.testing.assert_close(model.score_corpus(queries, tensors), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_floats", [1, 32, 5 * 32, 3 * 32 * 7, 10 ** 9])
def test_scores_are_the_same_for_any_block_of_chunks(block_floats):
    """score_corpus runs the head over blocks of chunks (one chunk per block at 1 float, several, blocks that
    do not divide the 60 chunks, the whole corpus at once): the logits are the whole corpus' (to BLAS's
    rounding of a smaller product) and rank the chunks alike."""
    bank, _ = clustered_bank()
    torch.manual_seed(0)
    model = MCompassStudent(12, 4, SMALL).eval()
    tensors = BankTensors.of(bank, torch.device("cpu"))
    queries = torch.as_tensor(unit(np.random.default_rng(1).normal(size=(3, 12))))
    for batch in (queries, queries[1:2]):  # a block is B x rows: one query's blocks are 3 times longer
        whole = model.score_corpus(batch, tensors, block_floats=10 ** 9)
        blocked = model.score_corpus(batch, tensors, block_floats=block_floats)
        assert blocked.shape == whole.shape == (len(batch), 60)
        torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)
        assert torch.equal(blocked.argsort(dim=1, stable=True), whole.argsort(dim=1, stable=True))


def _pairs(bank, topic, queries):
    """Training pairs: each query's evidence is the chunks of its topic."""
    rows = [(q, c, float(topic[i] == t)) for q, t in queries.items() for i, c in enumerate(bank.chunk_ids)
            if topic[i] == t or i % 4 == 0]
    return pd.DataFrame(rows, columns=["query_id", "chunk_id", "label"]).assign(teacher_logit=np.nan)


def test_training_twice_with_one_seed_gives_identical_weights(tmp_path):
    bank, topic = clustered_bank()
    vectors = {f"q{t}": bank.centroids[t] for t in range(4)}
    pairs = _pairs(bank, topic, {f"q{t}": t for t in range(4)})
    training = TrainingSettings(epochs=2, batch_size=32, seed=7)
    first = train_student(bank, vectors, pairs, SMALL, training).model.state_dict()
    second = train_student(bank, vectors, pairs, SMALL, training).model.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = train_student(bank, vectors, pairs, SMALL, TrainingSettings(epochs=2, batch_size=32, seed=8)).model
    assert not torch.equal(first["query_layer.weight"], other.state_dict()["query_layer.weight"])
    model = train_student(bank, vectors, pairs, SMALL, training).model
    loaded, info = load_student(save_student(model, tmp_path / "student", {"bank_content_hash": "x"}))
    assert info["bank_content_hash"] == "x"
    assert all(torch.equal(loaded.state_dict()[k], first[k]) for k in first)


def test_a_trained_student_retrieves_its_topic_for_unseen_queries():
    """Queries near a topic's direction have that topic's chunks as evidence; trained on some queries and
    stopped early on others, the student ranks the evidence of new queries of the same topics first (dense
    cosine: precision@10 0.9 here, chance 0.25; without early stopping the student memorises: ~0.7)."""
    bank, topic = clustered_bank(per_topic=20)
    rng = np.random.default_rng(3)
    make = lambda t: unit((bank.centroids[t] + 0.3 * rng.normal(size=12))[None])[0]  # noqa: E731
    train = {f"train{t}_{j}": t for t in range(4) for j in range(3)}
    test, dev = {f"test{t}": t for t in range(4)}, {f"dev{t}": t for t in range(4)}
    vectors = {q: make(t) for q, t in {**train, **test, **dev}.items()}
    trained = train_student(bank, vectors, _pairs(bank, topic, train), SMALL,
                            TrainingSettings(epochs=30, batch_size=64, learning_rate=3e-3),
                            dev_pairs=_pairs(bank, topic, dev))
    assert trained.epoch_losses[-1] < trained.epoch_losses[0]
    assert trained.dev_losses[trained.kept_epoch] == min(trained.dev_losses) and len(trained.dev_losses) == 31
    index, _ = retrieve(trained.model, bank, np.stack([vectors[q] for q in test]), k=10)
    precision = np.mean([np.mean(topic[row] == t) for row, t in zip(index, test.values())])
    assert precision >= 0.8


def test_sample_pairs():
    chunk_ids = [f"c{i}" for i in range(50)]
    evidence = {"q1": {"c1", "c2", "c3"}, "q2": set()}
    ranking = {"q1": ["c2", "c9", "c1", "c8", "c7", "c6", "c5", "c4"]}
    settings = PairSettings(positives=2, random_negatives=3, hard_negatives=2, seed=1)
    pairs = sample_pairs(["q1", "q2"], evidence, ranking, chunk_ids, settings)
    assert set(pairs["query_id"]) == {"q1"}  # q2 has no evidence: no pairs
    positives = pairs[pairs["label"] == 1]["chunk_id"].tolist()
    negatives = pairs[pairs["label"] == 0]["chunk_id"].tolist()
    assert len(positives) == 2 and set(positives) <= evidence["q1"]
    assert negatives[:4] == ["c9", "c8", "c7", "c6"]  # hard: BM25 order, evidence skipped
    assert len(negatives) == 4 + 6 and not set(negatives) & evidence["q1"] and len(set(negatives)) == 10
    assert pairs["kind"].tolist() == ["positive"] * 2 + ["hard"] * 4 + ["random"] * 6
    again = sample_pairs(["q1"], evidence, ranking, list(reversed(chunk_ids)), settings)
    pd.testing.assert_frame_equal(pairs.reset_index(drop=True), again.reset_index(drop=True))


def test_estimator_teacher_takes_the_best_subquestion():
    pairs = pd.DataFrame({"query_id": ["q1", "q1", "q2"], "chunk_id": ["a", "b", "a"]})
    probability = {("s1", "A"): 0.2, ("s2", "A"): 0.9, ("s1", "B"): 0.5, ("s2", "B"): 0.1, ("query two", "A"): 0.3}
    logits = estimator_teacher(pairs, {"q1": "query one", "q2": "query two"}, {"q1": ["s1", "s2"]},
                               {"a": "A", "b": "B"}, lambda asked: np.array([probability[p] for p in asked]))
    np.testing.assert_allclose(logits, [math.log(9), 0.0, math.log(0.3 / 0.7)], rtol=1e-9)


def test_evaluation_folds():
    """The students' folds are the protocol's fold plan: under split train -> dev -> test; under grouped_cv
    (topics t0 = {a, d}, t1 = {b}, t2 = {c}, which seed 1 puts in folds 0, 1, 2) fold f evaluated, fold f + 1
    the tune fold, the rest train."""
    queries = pd.DataFrame({"query_id": ["a", "b", "c", "d"], "split": ["train", "train", "dev", "test"],
                            "topic": ["t0", "t1", "t2", "t0"]})
    assert EvaluationProtocol("split", splits=["test"]).fold_plan(queries) == [Fold(0, ("a", "b"), ("c",), ("d",))]
    folds = EvaluationProtocol("grouped_cv", splits=["test"], folds=3, seed=1).fold_plan(queries)
    assert folds == [Fold(0, ("c",), ("b",), ("a", "d")), Fold(1, ("a", "d"), ("c",), ("b",)),
                     Fold(2, ("b",), ("a", "d"), ("c",))]
    with pytest.raises(ValueError, match="protocol"):
        EvaluationProtocol("loo")


def test_student_runs_cover_every_variant_and_evaluated_query(tmp_path):
    bank, topic = clustered_bank()
    vectors = {f"q{t}": bank.centroids[t] for t in range(4)}
    pairs = _pairs(bank, topic, {f"q{t}": t for t in range(4)})
    plan = [Fold(0, ("q0",), ("q1",), ("q2", "q3")), Fold(1, ("q2", "q3"), ("q1",), ("q0",))]
    trained = train_students(bank, vectors, pairs, plan, student_variants(SMALL),
                             TrainingSettings(epochs=1, batch_size=64))
    variants = {"mcompass", "mcompass_no_selector", "mcompass_mean_pool"}
    assert STUDENT == "mcompass" and trained.folds == tuple(plan)
    assert set(trained.students) == {(fold, method) for fold in (0, 1) for method in variants}
    students = {key: student.model for key, student in trained.students.items()}
    runs = student_runs(bank, vectors, trained.folds, students, depth=5)
    assert set(runs["method"]) == variants
    assert runs.groupby(["method", "query_id"]).size().eq(5).all() and set(runs["query_id"]) == {"q0", "q2", "q3"}
    # each fold's evaluated queries are retrieved by that fold's students alone
    alone = student_runs(bank, vectors, plan[:1], {k: m for k, m in students.items() if k[0] == 0}, depth=5)
    pd.testing.assert_frame_equal(runs[runs["query_id"].isin(["q2", "q3"])].reset_index(drop=True),
                                  alone.reset_index(drop=True))
    # what save_students writes, load_students reads back: the same folds, the same runs
    folds, loaded = load_students(save_students(trained, tmp_path / "students", {"bank_content_hash": "x"}))
    assert folds == tuple(plan) and set(loaded) == set(students)
    pd.testing.assert_frame_equal(student_runs(bank, vectors, folds, loaded, depth=5), runs)
    top, info = load_student(tmp_path / "students")  # the registered model: the first fold's full student
    assert info["bank_content_hash"] == "x"
    assert all(torch.equal(top.state_dict()[k], v) for k, v in students[(0, STUDENT)].state_dict().items())


def test_llm_teacher_rates_expanded_queries_through_the_llm_resource(tmp_path):
    """The llm teacher against a real local OpenAI-compatible server: each pair is one CRUX judge prompt of
    the question and its subquestions against the chunk; ratings become logits; a second run is cached."""
    from fake_llm_server import FakeLLMServer, Reply

    from covlab.models.prompts import JUDGE_VERSION, parse_rating
    from covlab.resources.llm import LLMResource

    def responder(body):
        prompt = body["messages"][-1]["content"]
        assert "Question: Is tea healthy?\n- Does tea lower blood pressure?" in prompt
        return Reply.answer("Rating: 5" if "Context: Tea lowers" in prompt else "0")

    pairs = pd.DataFrame({"query_id": ["q1", "q1"], "chunk_id": ["a", "b"]})
    with FakeLLMServer(responder) as server:
        llm = LLMResource(backend="openai", base_url=server.url, model="fake", cache_url=f"sqlite:///{tmp_path}/c.db")
        rate = lambda asked: llm.chat_json_many(JUDGE_VERSION, asked, parse_rating)  # noqa: E731
        logits = llm_teacher(pairs, {"q1": "Is tea healthy?"}, {"q1": ["Does tea lower blood pressure?"]},
                             {"a": "Tea lowers blood pressure a little.", "b": "Coffee is brewed."}, rate)
        again = llm_teacher(pairs, {"q1": "Is tea healthy?"}, {"q1": ["Does tea lower blood pressure?"]},
                            {"a": "Tea lowers blood pressure a little.", "b": "Coffee is brewed."}, rate)
        llm.close()
        assert len(server.requests) == 2  # the second run came from the cache
    np.testing.assert_allclose(logits, rating_logit(np.array([5, 0])))
    np.testing.assert_array_equal(logits, again)


def test_selection_by_heldout_ie_keeps_the_best_scoring_epoch():
    bank, topic = clustered_bank()
    vectors = {f"q{t}": bank.centroids[t] for t in range(4)} | {f"d{t}": bank.centroids[t] for t in range(4)}
    pairs = _pairs(bank, topic, {f"q{t}": t for t in range(4)})
    evidence = _pairs(bank, topic, {f"d{t}": t for t in range(4)}).query("label == 1")[["query_id", "chunk_id"]]
    tokens = pd.Series(20, index=bank.chunk_ids)
    select = heldout_ie(bank, vectors, [f"d{t}" for t in range(4)] + ["no-evidence"], evidence, tokens)
    epochs_seen = {}
    trained = train_student(bank, vectors, pairs, SMALL, TrainingSettings(epochs=4, batch_size=64), select=select,
                            on_epoch=epochs_seen.__setitem__)
    assert len(trained.dev_scores) == 5 and trained.dev_scores[trained.kept_epoch] == max(trained.dev_scores)
    assert epochs_seen == {e: {"train_loss": loss, "dev_score": score} for e, loss, score in
                           zip((1, 2, 3, 4), trained.epoch_losses, trained.dev_scores[1:])}
    assert select(trained.model) == pytest.approx(max(trained.dev_scores))  # the kept weights are that epoch's
    assert heldout_ie(bank, vectors, ["no-evidence"], evidence, tokens) is None


def test_student_config_sets_the_scorer_widths_and_refuses_other_than_two():
    from covlab.assets.mcompass import StudentConfig

    assert StudentConfig().student().hidden == StudentSettings().hidden == (1024, 256)
    model = MCompassStudent(12, 4, StudentConfig(hidden=[8, 4]).student())
    assert (model.head[2].in_features, model.head[2].out_features) == (8, 4)
    for bad in ([8], [8, 4, 2], [8, 0]):
        with pytest.raises(ValueError, match="hidden: expected two positive layer widths"):
            StudentConfig(hidden=bad).student()


def test_a_student_that_training_only_makes_worse_keeps_its_initialisation():
    """Trained on inverted labels (each query's own topic as the negatives), every epoch retrieves worse on the
    held-out queries than the untrained student does, so the untrained weights are kept (epoch 0): the
    student cannot end below its initialisation on the queries it is chosen by."""
    bank, topic = clustered_bank()
    vectors = {f"q{t}": bank.centroids[t] for t in range(4)} | {f"d{t}": bank.centroids[t] for t in range(4)}
    inverted = _pairs(bank, topic, {f"q{t}": t for t in range(4)}).assign(label=lambda p: 1.0 - p["label"])
    evidence = _pairs(bank, topic, {f"d{t}": t for t in range(4)}).query("label == 1")[["query_id", "chunk_id"]]
    select = heldout_ie(bank, vectors, [f"d{t}" for t in range(4)], evidence, pd.Series(20, index=bank.chunk_ids))
    untrained = train_student(bank, vectors, inverted, SMALL, TrainingSettings(epochs=0), select=select)
    trained = train_student(bank, vectors, inverted, SMALL,
                            TrainingSettings(epochs=4, batch_size=32, learning_rate=0.1), select=select)
    assert trained.dev_scores[0] == untrained.dev_scores[0] == pytest.approx(select(untrained.model))
    assert max(trained.dev_scores[1:]) < trained.dev_scores[0]  # what training did: only harm
    assert trained.kept_epoch == 0 and select(trained.model) == pytest.approx(trained.dev_scores[0])
