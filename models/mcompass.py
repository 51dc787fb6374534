"""MCompassRAG's distilled student retriever (METHODS.md §4): a query-dependent selector over the topic
metadata bank, an abstraction of the selected topic distributions into the query's topic vector, and an MLP
scorer on [r_q ; r_c], trained on (query, chunk) pairs with (1 - a) BCE + a tau^2 KL against a teacher logit.

Shapes: d the encoder's dimension, K topics, N bank entries (the corpus' chunks), L the selector's top-L.
- Selector [query-dependent, as METHODS.md asks]: s_i = m_i . (W e_q) + v . m_i + b over every bank entry i,
  a bilinear head, so two queries rank the bank differently (the official single affine head does not);
  the top-L entries are kept and softmax-weighted.
- Abstraction: `transformer` encodes the L selected distributions (no positional encoding: the selection is a
  set) and pools them with the selector's weights; its output corrects the weighted mean of the selected
  distributions in log space and starts at zero, so training begins from `mean`, the other setting. Without
  the selector (an ablation) theta_q is the topic model's own distribution of e_q, softmax(cos(e_q, T) / 0.05).
- Scorer: Linear(2d + 2d + 2 -> 1024) -> GELU -> dropout -> 1024 -> 256 -> GELU -> dropout -> 1 on
  [r_q ; r_c ; e_q . e_c ; g_q . g_c]. The two dot products are a [chosen extension] of the paper's [r_q ; r_c]:
  an MLP on a concatenation has to learn a similarity from a few thousand pairs (on the synthetic topic task
  of tests/test_mcompass.py it ranked unseen queries' evidence at precision@10 0.5 where cosine reaches 0.9);
  given the similarities, and e_q . e_c also straight to the logit (SKIP_INIT), an untrained student ranks close
  to dense cosine (the MLP's initial output is small beside 10 x cosine) and training moves it from there.
  The similarities are functions of [r_q ; r_c], so zeroing the topic part still leaves a dense scorer over
  [e_q ; e_c]. The first layer is held as a query part, a chunk part and the two
  similarity columns (the same linear map on the concatenation), so ranking the whole corpus computes the
  chunk part once per model and per query only N dot products, not an N x 4d product.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from covlab.models import prompts
from covlab.models.encoders import seeded
from covlab.models.protocol import EvaluationProtocol, Fold
from covlab.models.topics import BankEncoder, TopicBank, topic_vectors

WEIGHTS_FILE = "student.safetensors"
SETTINGS_FILE = "student.json"
KIND = "mcompass-student"
TEACHER_LOGIT_CLIP = 10.0  # |logit| of a teacher probability: p = 1 would otherwise be infinite
SKIP_INIT = 10.0  # initial weight of e_q . e_c straight to the logit: an untrained student ranks near dense cosine
# score_corpus's block of first-layer activations on CPU (2 MiB of float32: 512 chunks of one query at the
# paper's width 1,024): within a core's L2 cache, where the GELU and the second layer's product read it back
# (bench/mcompass_latency.py)
SCORE_BLOCK_FLOATS = 512 * 1024


@dataclass(frozen=True)
class StudentSettings:
    """The student's architecture; defaults from METHODS.md §4 (L = 50, M = 10, scorer 1024 -> 256)."""
    selector: bool = True
    abstraction: Literal["transformer", "mean"] = "transformer"
    top_l: int = 50
    top_m: int = 10
    temperature: float = 0.05
    abstraction_dim: int = 128
    abstraction_heads: int = 4
    abstraction_layers: int = 1
    hidden: tuple[int, int] = (1024, 256)
    dropout: float = 0.1


@dataclass(frozen=True)
class TrainingSettings:
    """AdamW on the distillation loss; `alpha` and `tau` as METHODS.md §4 (0.5, 1.0)."""
    epochs: int = 8
    batch_size: int = 256
    learning_rate: float = 5e-4
    weight_decay: float = 0.01
    alpha: float = 0.5
    tau: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class BankTensors:
    """The bank's arrays as tensors on one device: e_c, T, theta_c, and the bank's own m_c and g_c (its top_m)."""
    embeddings: torch.Tensor
    centroids: torch.Tensor
    theta: torch.Tensor
    mixed: torch.Tensor
    topics: torch.Tensor

    @classmethod
    def of(cls, bank: TopicBank, device: torch.device) -> BankTensors:
        tensor = lambda a: torch.tensor(np.asarray(a, dtype=np.float32), device=device)  # noqa: E731
        return cls(embeddings=tensor(bank.embeddings), centroids=tensor(bank.centroids), theta=tensor(bank.theta),
                   mixed=tensor(bank.m), topics=tensor(bank.g))


