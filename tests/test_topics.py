"""Topic metadata bank (models/topics.py, METHODS.md §4 "Bank", "Topic model"): theta on the simplex and unit
centroids, determinism, recovery of well-separated clusters, the top-M topic vectors by hand and their
gradient, the bank's refusals, the save/load round trip and its content hash, the cap on K, and c-TF-IDF terms
on a hand corpus."""

import numpy as np
import pytest
import torch

from covlab.models.topics import (BankError, KMeansTopics, TopicBank, build_bank, effective_topics,
                                  mixed_centroids, topic_summary, topic_vectors)

torch.set_num_threads(1)


def unit_rows(matrix) -> np.ndarray:
    matrix = np.asarray(matrix, dtype=float)
    return matrix / np.linalg.norm(matrix, axis=-1, keepdims=True)


def clustered(rng: np.random.Generator, per_cluster: int = 12, dim: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Unit embeddings around the first three axes (noise 0.05) and each row's cluster label."""
    labels = np.repeat(np.arange(3), per_cluster)
    embeddings = np.eye(dim)[labels] + 0.05 * rng.normal(size=(len(labels), dim))
    order = rng.permutation(len(labels))
    return unit_rows(embeddings[order]), labels[order]


def small_bank(rng: np.random.Generator, n: int = 6, k: int = 3, dim: int = 4, top_m: int = 2) -> TopicBank:
    theta = rng.dirichlet(np.ones(k), size=n)
    return TopicBank(chunk_ids=np.array([f"doc{i}#0" for i in range(n)]),
                     embeddings=unit_rows(rng.normal(size=(n, dim))), centroids=unit_rows(rng.normal(size=(k, dim))),
                     theta=theta, top_m=top_m)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_theta_rows_are_distributions_and_centroids_unit(k):
    rng = np.random.default_rng(k)
    embeddings = rng.normal(size=(30, 5))  # not unit: the model normalises them
    texts = [f"chunk {i}" for i in range(30)]
    model = KMeansTopics(k, seed=1).fit(texts, embeddings)
    theta = model.topic_distribution(texts, embeddings)
    assert theta.shape == (30, k)
    assert (theta >= 0).all()
    np.testing.assert_allclose(theta.sum(axis=1), 1, atol=1e-12)
    assert model.centroids().shape == (k, 5)
    np.testing.assert_allclose(np.linalg.norm(model.centroids(), axis=1), 1, atol=1e-12)


def test_theta_is_the_tempered_softmax_of_cosines():
    rng = np.random.default_rng(3)
    embeddings = unit_rows(rng.normal(size=(20, 4)))
    texts = [""] * 20
    model = KMeansTopics(4, temperature=0.2).fit(texts, embeddings)
    cosines = embeddings @ model.centroids().T
    expected = np.exp(cosines / 0.2) / np.exp(cosines / 0.2).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(model.topic_distribution(texts, embeddings), expected, rtol=1e-10)
    # A tiny temperature would overflow a naive exp; the shifted softmax stays a one-hot distribution.
    sharp = KMeansTopics(4, temperature=1e-6).fit(texts, embeddings).topic_distribution(texts, embeddings)
    assert np.isfinite(sharp).all()
    np.testing.assert_array_equal(sharp.argmax(axis=1), cosines.argmax(axis=1))


def test_kmeans_topics_are_deterministic_for_a_seed():
    rng = np.random.default_rng(0)
    embeddings = rng.normal(size=(50, 6))
    texts = [str(i) for i in range(50)]
    runs = [KMeansTopics(5, seed=7).fit(texts, embeddings) for _ in range(2)]
    np.testing.assert_array_equal(runs[0].centroids(), runs[1].centroids())
    np.testing.assert_array_equal(runs[0].topic_distribution(texts, embeddings),
                                  runs[1].topic_distribution(texts, embeddings))


def test_three_separated_clusters_become_the_three_topics():
    embeddings, labels = clustered(np.random.default_rng(1))
    texts = [""] * len(labels)
    model = KMeansTopics(3, seed=0).fit(texts, embeddings)
    assignment = model.topic_distribution(texts, embeddings).argmax(axis=1)
    # The same partition: each cluster maps to one topic and no two clusters share one.
    topic_of_cluster = {c: set(assignment[labels == c]) for c in range(3)}
    assert all(len(topics) == 1 for topics in topic_of_cluster.values())
    assert len(set.union(*topic_of_cluster.values())) == 3
    # Each topic centroid points along its cluster's axis.
    for cluster, (topic,) in topic_of_cluster.items():
        assert model.centroids()[topic, cluster] > 0.99


def test_encoder_path_matches_given_embeddings():
    vocabulary = ["apple", "river", "engine"]

    def encode(texts: list[str]) -> np.ndarray:
        return np.array([[text.count(word) + 0.1 for word in vocabulary] for text in texts])

    texts = ["apple apple pie", "green apple", "river bank", "river flows", "engine oil", "engine noise"]
    encoded = KMeansTopics(3, encode=encode).fit(texts)
    given = KMeansTopics(3).fit(texts, encode(texts))
    np.testing.assert_array_equal(encoded.centroids(), given.centroids())
    theta = encoded.topic_distribution(texts)
    np.testing.assert_array_equal(theta, given.topic_distribution(texts, encode(texts)))
    assert len(set(theta.argmax(axis=1)[::2])) == 3 and (theta.argmax(axis=1)[::2] == theta.argmax(axis=1)[1::2]).all()
    with pytest.raises(BankError, match="no encoder"):
        KMeansTopics(3).fit(texts)


def test_topic_model_refusals():
    with pytest.raises(BankError, match="before|not fitted"):
        KMeansTopics(2).centroids()
    with pytest.raises(BankError, match="one row per text"):
        KMeansTopics(2).fit(["a", "b", "c"], np.ones((2, 3)))
    with pytest.raises(BankError, match="row 1 is zero"):
        KMeansTopics(2).fit(["a", "b", "c"], np.array([[1.0, 0], [0, 0], [0, 1]]))
    model = KMeansTopics(2).fit(["a", "b", "c"], np.eye(3))
    with pytest.raises(BankError, match="dimension 2 but the topics were fitted in dimension 3"):
        model.topic_distribution(["a"], np.ones((1, 2)))


def test_topic_vectors_by_hand():
    theta = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    identity = torch.eye(3, dtype=torch.float64)
    expected = torch.tensor([[0.5, 0.3, 0.0], [0.1, 0.0, 0.8]], dtype=torch.float64)
    got = topic_vectors(theta, identity, top_m=2)
    # The second row ties at 0.1; either of the two tied topics may be kept.
    torch.testing.assert_close(got[0], expected[0])
    assert got[1, 2] == 0.8 and sorted(got[1, :2].tolist()) == [0.0, 0.1]


def test_top_one_is_the_argmax_centroid_and_top_all_is_the_mixture():
    rng = np.random.default_rng(4)
    theta = torch.from_numpy(rng.dirichlet(np.ones(6), size=10))
    centroids = torch.from_numpy(unit_rows(rng.normal(size=(6, 5))))
    best = theta.argmax(dim=1)
    torch.testing.assert_close(topic_vectors(theta, centroids, 1), theta.gather(1, best[:, None]) * centroids[best])
    for top_m in (6, 10):
        torch.testing.assert_close(topic_vectors(theta, centroids, top_m), theta @ centroids)
    torch.testing.assert_close(mixed_centroids(theta, centroids), theta @ centroids)
    with pytest.raises(BankError, match="top_m = 0"):
        topic_vectors(theta, centroids, 0)


def test_topic_vectors_pass_gradients_to_the_kept_topics_only():
    theta = torch.tensor([[0.6, 0.1, 0.3]], dtype=torch.float64, requires_grad=True)
    centroids = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=torch.float64)
    topic_vectors(theta, centroids, top_m=2).sum().backward()
    torch.testing.assert_close(theta.grad, torch.tensor([[1.0, 0.0, 1.4]], dtype=torch.float64))


