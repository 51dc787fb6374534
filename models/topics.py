"""The topic metadata bank of MCompassRAG (METHODS.md §4 "Bank", "Topic model").

Every chunk c carries its unit embedding e_c, a topic distribution theta_c on the K-simplex and, through the
K unit topic centroids T (K x d, in the encoder's space), the mixed centroid m_c = theta_c · T, the top-M
topic vector g_c and the representation r_c = [e_c ; g_c]. The topic model is pluggable (`TopicModel`);
`KMeansTopics` is the chosen substitute for CEMTM. `topic_summary` names each topic by its c-TF-IDF terms so
that a reader can tell what the topics are.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from sklearn.cluster import KMeans
from sklearn.feature_extraction.text import CountVectorizer

from covlab.models.versions import arrays_digest

BANK_FILE = "topic_bank.npz"
ENCODER_FILE = "encoder.json"  # beside the bank: the BankEncoder that embedded its chunks
# KMeans restarts: more than scikit-learn's single k-means++ run, so that one unlucky seeding does not
# merge two topics, while K = 100 on a large corpus still fits in seconds.
KMEANS_RESTARTS = 4
# How far from 1 a theta row sum or a row norm may drift (float32 storage) before the bank refuses it.
TOLERANCE = 1e-4


class BankError(ValueError):
    """A topic model or bank was asked to work on malformed or inconsistent input; the message says what and
    how to fix it."""


class TopicModel(Protocol):
    """What the bank needs from a topic model. Embeddings are optional so that a caller holding unit embeddings
    does not re-encode; without them the model encodes the texts itself."""

    def fit(self, texts: Sequence[str], embeddings: np.ndarray | None = None) -> TopicModel:
        """Learn the topics of a corpus; returns the model itself."""

    def topic_distribution(self, texts: Sequence[str], embeddings: np.ndarray | None = None) -> np.ndarray:
        """(n, K) topic distributions, rows on the simplex."""

    def centroids(self) -> np.ndarray:
        """(K, d) topic centroids with L2-normalised rows, in the encoder's embedding space."""


class KMeansTopics:
    """Topics as KMeans clusters of L2-normalised chunk embeddings (METHODS.md §4 "Topic model"): t_k is the
    re-normalised cluster mean and theta_c = softmax(cos(e_c, t_k) / temperature). Deterministic for a seed."""

    def __init__(self, k: int, encode: Callable[[list[str]], np.ndarray] | None = None, temperature: float = 0.05,
                 seed: int = 0):
        if k < 1:
            raise BankError(f"K = {k} topics: a topic model needs at least one topic")
        if not temperature > 0:
            raise BankError(f"temperature = {temperature}: the softmax temperature must be positive")
        self.k = k
        self.encode = encode
        self.temperature = temperature
        self.seed = seed
        self._centroids: np.ndarray | None = None

    def fit(self, texts: Sequence[str], embeddings: np.ndarray | None = None) -> KMeansTopics:
        unit = self._unit_embeddings(texts, embeddings)
        if len(unit) == 0:
            raise BankError("the corpus has no chunks; a topic model needs at least one chunk per topic")
        if self.k > len(unit):
            raise BankError(f"K = {self.k} topics but the corpus has {len(unit)} chunks; lower K to at most "
                            f"{len(unit)} (effective_topics caps it for small corpora)")
        kmeans = KMeans(n_clusters=self.k, n_init=KMEANS_RESTARTS, random_state=self.seed).fit(unit)
        centres = kmeans.cluster_centers_
        norms = np.linalg.norm(centres, axis=1, keepdims=True)
        if not (norms > 0).all():
            raise BankError(f"topic {int(np.argmin(norms))} has a zero mean direction (its chunks cancel out); "
                            "use another seed or K")
        self._centroids = centres / norms
        return self

    def topic_distribution(self, texts: Sequence[str], embeddings: np.ndarray | None = None) -> np.ndarray:
        centroids = self.centroids()
        unit = self._unit_embeddings(texts, embeddings)
        if unit.shape[1] != centroids.shape[1]:
            raise BankError(f"embeddings have dimension {unit.shape[1]} but the topics were fitted in dimension "
                            f"{centroids.shape[1]}; use the same encoder")
        logits = unit @ centroids.T / self.temperature
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))  # shifted: exp never overflows
        return weights / weights.sum(axis=1, keepdims=True)

    def centroids(self) -> np.ndarray:
        if self._centroids is None:
            raise BankError("the topic model is not fitted; call fit on the corpus first")
        return self._centroids.copy()

    def _unit_embeddings(self, texts: Sequence[str], embeddings: np.ndarray | None) -> np.ndarray:
        """The given embeddings, or the encoder's, checked against the texts and scaled to unit rows."""
        if embeddings is None:
            if self.encode is None:
                raise BankError("KMeansTopics has no encoder: pass the chunk embeddings or build it with encode=")
            embeddings = self.encode(list(texts)) if len(texts) else np.zeros((0, 0))
        embeddings = np.asarray(embeddings, dtype=np.float64)
        if embeddings.ndim != 2 or len(embeddings) != len(texts):
            raise BankError(f"embeddings must be an (n_texts, dim) matrix with one row per text; got shape "
                            f"{embeddings.shape} for {len(texts)} texts")
        return unit_rows(embeddings)