class MCompassStudent(nn.Module):
    """The student (module docstring). `dimension` is d, `topics` is K."""

    def __init__(self, dimension: int, topics: int, settings: StudentSettings = StudentSettings()):
        super().__init__()
        self.settings, self.dimension, self.n_topics = settings, dimension, topics
        self.select_bilinear = nn.Linear(dimension, dimension, bias=False)
        self.select_linear = nn.Linear(dimension, 1)
        if settings.abstraction == "transformer":
            width = settings.abstraction_dim
            self.abstract_in = nn.Linear(topics, width)
            layer = nn.TransformerEncoderLayer(width, settings.abstraction_heads, 2 * width, settings.dropout,
                                               activation="gelu", batch_first=True)
            self.abstract = nn.TransformerEncoder(layer, settings.abstraction_layers, enable_nested_tensor=False)
            self.abstract_out = nn.Linear(width, topics)
            nn.init.zeros_(self.abstract_out.weight)
            nn.init.zeros_(self.abstract_out.bias)
        first, second = settings.hidden
        self.query_layer = nn.Linear(2 * dimension, first)
        self.chunk_layer = nn.Linear(2 * dimension, first, bias=False)
        self.similarity_layer = nn.Linear(2, first, bias=False)
        self.similarity_skip = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.similarity_skip.weight.copy_(torch.tensor([[SKIP_INIT, 0.0]]))
        self.head = nn.Sequential(nn.GELU(), nn.Dropout(settings.dropout), nn.Linear(first, second), nn.GELU(),
                                  nn.Dropout(settings.dropout), nn.Linear(second, 1))

    def query_theta(self, query_vectors: torch.Tensor, bank: BankTensors) -> torch.Tensor:
        """theta_q (B x K) of unit query embeddings (B x d)."""
        s = self.settings
        if not s.selector:
            return torch.softmax(query_vectors @ bank.centroids.T / s.temperature, dim=-1)
        scores = self.select_bilinear(query_vectors) @ bank.mixed.T + self.select_linear(bank.mixed).T
        top, index = scores.topk(min(s.top_l, scores.shape[1]), dim=1)
        weights = torch.softmax(top, dim=1).unsqueeze(-1)
        selected = bank.theta[index]
        mean = (weights * selected).sum(dim=1)
        if s.abstraction == "mean":
            return mean
        pooled = (weights * self.abstract(self.abstract_in(selected))).sum(dim=1)
        return torch.softmax(torch.log(mean.clamp_min(1e-12)) + self.abstract_out(pooled), dim=-1)

    def query_representation(self, query_vectors: torch.Tensor, bank: BankTensors) -> torch.Tensor:
        """r_q = [e_q ; g_q] (B x 2d)."""
        g = topic_vectors(self.query_theta(query_vectors, bank), bank.centroids, self.settings.top_m)
        return torch.cat([query_vectors, g], dim=-1)

    def chunk_representation(self, bank: BankTensors, chunks: torch.Tensor | None = None) -> torch.Tensor:
        """r_c = [e_c ; g_c] of `chunks` (indices) or of every bank chunk."""
        e, g = (bank.embeddings, bank.topics) if chunks is None else (bank.embeddings[chunks], bank.topics[chunks])
        return torch.cat([e, g], dim=-1)

    def _similarities(self, r_q: torch.Tensor, e_c: torch.Tensor, g_c: torch.Tensor,
                      every: bool = False) -> torch.Tensor:
        """(e_q . e_c, g_q . g_c) of aligned pairs (r_q: P x 2d, e_c and g_c: P x d -> P x 2), or with `every` of
        every query against every chunk (r_q: B x 2d, e_c and g_c: N x d -> B x N x 2). The chunk's two halves
        come apart, so ranking the corpus never concatenates its N x 2d r_c."""
        d = self.dimension
        if every:
            return torch.stack([r_q[:, :d] @ e_c.T, r_q[:, d:] @ g_c.T], dim=-1)
        return torch.stack([(r_q[:, :d] * e_c).sum(-1), (r_q[:, d:] * g_c).sum(-1)], dim=-1)

    def forward(self, query_vectors: torch.Tensor, pair_query: torch.Tensor, pair_chunk: torch.Tensor,
                bank: BankTensors) -> torch.Tensor:
        """Logits of pairs (query_vectors[pair_query[j]], bank chunk pair_chunk[j])."""
        r_q = self.query_representation(query_vectors, bank)[pair_query]
        r_c = self.chunk_representation(bank, pair_chunk)
        similarities = self._similarities(r_q, r_c[:, :self.dimension], r_c[:, self.dimension:])
        hidden = self.query_layer(r_q) + self.chunk_layer(r_c) + self.similarity_layer(similarities)
        return (self.head(hidden) + self.similarity_skip(similarities)).squeeze(-1)

    @torch.no_grad()
    def score_corpus(self, query_vectors: torch.Tensor, bank: BankTensors, chunk_hidden: torch.Tensor | None = None,
                     block_floats: int | None = None) -> torch.Tensor:
        """Logits of every bank chunk for each query (B x N); `chunk_hidden` (the chunk part of the first
        layer, `self.chunk_layer(self.chunk_representation(bank))`) can be reused across calls.

        The head runs over blocks of chunks, each block's first-layer activations at most `block_floats` floats
        (B x rows x the first hidden width; default SCORE_BLOCK_FLOATS on CPU, 64 times that on an
        accelerator): the peak memory is a block's, whatever the corpus size, and on CPU a block's activations
        stay in cache between the first layer, the GELU and the second layer's product instead of streaming
        B x N x width floats through memory three times. A chunk's logit goes through the same operations in the
        same order as over the whole corpus at once; only BLAS's rounding of a block's smaller products can differ
        in the last bits (bit for bit equal at ArgKP's size; tests/test_mcompass.py: within 1e-6 and the same
        ranking for any block size)."""
        if chunk_hidden is None:
            chunk_hidden = self.chunk_layer(self.chunk_representation(bank))
        r_q = self.query_representation(query_vectors, bank)
        query_hidden = self.query_layer(r_q).unsqueeze(1)
        similarities = self._similarities(r_q, bank.embeddings, bank.topics, every=True)
        if block_floats is None:
            block_floats = SCORE_BLOCK_FLOATS * (1 if similarities.device.type == "cpu" else 64)
        rows = max(1, block_floats // (len(r_q) * chunk_hidden.shape[1]))
        logits = []
        for start in range(0, len(chunk_hidden), rows):
            block = similarities[:, start:start + rows]
            hidden = self.similarity_layer(block)  # then the chunk and query parts added in place
            hidden.add_(chunk_hidden[start:start + rows].unsqueeze(0)).add_(query_hidden)
            logits.append((self.head(hidden) + self.similarity_skip(block)).squeeze(-1))
        return torch.cat(logits, dim=1) if logits else similarities.new_zeros(len(r_q), 0)


def distillation_loss(logits: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor, alpha: float,
                      tau: float) -> torch.Tensor:
    """(1 - a) BCE(sigmoid(z), y) + a tau^2 KL(Bern(sigmoid(z_t / tau)) || Bern(sigmoid(z / tau))), the KL
    averaged over the pairs that have a teacher logit (NaN: none); without any, the BCE term alone."""
    loss = (1 - alpha) * F.binary_cross_entropy_with_logits(logits, labels)
    taught = ~torch.isnan(teacher)
    if alpha == 0 or not bool(taught.any()):
        return loss
    z, z_t = logits[taught] / tau, teacher[taught] / tau
    p = torch.sigmoid(z_t)
    kl = p * (F.logsigmoid(z_t) - F.logsigmoid(z)) + (1 - p) * (F.logsigmoid(-z_t) - F.logsigmoid(-z))
    return loss + alpha * tau ** 2 * kl.mean()


def probability_logit(p: np.ndarray) -> np.ndarray:
    """A teacher probability as a logit, clipped to +-TEACHER_LOGIT_CLIP."""
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-12, 1 - 1e-12)
    return np.clip(np.log(p / (1 - p)), -TEACHER_LOGIT_CLIP, TEACHER_LOGIT_CLIP)