def test_build_bank_assembles_e_theta_and_representations():
    embeddings, labels = clustered(np.random.default_rng(2))
    raw = embeddings * 3.0  # the bank stores unit embeddings whatever the scale given
    ids = [f"c{i}" for i in range(len(labels))]
    texts = [""] * len(labels)
    model = KMeansTopics(3)
    bank = build_bank(ids, texts, raw, model, top_m=1)
    np.testing.assert_allclose(bank.embeddings, embeddings, atol=1e-6)
    np.testing.assert_allclose(bank.theta, model.topic_distribution(texts, embeddings), atol=1e-6)
    assert bank.chunk_ids.tolist() == ids
    assert bank.m.shape == bank.g.shape == (len(ids), 8) and bank.r.shape == (len(ids), 16)
    np.testing.assert_allclose(bank.m, bank.theta @ bank.centroids, atol=1e-6)
    np.testing.assert_array_equal(bank.r[:, :8], bank.embeddings)
    np.testing.assert_array_equal(bank.r[:, 8:], bank.g)
    top = bank.theta.argmax(axis=1)
    np.testing.assert_allclose(bank.g, bank.theta.max(axis=1, keepdims=True) * bank.centroids[top], atol=1e-6)


def test_bank_refuses_more_topics_than_chunks_and_an_empty_corpus():
    embeddings = np.eye(3)
    with pytest.raises(BankError, match="K = 5 topics but the corpus has 3 chunks; lower K"):
        build_bank(["a", "b", "c"], ["x", "y", "z"], embeddings, KMeansTopics(5))
    with pytest.raises(BankError, match="the corpus has no chunks"):
        build_bank([], [], np.zeros((0, 3)), KMeansTopics(2))
    with pytest.raises(BankError, match="3 chunk ids, 2 texts"):
        build_bank(["a", "b", "c"], ["x", "y"], embeddings, KMeansTopics(2))