def effective_topics(requested: int, n_chunks: int, cap: bool = True, chunks_per_topic: int = 10) -> int:
    """The K the bank uses. With `cap`, a small corpus gets min(requested, max(2, n_chunks // chunks_per_topic)):
    KMeans with about one chunk per topic returns degenerate one-point topics whose centroids are the chunks
    themselves, so theta carries no more than the embedding. Without `cap`, the requested K, which the topic
    model then refuses if it exceeds the number of chunks."""
    if requested < 2:
        raise BankError(f"K = {requested} topics: a topic distribution needs at least 2 topics")
    if chunks_per_topic < 1:
        raise BankError(f"chunks_per_topic = {chunks_per_topic} must be at least 1")
    if not cap:
        return requested
    return min(requested, max(2, n_chunks // chunks_per_topic))


def topic_vectors(theta: torch.Tensor, centroids: torch.Tensor, top_m: int) -> torch.Tensor:
    """g = sum over the top-M entries of each theta row of theta[k] * t_k (METHODS.md §4 "Bank"): every other
    weight is masked to zero and the kept ones are not renormalised. Shape (..., d); top_m >= K keeps every
    topic (g = theta @ T). Differentiable in theta (the student model calls it on batches)."""
    theta, centroids = torch.as_tensor(theta), torch.as_tensor(centroids)
    if top_m < 1:
        raise BankError(f"top_m = {top_m}: at least one topic must be kept")
    if theta.shape[-1] != centroids.shape[0]:
        raise BankError(f"theta has {theta.shape[-1]} topics but there are {centroids.shape[0]} centroids")
    if top_m >= theta.shape[-1]:
        return theta @ centroids
    kept, topics = theta.topk(top_m, dim=-1)
    return torch.zeros_like(theta).scatter(-1, topics, kept) @ centroids


def mixed_centroids(theta, centroids):
    """m = theta @ T, the topic-weighted centroid of each row (METHODS.md §4 "Bank"); numpy or torch."""
    return theta @ centroids


@dataclass(frozen=True, eq=False)
class TopicBank:
    """The bank of METHODS.md §4: for chunk i, chunk_ids[i], its unit embedding e_i (n x d), its topic
    distribution theta_i (n x K) over the unit centroids T (K x d), and M for the top-M topic vectors.

    The arrays are stored as read-only float32 (ids as str), so the derived m, g, r and the content hash stay
    true to them; the constructor refuses theta rows off the simplex and non-unit centroids or embeddings."""

    chunk_ids: np.ndarray
    embeddings: np.ndarray
    centroids: np.ndarray
    theta: np.ndarray
    top_m: int

    def __post_init__(self):
        # Rebuilding the id array gives it the minimal string width, so that equal ids hash equally.
        ids = np.array([str(c) for c in np.asarray(self.chunk_ids).ravel()], dtype=str)
        arrays = {"chunk_ids": ids.reshape(np.shape(self.chunk_ids))}
        for name in ("embeddings", "centroids", "theta"):
            arrays[name] = np.ascontiguousarray(getattr(self, name), dtype=np.float32)
        for name, array in arrays.items():
            array.setflags(write=False)
            object.__setattr__(self, name, array)
        object.__setattr__(self, "top_m", int(self.top_m))
        self._check()

    def _check(self) -> None:
        ids, e, t, theta = self.chunk_ids, self.embeddings, self.centroids, self.theta
        if ids.ndim != 1 or e.ndim != 2 or t.ndim != 2 or theta.ndim != 2:
            raise BankError(f"a bank needs 1-D chunk ids and 2-D embeddings, centroids and theta; got shapes "
                            f"{ids.shape}, {e.shape}, {t.shape}, {theta.shape}")
        n, d = e.shape
        if len(ids) != n or theta.shape[0] != n:
            raise BankError(f"{len(ids)} chunk ids, {n} embeddings and {theta.shape[0]} theta rows: "
                            "one of each per chunk")
        if t.shape[1] != d or theta.shape[1] != t.shape[0]:
            raise BankError(f"centroids {t.shape} must be (K, {d}) with K = {theta.shape[1]} theta columns")
        if len(set(ids.tolist())) != n:
            raise BankError("chunk ids repeat; each chunk appears once in the bank")
        if self.top_m < 1:
            raise BankError(f"top_m = {self.top_m}: at least one topic must be kept")
        for name, array in (("embeddings", e), ("centroids", t), ("theta", theta)):
            if not np.isfinite(array).all():
                raise BankError(f"{name} contain NaN or infinite values")
        sums = theta.sum(axis=1, dtype=np.float64)
        off = np.flatnonzero((np.abs(sums - 1) > TOLERANCE) | (theta < 0).any(axis=1))
        if len(off):
            raise BankError(f"theta row {off[0]} (chunk {ids[off[0]]!r}) sums to {sums[off[0]]:.6f} or has a "
                            f"negative weight; each row must be a distribution over the {t.shape[0]} topics")
        for name, array in (("centroids", t), ("embeddings", e)):
            norms = np.linalg.norm(array, axis=1)
            bad = np.flatnonzero(np.abs(norms - 1) > TOLERANCE)
            if len(bad):
                raise BankError(f"{name} row {bad[0]} has norm {norms[bad[0]]:.6f}; the bank needs unit rows")

    @cached_property
    def m(self) -> np.ndarray:
        """m_i = theta_i · T, (n, d)."""
        return mixed_centroids(self.theta, self.centroids)

    @cached_property
    def g(self) -> np.ndarray:
        """g_i, the top-M masked theta_i · T, (n, d)."""
        return topic_vectors(torch.tensor(self.theta), torch.tensor(self.centroids), self.top_m).numpy()

    @cached_property
    def r(self) -> np.ndarray:
        """r_i = [e_i ; g_i], (n, 2d)."""
        return np.concatenate([self.embeddings, self.g], axis=1)

    def content_hash(self) -> str:
        """sha256 over each array's name, dtype, shape and bytes in a fixed order, then top_m: equal banks
        hash equally wherever they are stored."""
        digest = arrays_digest({name: getattr(self, name)
                                for name in ("chunk_ids", "embeddings", "centroids", "theta")})
        digest.update(f"top_m|{self.top_m}".encode())
        return digest.hexdigest()

    def save(self, directory: str | os.PathLike) -> str:
        """Write the bank as `directory`/topic_bank.npz, via a temporary file in the same directory renamed into
        place so that a reader never sees a partial bank; returns the content hash."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=f".{BANK_FILE}.", suffix=".tmp")
        try:
            with os.fdopen(descriptor, "wb") as handle:
                np.savez(handle, chunk_ids=self.chunk_ids, embeddings=self.embeddings, centroids=self.centroids,
                         theta=self.theta, top_m=np.int64(self.top_m))
            os.replace(temporary, folder / BANK_FILE)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return self.content_hash()

    @classmethod
    def load(cls, directory: str | os.PathLike) -> TopicBank:
        """The bank saved in `directory`, checked like a freshly built one."""
        file = Path(directory) / BANK_FILE
        if not file.is_file():
            raise FileNotFoundError(f"no topic bank at {file}; build it first")
        with np.load(file, allow_pickle=False) as arrays:
            return cls(chunk_ids=arrays["chunk_ids"], embeddings=arrays["embeddings"], centroids=arrays["centroids"],
                       theta=arrays["theta"], top_m=int(arrays["top_m"]))


@dataclass(frozen=True)
class BankEncoder:
    """The encoder that embedded a bank's chunks, which must also embed a query scored against them: a Hugging
    Face path or name ("": the packaged MiniLM, models/encoders.default_base_model) and the tokens it read of
    each text. Kept beside the bank (`save`) because neither the bank's arrays nor its hash name it."""
    model: str
    max_length: int

    def path(self) -> str:
        """What models/biencoder.load_first_stage loads."""
        from covlab.models.encoders import default_base_model

        return self.model or default_base_model()

    def save(self, directory: str | os.PathLike) -> None:
        Path(directory, ENCODER_FILE).write_text(json.dumps({"model": self.model, "max_length": self.max_length},
                                                            sort_keys=True))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> BankEncoder | None:
        """The encoder saved beside a bank; None for a bank folder written before banks recorded it."""
        file = Path(directory) / ENCODER_FILE
        if not file.is_file():
            return None
        saved = json.loads(file.read_text())
        return cls(str(saved["model"]), int(saved["max_length"]))


def build_bank(chunk_ids: Sequence[str], texts: Sequence[str], embeddings: np.ndarray, model: TopicModel,
               top_m: int = 10) -> TopicBank:
    """Fit `model` on the chunks and assemble their bank; the embeddings are scaled to unit rows first."""
    if len(chunk_ids) == 0:
        raise BankError("the corpus has no chunks; a topic bank needs at least one chunk per topic")
    embeddings = np.asarray(embeddings, dtype=np.float64)
    if not len(chunk_ids) == len(texts) == len(embeddings):
        raise BankError(f"{len(chunk_ids)} chunk ids, {len(texts)} texts and {len(embeddings)} embeddings: "
                        "one of each per chunk")
    unit = unit_rows(embeddings)
    model.fit(texts, unit)
    return TopicBank(chunk_ids=np.asarray(chunk_ids), embeddings=unit, centroids=model.centroids(),
                     theta=model.topic_distribution(texts, unit), top_m=top_m)


def topic_summary(texts: Sequence[str], theta: np.ndarray, n_terms: int = 8) -> list[dict]:
    """Per topic k (chunks assigned by argmax theta): {"topic": k, "size": chunks, "terms": top terms}, the
    terms ranked by class-based TF-IDF as in BERTopic: the texts of a topic are one document, tf_{t,c} counts
    term t in class c (CountVectorizer, English stop words removed) and the weight is
    tf_{t,c} * log(1 + A / f_t), A the average number of words per class, f_t the count of t over all classes.
    Ties go alphabetically. A topic without chunks has size 0 and no terms."""
    theta = np.asarray(theta)
    if theta.ndim != 2 or theta.shape[1] == 0 or len(theta) != len(texts):
        raise BankError(f"theta must be (n_texts, K) with K >= 1; got shape {theta.shape} for {len(texts)} texts")
    if n_terms < 1:
        raise BankError(f"n_terms = {n_terms}: ask for at least one term per topic")
    assignment = theta.argmax(axis=1)
    sizes = np.bincount(assignment, minlength=theta.shape[1])
    terms: dict[int, list[str]] = {}
    present = np.flatnonzero(sizes)
    if len(present):
        classes = [" ".join(texts[i] for i in np.flatnonzero(assignment == k)) for k in present]
        terms = dict(zip(present.tolist(), class_tfidf_terms(classes, n_terms)))
    return [{"topic": k, "size": int(sizes[k]), "terms": terms.get(k, [])} for k in range(theta.shape[1])]


def class_tfidf_terms(classes: list[str], n_terms: int) -> list[list[str]]:
    """The top `n_terms` c-TF-IDF terms of each class document (see `topic_summary`); none for any class when
    the texts hold no words beyond stop words."""
    vectorizer = CountVectorizer(stop_words="english")
    try:
        counts = vectorizer.fit_transform(classes).toarray().astype(np.float64)
    except ValueError:  # CountVectorizer refuses an empty vocabulary
        return [[] for _ in classes]
    vocabulary = vectorizer.get_feature_names_out()
    average_words = counts.sum(axis=1).mean()
    weights = counts * np.log1p(average_words / counts.sum(axis=0))
    ranked = []
    for row, weight in zip(counts, weights):
        used = np.flatnonzero(row)
        order = used[np.lexsort((vocabulary[used], -weight[used]))]  # weight descending, then alphabetically
        ranked.append([str(term) for term in vocabulary[order[:n_terms]]])
    return ranked


def unit_rows(matrix: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm; a zero or non-finite row is refused (it has no direction)."""
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    bad = np.flatnonzero(~(np.isfinite(norms[:, 0]) & (norms[:, 0] > 0)))
    if len(bad):
        raise BankError(f"embedding row {bad[0]} is zero or not finite; every chunk needs a direction")
    return matrix / norms