def rating_logit(ratings: np.ndarray) -> np.ndarray:
    """An LLM's 0-5 rating as a logit: the probability (r + 0.5) / 6 (0 -> 0.08, 5 -> 0.92), never certain,
    because one judgment of a chunk is not."""
    return probability_logit((np.asarray(ratings, dtype=np.float64) + 0.5) / 6)


def expanded_query(text: str, subquestions: Sequence[str]) -> str:
    """The query a teacher judges (METHODS.md §4 "expanded query"): the question and its subquestions."""
    return "\n".join([text, *(f"- {s}" for s in subquestions)])


TAUGHT_KINDS = ("positive", "hard")  # random negatives are unrelated chunks: their label needs no teacher


def estimator_teacher(pairs: pd.DataFrame, query_text: dict[str, str], subquestions: dict[str, list[str]],
                      chunk_text: dict[str, str], score: Callable[[list[tuple[str, str]]], np.ndarray]) -> np.ndarray:
    """Teacher logits of (query_id, chunk_id) pairs from the coverage estimator (`score`: (subquestion, text)
    pairs -> coverage probabilities): the chunk's highest coverage probability over the query's subquestions
    (the query itself when it has none), as a logit. One estimator call for all pairs."""
    if pairs.empty:
        return np.zeros(0)
    asked = [(q, c, s) for q, c in pairs[["query_id", "chunk_id"]].itertuples(index=False)
             for s in (subquestions.get(q) or [query_text[q]])]
    probabilities = np.asarray(score([(s, chunk_text[c]) for _, c, s in asked]), dtype=np.float64)
    best = pd.Series(probabilities).groupby(pd.MultiIndex.from_tuples([(q, c) for q, c, _ in asked])).max()
    keys = pd.MultiIndex.from_frame(pairs[["query_id", "chunk_id"]])
    return probability_logit(best.reindex(keys).to_numpy())


def llm_teacher(pairs: pd.DataFrame, query_text: dict[str, str], subquestions: dict[str, list[str]],
                chunk_text: dict[str, str], rate: Callable[[list[list[dict]]], Sequence[int]]) -> np.ndarray:
    """Teacher logits of (query_id, chunk_id) pairs from an LLM: `rate` answers the CRUX judge prompt
    (models/prompts.judge) of each pair's expanded query against its chunk with a 0-5 rating (the LLM
    resource's chat_json_many with parse_rating: cached and retried), mapped by rating_logit."""
    messages = [prompts.judge(expanded_query(query_text[q], subquestions.get(q, [])), chunk_text[c])
                for q, c in pairs[["query_id", "chunk_id"]].itertuples(index=False)]
    return rating_logit(np.asarray(rate(messages), dtype=np.float64)) if messages else np.zeros(0)