def test_bank_refuses_theta_off_the_simplex_and_non_unit_centroids():
    rng = np.random.default_rng(5)
    good = small_bank(rng)
    fields = {"chunk_ids": good.chunk_ids, "embeddings": good.embeddings, "centroids": good.centroids,
              "theta": good.theta, "top_m": good.top_m}
    theta = good.theta.copy()
    theta[2, 0] += 0.01
    with pytest.raises(BankError, match="theta row 2 .* sums to 1.01"):
        TopicBank(**{**fields, "theta": theta})
    with pytest.raises(BankError, match="centroids row 1 has norm 2"):
        TopicBank(**{**fields, "centroids": good.centroids * np.array([[1.0], [2.0], [1.0]])})
    with pytest.raises(BankError, match="repeat"):
        TopicBank(**{**fields, "chunk_ids": np.array(["a", "b", "c", "d", "e", "a"])})
    with pytest.raises(BankError, match=r"centroids \(3, 5\) must be \(K, 4\)"):
        TopicBank(**{**fields, "centroids": unit_rows(rng.normal(size=(3, 5)))})


def test_save_load_round_trip_and_content_hash(tmp_path):
    bank = small_bank(np.random.default_rng(6))
    digest = bank.save(tmp_path / "a")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["topic_bank.npz"]  # no temporary file left
    loaded = TopicBank.load(tmp_path / "a")
    for name in ("chunk_ids", "embeddings", "centroids", "theta"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(bank, name))
        assert getattr(loaded, name).dtype == getattr(bank, name).dtype
    assert loaded.top_m == bank.top_m
    assert digest == bank.content_hash() == loaded.content_hash()
    assert loaded.save(tmp_path / "elsewhere" / "b") == digest

    theta = bank.theta.copy()
    theta[0, :2] += [0.001, -0.001]  # one value moves, the row still sums to 1
    fields = {"chunk_ids": bank.chunk_ids, "embeddings": bank.embeddings, "centroids": bank.centroids,
              "top_m": bank.top_m}
    assert TopicBank(theta=theta, **fields).content_hash() != digest
    assert TopicBank(theta=bank.theta, **{**fields, "top_m": 3}).content_hash() != digest
    # Ids held in a wider string array are the same ids.
    wide = TopicBank(theta=bank.theta, **{**fields, "chunk_ids": bank.chunk_ids.astype("<U40")})
    assert wide.content_hash() == digest
    with pytest.raises(FileNotFoundError, match="no topic bank"):
        TopicBank.load(tmp_path / "missing")


def test_effective_topics_caps_small_corpora():
    assert effective_topics(100, 37) == 3
    assert effective_topics(100, 5) == 2
    assert effective_topics(100, 10_000) == 100
    assert effective_topics(100, 400, chunks_per_topic=2) == 100
    assert effective_topics(100, 37, cap=False) == 100
    with pytest.raises(BankError, match="K = 1 topics"):
        effective_topics(1, 500)


def test_class_tfidf_ranks_each_topics_distinctive_word_first():
    texts = ["data data data apple", "data data apple pie",
             "data data data river", "data river boat",
             "data data engine", "data engine engine data"]
    theta = np.repeat(np.eye(4)[:3], 2, axis=0)  # two texts per topic; topic 3 gets none
    summary = topic_summary(texts, theta, n_terms=3)
    assert [row["topic"] for row in summary] == [0, 1, 2, 3]
    assert [row["size"] for row in summary] == [2, 2, 2, 0]
    # "data" is the most frequent word of every topic but appears everywhere, so c-TF-IDF ranks it below the
    # topic's own word; "pie", seen once, still ranks after it.
    assert [row["terms"][0] for row in summary[:3]] == ["apple", "river", "engine"]
    assert summary[0]["terms"] == ["apple", "data", "pie"]
    assert summary[3]["terms"] == []


def test_topic_summary_survives_stop_word_only_texts():
    summary = topic_summary(["the and of", "it is"], np.array([[0.9, 0.1], [0.2, 0.8]]))
    assert summary == [{"topic": 0, "size": 1, "terms": []}, {"topic": 1, "size": 1, "terms": []}]