def teacher_logits(pairs: pd.DataFrame, query_text: dict[str, str], subquestions: dict[str, list[str]],
                   chunk_text: dict[str, str], score: Callable | None = None, rate: Callable | None = None
                   ) -> np.ndarray:
    """The teacher_logit column of `pairs`: from the estimator (`score`, see estimator_teacher) or the LLM
    (`rate`, see llm_teacher) for the TAUGHT_KINDS, NaN for random negatives and without a teacher (gold)."""
    logits = np.full(len(pairs), np.nan)
    taught = pairs["kind"].isin(TAUGHT_KINDS).to_numpy()
    if score is not None:
        logits[taught] = estimator_teacher(pairs[taught], query_text, subquestions, chunk_text, score)
    elif rate is not None:
        logits[taught] = llm_teacher(pairs[taught], query_text, subquestions, chunk_text, rate)
    return logits


def teacher_agreement(pairs: pd.DataFrame) -> dict[str, float]:
    """Mean teacher probability of the evidence pairs ("positive") and of the negatives ("negative"): how far
    the teacher agrees with the gold labels; empty without teacher logits."""
    taught = pairs[pairs["teacher_logit"].notna()]
    probability = 1 / (1 + np.exp(-taught["teacher_logit"].to_numpy(np.float64)))
    return {name: float(probability[(taught["label"] == label).to_numpy()].mean())
            for name, label in (("positive", 1.0), ("negative", 0.0)) if (taught["label"] == label).any()}


@dataclass(frozen=True)
class PairSettings:
    """How training pairs are drawn per query: up to `positives` evidence chunks, and per positive
    `random_negatives` chunks drawn from the corpus and `hard_negatives` from the BM25 ranking, never evidence."""
    positives: int = 32
    random_negatives: int = 2
    hard_negatives: int = 2
    seed: int = 0


def sample_pairs(query_ids: list[str], evidence: dict[str, set[str]], bm25_ranking: dict[str, list[str]],
                 chunk_ids: list[str], settings: PairSettings) -> pd.DataFrame:
    """(query_id, chunk_id, label, kind) training pairs of the queries that have evidence, label 1 for
    evidence (kind `positive`). Hard negatives (`hard`) are the highest-ranked BM25 chunks that are not
    evidence, taken in rank order; random ones (`random`) are drawn uniformly among the remaining chunks.
    Deterministic for a seed and independent of the order of `chunk_ids` (chunks are drawn from the sorted ids)."""
    rng = np.random.default_rng(settings.seed)
    pool = np.array(sorted(chunk_ids), dtype=object)
    rows = []
    for query_id in sorted(query_ids):
        positives = sorted(evidence.get(query_id, ()))
        if not positives:
            continue
        if len(positives) > settings.positives:
            positives = sorted(rng.choice(positives, settings.positives, replace=False).tolist())
        taken = set(evidence[query_id])
        hard = [c for c in bm25_ranking.get(query_id, []) if c not in taken][:settings.hard_negatives * len(positives)]
        taken |= set(hard)
        free = pool[~np.isin(pool, list(taken))]
        count = min(settings.random_negatives * len(positives), len(free))
        drawn = rng.choice(free, count, replace=False).tolist() if count else []
        rows += ([(query_id, c, 1.0, "positive") for c in positives] + [(query_id, c, 0.0, "hard") for c in hard]
                 + [(query_id, c, 0.0, "random") for c in drawn])
    return pd.DataFrame(rows, columns=["query_id", "chunk_id", "label", "kind"])


@dataclass
class TrainedStudent:
    """A trained student and what its training measured: mean training loss per epoch (`epoch_losses[e - 1]`
    for epoch e), and, where measured, the mean loss on the held-out pairs and the held-out selection score
    by epoch, entry 0 the untrained student's (`dev_losses[e]`, `dev_scores[e]`); and the epoch whose weights
    were kept: 0 for the initialisation itself, when no epoch did better on the held-out queries."""
    model: MCompassStudent
    epoch_losses: list[float] = field(default_factory=list)
    dev_losses: list[float] = field(default_factory=list)
    dev_scores: list[float] = field(default_factory=list)
    kept_epoch: int = 0


@dataclass(frozen=True)
class _PairTensors:
    """Pairs as index and label tensors: the query of each pair indexes `queries`, its chunk the bank."""
    queries: torch.Tensor
    query_index: np.ndarray
    chunk_index: np.ndarray
    labels: torch.Tensor
    teacher: torch.Tensor

    @classmethod
    def of(cls, pairs: pd.DataFrame, bank: TopicBank, query_vectors: dict[str, np.ndarray], device: torch.device):
        position = {c: i for i, c in enumerate(bank.chunk_ids)}
        unknown = sorted(set(pairs["chunk_id"]) - set(position))
        if unknown:
            raise ValueError(f"training pairs name chunks outside the bank, e.g. {unknown[:3]}")
        queries = sorted(set(pairs["query_id"]))
        missing = [q for q in queries if q not in query_vectors]
        if missing:
            raise ValueError(f"no query embedding for training queries {missing[:3]}")
        teacher = pairs["teacher_logit"] if "teacher_logit" in pairs else pd.Series(np.nan, index=pairs.index)
        return cls(torch.as_tensor(np.stack([query_vectors[q] for q in queries]).astype(np.float32), device=device),
                   pairs["query_id"].map({q: i for i, q in enumerate(queries)}).to_numpy(),
                   pairs["chunk_id"].map(position).to_numpy(),
                   torch.as_tensor(pairs["label"].to_numpy(np.float32), device=device),
                   torch.as_tensor(teacher.to_numpy(np.float32), device=device))

    def loss(self, model: MCompassStudent, bank: BankTensors, batch: np.ndarray, training: TrainingSettings):
        device = self.labels.device
        used, local = np.unique(self.query_index[batch], return_inverse=True)
        logits = model(self.queries[torch.as_tensor(used, device=device)], torch.as_tensor(local, device=device),
                       torch.as_tensor(self.chunk_index[batch], device=device), bank)
        rows = torch.as_tensor(batch, device=device)
        return distillation_loss(logits, self.labels[rows], self.teacher[rows], training.alpha, training.tau)


def train_student(bank: TopicBank, query_vectors: dict[str, np.ndarray], pairs: pd.DataFrame,
                  settings: StudentSettings = StudentSettings(), training: TrainingSettings = TrainingSettings(),
                  device: torch.device = torch.device("cpu"), progress: Callable[[str], None] | None = None,
                  dev_pairs: pd.DataFrame | None = None,
                  select: Callable[[MCompassStudent], float] | None = None,
                  on_epoch: Callable[[int, dict], None] | None = None) -> TrainedStudent:
    """Train a student on `pairs` (query_id, chunk_id, label, teacher_logit: NaN where no teacher) and keep
    the weights of one epoch, the untrained student (epoch 0) among the candidates: the highest `select`
    score (held-out queries' retrieval, `heldout_ie`) when given, else the lowest loss on `dev_pairs` (other
    queries' pairs) when given, else the last. A student so never ends below its own initialisation on the
    held-out queries it is chosen by (the initialisation ranks near dense cosine). Selection
    matters: a few dozen training queries are memorised within a few epochs, and the held-out pair loss can
    keep falling after whole-corpus retrieval has got worse (the README measures both rules). The same seed
    and inputs give identical weights on CPU (`seeded`). `on_epoch(epoch, figures)`
    gets each epoch's (1-based) train_loss, and dev_loss and dev_score where measured, as soon as it ends."""
    if pairs.empty:
        raise ValueError("no training pairs: none of the training queries has evidence chunks")
    tensors = BankTensors.of(bank, device)
    train = _PairTensors.of(pairs, bank, query_vectors, device)
    dev = _PairTensors.of(dev_pairs, bank, query_vectors, device) if dev_pairs is not None and len(dev_pairs) else None
    with seeded(training.seed, device) as generator:
        model = MCompassStudent(bank.embeddings.shape[1], bank.centroids.shape[0], settings).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate,
                                      weight_decay=training.weight_decay)
        trained, best = TrainedStudent(model), None

        def measure(epoch: int, message: str) -> str:
            """The held-out figures of the weights after `epoch` (0: untrained); keeps them if they are the best."""
            nonlocal best
            model.eval()
            if dev is not None:
                with torch.no_grad():
                    trained.dev_losses.append(dev.loss(model, tensors, np.arange(len(dev.labels)), training).item())
                message += f", held-out loss {trained.dev_losses[-1]:.4f}"
            if select is not None:
                trained.dev_scores.append(select(model))
                message += f", held-out score {trained.dev_scores[-1]:.4f}"
            improved = (trained.dev_scores[-1] > max(trained.dev_scores[:-1], default=-np.inf) if select is not None
                        else dev is not None and trained.dev_losses[-1] < min(trained.dev_losses[:-1], default=np.inf))
            if improved:
                best = {k: v.detach().clone() for k, v in model.state_dict().items()}
                trained.kept_epoch = epoch
            return message

        if dev is not None or select is not None:  # the initialisation is a candidate: training must beat it
            message = measure(0, "student before training")
            if progress:
                progress(message)
        for epoch in range(1, training.epochs + 1):
            model.train()
            order = torch.randperm(len(pairs), generator=generator).numpy()
            total = 0.0
            for start in range(0, len(order), training.batch_size):
                batch = order[start:start + training.batch_size]
                loss = train.loss(model, tensors, batch, training)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += loss.item() * len(batch)
            trained.epoch_losses.append(total / len(order))
            message = measure(epoch, f"student epoch {epoch}/{training.epochs}: loss {trained.epoch_losses[-1]:.4f}")
            if progress:
                progress(message)
            if on_epoch is not None:
                on_epoch(epoch, {"train_loss": trained.epoch_losses[-1],
                                 **({"dev_loss": trained.dev_losses[-1]} if dev is not None else {}),
                                 **({"dev_score": trained.dev_scores[-1]} if select is not None else {})})
    if best is not None:
        model.load_state_dict(best)
    else:
        trained.kept_epoch = training.epochs
    model.eval()
    return trained


@dataclass(frozen=True, eq=False)
class BankRanker:
    """A student ready to rank one bank's chunks for any number of queries: the bank as tensors on `device` and
    the chunk part of the first layer (N x width floats), computed once, so a query costs only the query part,
    the similarities and the head (`retrieve` makes one per call; a served retriever keeps one per student)."""
    model: MCompassStudent
    tensors: BankTensors
    chunk_hidden: torch.Tensor

    @classmethod
    def of(cls, model: MCompassStudent, bank: TopicBank, device: torch.device = torch.device("cpu")) -> BankRanker:
        model.eval()
        tensors = BankTensors.of(bank, device)
        with torch.no_grad():
            return cls(model, tensors, model.chunk_layer(model.chunk_representation(tensors)))

    def top_k(self, query_vectors: np.ndarray, k: int, query_batch: int = 4) -> tuple[np.ndarray, np.ndarray]:
        """Top-k bank chunks (indices, logits; Q x k, ties by lower index) of every query over the whole bank,
        `query_batch` queries at a time. Peak memory beyond the ranker's own is one of score_corpus's blocks,
        whatever the number of queries."""
        from covlab.models.retrieval import top_k

        found = []
        with torch.no_grad():
            for start in range(0, len(query_vectors), query_batch):
                batch = torch.as_tensor(np.asarray(query_vectors[start:start + query_batch], dtype=np.float32),
                                        device=self.chunk_hidden.device)
                found.append(top_k(self.model.score_corpus(batch, self.tensors, self.chunk_hidden).cpu().numpy(), k))
        if not found:
            return np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=np.float32)
        return np.concatenate([i for i, _ in found]), np.concatenate([s for _, s in found])


def retrieve(model: MCompassStudent, bank: TopicBank, query_vectors: np.ndarray, k: int,
             device: torch.device = torch.device("cpu"), query_batch: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Top-k bank chunks (indices, logits; Q x k, ties by lower index) of every query over the whole bank
    (BankRanker.top_k). Peak memory is the chunk part of the first layer (N x width floats, once) and one of
    score_corpus's blocks, whatever the number of queries."""
    return BankRanker.of(model, bank, device).top_k(query_vectors, k, query_batch)


def heldout_ie(bank: TopicBank, query_vectors: dict[str, np.ndarray], query_ids: Sequence[str],
               evidence: pd.DataFrame, chunk_tokens: pd.Series, device: torch.device = torch.device("cpu")
               ) -> Callable[[MCompassStudent], float] | None:
    """A model's mean IE (models/retrieval.evidence_metrics, its default cutoffs and token budget) over the
    `query_ids` that have evidence, from its top-5 over the whole bank: what the retrieval report measures, as
    a model-selection score on held-out queries. None when no such query has evidence."""
    from covlab.models.retrieval import DEFAULT_KS, evidence_metrics, run_table

    ids = sorted(set(query_ids) & set(evidence["query_id"]) & set(query_vectors))
    if not ids:
        return None
    vectors = np.stack([query_vectors[q] for q in ids])

    def score(model: MCompassStudent) -> float:
        index, scores = retrieve(model, bank, vectors, min(max(DEFAULT_KS), len(bank.chunk_ids)), device)
        rows = evidence_metrics(run_table("student", ids, index, scores, bank.chunk_ids), evidence, chunk_tokens,
                                query_ids=ids).rows
        return float(rows.loc[rows["metric"] == "IE", "value"].mean())

    return score


def save_student(model: MCompassStudent, directory: str | Path, info: dict) -> Path:
    """Weights (safetensors) and settings (JSON, with `info`: bank hash, training settings) into `directory`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(directory / WEIGHTS_FILE))
    (directory / SETTINGS_FILE).write_text(json.dumps(
        {"kind": KIND, "dimension": model.dimension, "topics": model.n_topics, "settings": asdict(model.settings),
         **info}, indent=2, sort_keys=True))
    return directory


def student_info(directory: str | Path) -> dict:
    """A saved student's settings file: its architecture and the `info` it was saved with (the hash of the bank
    it was trained on: `bank_content_hash`); a ValueError when `directory` holds no student."""
    saved = json.loads((Path(directory) / SETTINGS_FILE).read_text())
    if saved.get("kind") != KIND:
        raise ValueError(f"{directory}: not an MCompassRAG student (kind {saved.get('kind')!r})")
    return saved


def load_student(directory: str | Path, device: torch.device = torch.device("cpu")) -> tuple[MCompassStudent, dict]:
    """A saved student in eval mode, and its settings file."""
    from safetensors.torch import load_file

    directory = Path(directory)
    saved = student_info(directory)
    settings = StudentSettings(**{**saved["settings"], "hidden": tuple(saved["settings"]["hidden"])})
    model = MCompassStudent(saved["dimension"], saved["topics"], settings)
    model.load_state_dict(load_file(str(directory / WEIGHTS_FILE), device=str(device)))
    return model.to(device).eval(), saved


def student_variants(settings: StudentSettings) -> dict[str, StudentSettings]:
    """The student and its ablations (METHODS.md §4), by registry method name (models/registry.py): without
    the selector (theta_q from the topic model alone) and without the abstraction (mean pooling of the
    selected distributions)."""
    return {STUDENT: settings, "mcompass_no_selector": replace(settings, selector=False),
            "mcompass_mean_pool": replace(settings, abstraction="mean")}


STUDENT = "mcompass"  # the full student's method name; the registered model's own weights
VARIANTS_FOLDER = "variants"  # beside them: <fold>/<method>/ of every fold and variant trained


def student_plan(protocol: EvaluationProtocol, queries: pd.DataFrame) -> list[Fold]:
    """The folds the students train on: the train split's (index 0, always: its full student is the registered
    model), and under grouped_cv also one per topic-grouped fold (indices 1..folds)."""
    plan = list(replace(protocol, kind="split").fold_plan(queries))
    if protocol.cross_validated:
        plan += [replace(fold, index=fold.index + 1) for fold in protocol.fold_plan(queries)]
    return plan


def distilled_queries(plan: Sequence[Fold]) -> list[str]:
    """The queries whose pairs a student set learns from or keeps its epoch on: every fold's train and tune
    queries, sorted. The teacher rates these and no others (a test query's pairs are never read)."""
    return sorted(set().union(*(set(fold.train) | set(fold.tune) for fold in plan)))


@dataclass(frozen=True, eq=False)
class StudentSet:
    """Every student a retrieval applies: per (fold index, method) the trained student of that fold's training
    queries (the split protocol has one fold, 0), with the fold (models/protocol.py `Fold`) it belongs to."""
    folds: tuple[Fold, ...]
    students: dict[tuple[int, str], TrainedStudent]


def train_students(bank: TopicBank, query_vectors: dict[str, np.ndarray], pairs: pd.DataFrame, plan: Sequence[Fold],
                   variants: dict[str, StudentSettings], training: TrainingSettings,
                   device: torch.device = torch.device("cpu"), progress: Callable[[str], None] | None = None,
                   evidence: pd.DataFrame | None = None, chunk_tokens: pd.Series | None = None,
                   on_epoch: Callable[[int, dict], None] | None = None) -> StudentSet:
    """Every variant trained on every fold of `plan`: on the fold's training pairs, the epoch kept by the whole-
    corpus IE of its tune queries (`heldout_ie`, given `evidence` and `chunk_tokens`; else by their pair loss).
    `on_epoch` follows the first fold's full student (the registered model's own curve)."""
    students = {}
    for fold in plan:
        fold_pairs, tune_pairs = pairs[pairs["query_id"].isin(fold.train)], pairs[pairs["query_id"].isin(fold.tune)]
        select = (heldout_ie(bank, query_vectors, fold.tune, evidence, chunk_tokens, device)
                  if evidence is not None and chunk_tokens is not None else None)
        for method, settings in variants.items():
            if progress:
                progress(f"fold {fold.index + 1}/{len(plan)}: training {method} on {len(fold_pairs)} pairs")
            followed = on_epoch if (fold.index, method) == (plan[0].index, STUDENT) else None
            students[(fold.index, method)] = train_student(bank, query_vectors, fold_pairs, settings, training, device,
                                                           progress=progress if followed else None,
                                                           dev_pairs=tune_pairs, select=select, on_epoch=followed)
    return StudentSet(tuple(plan), students)


def save_students(students: StudentSet, directory: str | Path, info: dict) -> Path:
    """The first fold's full student at the top of `directory` (the registered model a caller loads) and every
    fold's variants under VARIANTS_FOLDER/<fold>/<method>/ with the fold's queries (folds.json)."""
    directory = Path(directory)
    first = students.folds[0].index
    save_student(students.students[(first, STUDENT)].model, directory, info)
    for (fold, method), trained in sorted(students.students.items()):
        save_student(trained.model, directory / VARIANTS_FOLDER / str(fold) / method, info)
    (directory / VARIANTS_FOLDER / "folds.json").write_text(json.dumps([asdict(f) for f in students.folds], indent=2))
    return directory


def load_students(directory: str | Path, device: torch.device = torch.device("cpu")
                  ) -> tuple[tuple[Fold, ...], dict[tuple[int, str], MCompassStudent]]:
    """The folds and students `save_students` wrote."""
    directory = Path(directory) / VARIANTS_FOLDER
    folds = tuple(Fold(f["index"], tuple(f["train"]), tuple(f["tune"]), tuple(f["evaluated"]))
                  for f in json.loads((directory / "folds.json").read_text()))
    return folds, {(int(fold.name), variant.name): load_student(variant, device)[0]
                   for fold in sorted(p for p in directory.iterdir() if p.is_dir())
                   for variant in sorted(p for p in fold.iterdir() if p.is_dir())}


def student_runs(bank: TopicBank, query_vectors: dict[str, np.ndarray], folds: Sequence[Fold],
                 students: dict[tuple[int, str], MCompassStudent], depth: int,
                 device: torch.device = torch.device("cpu")) -> pd.DataFrame:
    """RETRIEVAL_RUN rows (top-`depth` over the whole bank) of every student for its fold's evaluated queries."""
    from covlab.models.retrieval import run_table

    runs = []
    for fold in folds:
        evaluated = [q for q in fold.evaluated if q in query_vectors]
        if not evaluated:
            continue
        vectors = np.stack([query_vectors[q] for q in evaluated])
        for (index, method), model in sorted(students.items()):
            if index == fold.index:
                found, scores = retrieve(model, bank, vectors, min(depth, len(bank.chunk_ids)), device)
                runs.append(run_table(method, evaluated, found, scores, bank.chunk_ids))
    return pd.concat(runs, ignore_index=True) if runs else pd.DataFrame()


RETRIEVAL_CORPUS = "retrieval_corpus"  # the run artifact folder beside a registered student's weights
CORPUS_CHUNKS_FILE = "chunks.parquet"
CORPUS_CHUNK_COLUMNS = ("chunk_id", "doc_id", "text", "tokens")
# RetrievalCorpus.encoder_mismatch: the chunks whose embeddings an encoder must reproduce, and how closely (the
# bank's encoder on another device or precision reproduces them at a cosine near 1, another encoder near 0)
PROBE_CHUNKS, MIN_PROBE_COSINE = 4, 0.9


@dataclass(frozen=True, eq=False)
class RetrievalCorpus:
    """What whole-corpus retrieval reads beside a student: the topic bank it was trained on, each bank chunk's
    document, text and tokens (`chunks`: CORPUS_CHUNK_COLUMNS, row i is bank chunk i), so that a retrieval
    answers passages and not only ids, and the encoder that embedded the chunks (None: the bank did not record
    it), which must embed the query. Saved as one folder (`save`): the bank's file, the chunks as Parquet and
    the encoder's record; a registered student carries it as its run artifact RETRIEVAL_CORPUS."""
    bank: TopicBank
    chunks: pd.DataFrame
    encoder: BankEncoder | None

    def __post_init__(self):
        if list(self.chunks.columns) != list(CORPUS_CHUNK_COLUMNS):
            raise ValueError(f"retrieval corpus chunks: expected columns {list(CORPUS_CHUNK_COLUMNS)}, got "
                             f"{list(self.chunks.columns)}")
        if self.chunks["chunk_id"].astype(str).tolist() != self.bank.chunk_ids.tolist():
            raise ValueError("retrieval corpus chunks: expected one row per bank chunk, in the bank's order")

    @classmethod
    def of(cls, bank: TopicBank, chunks: pd.DataFrame, encoder: BankEncoder | None) -> RetrievalCorpus:
        """The corpus of `bank` with the rows of `chunks` (the chunks asset's table, any order) it holds; a
        ValueError naming a bank chunk that `chunks` lacks."""
        table = chunks.assign(chunk_id=chunks["chunk_id"].astype(str)).set_index("chunk_id")
        missing = pd.Index(bank.chunk_ids).difference(table.index)
        if len(missing):
            raise ValueError(f"chunks: bank chunk {missing[0]!r} (and {len(missing) - 1} more) has no row; expected "
                             "the chunks the bank was built from")
        ordered = table.loc[bank.chunk_ids, list(CORPUS_CHUNK_COLUMNS[1:])].reset_index()
        return cls(bank, ordered.astype({"tokens": "int64"}), encoder)

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        self.bank.save(directory)
        self.chunks.to_parquet(directory / CORPUS_CHUNKS_FILE, index=False)
        if self.encoder is not None:
            self.encoder.save(directory)
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> RetrievalCorpus:
        return cls(TopicBank.load(directory), pd.read_parquet(Path(directory) / CORPUS_CHUNKS_FILE),
                   BankEncoder.load(directory))

    def encoder_mismatch(self, encode: Callable[[list[str]], np.ndarray]) -> str | None:
        """Why `encode` (texts -> unit vectors) is not the encoder that embedded the bank, None when it is: its
        embeddings of the first PROBE_CHUNKS chunks' texts must have the bank's dimension and a cosine of at
        least MIN_PROBE_COSINE to the bank's own."""
        expected = self.bank.embeddings[:PROBE_CHUNKS]
        found = np.asarray(encode(self.chunks["text"].tolist()[:PROBE_CHUNKS]), dtype=np.float64)
        if found.shape != expected.shape:
            return (f"it embeds in {found.shape[1] if found.ndim == 2 else '?'} dimensions, the bank's chunks are "
                    f"embedded in {expected.shape[1]}")
        cosine = float((found * expected).sum(axis=1).min())
        if cosine < MIN_PROBE_COSINE:
            return (f"its embeddings of the bank's first chunks have a cosine of {cosine:.3f} to the bank's own "
                    f"(expected at least {MIN_PROBE_COSINE})")
        return None
