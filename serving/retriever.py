"""Whole-corpus retrieval for any caller, without Dagster: `load_retriever(dataset, alias)` loads a dataset's
registered MCompassRAG student (covlab.<dataset>.mcompass_student, by alias) with the retrieval corpus its version
carries beside the weights (models/mcompass.RetrievalCorpus: the topic bank it was trained on, the chunks' texts,
the bank's encoder), both verified against the hashes the version records, and the student's saved bank hash
against the bank's. `CorpusRetriever.retrieve(query, k | budget, method)` embeds the query with the bank's encoder
and ranks every chunk as the pipeline's mcompass_retrieval does (the same students, bank and scoring code), and
answers the chunks in rank order with their documents, texts, scores and tokens, and the model version behind
them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from pydantic import TypeAdapter

from covlab.models.mcompass import (RETRIEVAL_CORPUS, BankRanker, MCompassStudent, RetrievalCorpus, load_students,
                                    student_info)
from covlab.models.registry import Family, Report, method, methods, trained_selector
from covlab.models.retrieval import dense_top_k, within_token_budget
from covlab.models.selectors import Budget
from covlab.resources.model_store import ATTACHED_TAG_PREFIX, CANDIDATE_ALIAS, ModelStore
from covlab.serving.selector import ModelProvenance, ServingError, model_store, registered_version
from covlab.serving.shared import shared_encoder

# The retrieval method served by default (the MCompassRAG student), and the trained selector its version is of.
DEFAULT_RETRIEVER = next(m.name for m in methods(Report.RETRIEVAL) if m.family is Family.MCOMPASS)
STUDENT_MODEL = method(DEFAULT_RETRIEVER).trained
# The whole-corpus retrieval methods a registered student's version holds everything for: the student and its
# two ablations (trained beside it on the train split) and dense cosine over the bank's chunk embeddings (the
# retrieval method that reads no model of its own and no index). BM25 ranks with the pipeline's Lucene index of
# the chunks, which no version carries.
DENSE = next(m.name for m in methods(Report.RETRIEVAL) if m.build is None and m.trained is None)
RETRIEVERS = tuple(m.name for m in methods(Report.RETRIEVAL) if m.trained == STUDENT_MODEL or m.name == DENSE)
# How an answer's list ended: its k chunks, the first chunk over the token budget, the whole corpus, the
# caller's cap on the chunks one answer holds.
ENDED_BY = ("k", "tokens", "corpus", "max_chunks")


@dataclass(frozen=True)
class RetrievedChunk:
    """A retrieved chunk: its id, document, rank (1 first), its method's score (the student's logit, the dense
    cosine), its text and its tokens (the pipeline's count, as the retrieval report's token budget reads it)."""
    id: str
    doc_id: str
    rank: int
    score: float
    text: str
    tokens: int


@dataclass(frozen=True)
class Retrieval:
    """What `CorpusRetriever.retrieve` returns: the method and dataset, the budget, the tokens the chunks take,
    the chunks in rank order, what ended the list (ENDED_BY), the hash of the bank ranked and the model version
    that carried it (and, for the student's methods, the weights)."""
    method: str
    dataset: str
    budget: dict
    tokens: int
    chunks: tuple[RetrievedChunk, ...]
    ended_by: str
    bank_content_hash: str
    provenance: tuple[ModelProvenance, ...]

    @property
    def ids(self) -> list[str]:
        return [chunk.id for chunk in self.chunks]

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> bytes:
        """The retrieval as JSON, the same document as `to_dict`'s (pydantic's serialiser of this dataclass)."""
        return _RETRIEVAL_JSON.dump_json(self, fallback=str)


_RETRIEVAL_JSON = TypeAdapter(Retrieval)


class CorpusRetriever:
    """One dataset's corpus ready to retrieve from (module docstring): its RetrievalCorpus, the students by
    registry method (each kept as a models/mcompass.BankRanker), the bank's encoder and the version they came
    from."""

    def __init__(self, dataset: str, corpus: RetrievalCorpus, students: Mapping[str, MCompassStudent],
                 encoder: Encoder, device: str = "cpu", provenance: Sequence[ModelProvenance] = ()):
        self.dataset, self.corpus, self.encoder = dataset, corpus, encoder
        self.rankers = {method: BankRanker.of(model, corpus.bank, torch.device(device))
                        for method, model in students.items()}
        self.methods = tuple(m for m in RETRIEVERS if m in self.rankers or m == DENSE)
        self.provenance = tuple(provenance)
        self.bank_content_hash = corpus.bank.content_hash()
        self._tokens = corpus.chunks["tokens"].to_numpy(np.int64)

    def retrieve(self, query: str, k: int | None = None, *, budget: Budget | None = None,
                 method: str = DEFAULT_RETRIEVER, max_chunks: int | None = None) -> Retrieval:
        """The chunks `method` ranks first for `query` over the whole corpus: the first `k` (or `budget.k`), or
        under `budget.tokens` the chunks in rank order up to the first that does not fit (no later, smaller
        chunk in its place: the retrieval report's rule, models/retrieval.py), at most `max_chunks`."""
        if not isinstance(query, str) or not query.strip():
            raise ServingError("query: expected a non-empty string")
        if method not in self.methods:
            raise ServingError(f"method: {method!r} does not retrieve from a registered corpus; served: "
                               f"{list(self.methods)}")
        budget = _budget(k, budget)
        n = len(self._tokens)
        caps = {"k": budget.k or n + 1, "corpus": n, "max_chunks": max_chunks or n + 1}  # ties: the first named
        depth = min(caps.values())
        vector = self.encoder([query])
        index, scores = (dense_top_k(vector, self.corpus.bank.embeddings, depth) if method == DENSE
                         else self.rankers[method].top_k(vector, depth))
        index, scores = index[0], scores[0]
        kept = within_token_budget(self._tokens[index], budget.tokens) if budget.tokens is not None else depth
        ended_by = "tokens" if kept < depth else next(name for name, cap in caps.items() if cap == depth)
        rows = self.corpus.chunks.iloc[index[:kept]]
        chunks = tuple(RetrievedChunk(str(chunk), str(doc), rank, float(score), str(text), int(tokens))
                       for rank, (chunk, doc, text, tokens, score) in enumerate(zip(
                           rows["chunk_id"], rows["doc_id"], rows["text"], rows["tokens"], scores[:kept].tolist()),
                           start=1))
        return Retrieval(method, self.dataset, {budget.unit: budget.limit}, int(rows["tokens"].sum()), chunks,
                         ended_by, self.bank_content_hash, self.provenance)

    def describe(self) -> dict:
        """What /v1/methods shows of a loaded retriever (its model versions are added there)."""
        encoder = self.corpus.encoder
        return {"dataset": self.dataset, "methods": list(self.methods), "trained_models": [STUDENT_MODEL],
                "chunks": len(self._tokens), "bank_content_hash": self.bank_content_hash,
                "encoder": {"model": self.encoder.model, "max_length": self.encoder.max_length,
                            "recorded_with_the_bank": encoder is not None}}


def _budget(k: int | None, budget: Budget | None) -> Budget:
    """`k` as a Budget, or `budget`; a ServingError naming the field when neither or both are given, or a bad one."""
    if (k is None) == (budget is None):
        raise ServingError(f"k: give exactly one of k and budget; got {'both' if k is not None else 'neither'}")
    if budget is not None:
        return budget
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ServingError(f"k: expected a positive whole number of chunks, got {k!r}")
    return Budget(k=int(k))


def registered_alias(selector: str, alias: str) -> str:
    """The alias `selector`'s version is loaded by: `alias`, except that the `champion` of a trained selector the
    registry never promotes (models/registry.py TRAINED_SELECTORS without a PromotionRule: the MCompassRAG
    student) is its newest registered version, the one holding CANDIDATE_ALIAS."""
    trained = trained_selector(selector)
    return CANDIDATE_ALIAS if alias == "champion" and trained.promotion is None else alias


def retrievable_datasets(store: ModelStore) -> list[str]:
    """The datasets with a registered MCompassRAG student in `store`."""
    prefix, suffix = "covlab.", f".{STUDENT_MODEL}"
    return [name[len(prefix):-len(suffix)] for name in store.registered(f"{prefix}%{suffix}")]


def load_retriever(dataset: str, alias: str = "champion", tracking_uri: str | None = None, *, device: str = "cpu",
                   cache: str | Path | None = None, store: ModelStore | None = None) -> CorpusRetriever:
    """A ready CorpusRetriever over `dataset`'s corpus (module docstring): the version of
    covlab.<dataset>.mcompass_student with `alias` (`registered_alias`) in the registry at `tracking_uri`
    (default covlab's, as load_selector), its weights and retrieval corpus kept under `cache` (default
    `<COVLAB_HOME>/serving`) and verified against the hashes the version carries; the query encoder is the
    bank's, checked to reproduce the bank's embeddings of its first chunks."""
    from covlab.models.encoders import default_base_model
    from covlab.resources.home import covlab_home

    if not isinstance(dataset, str) or not dataset:
        raise ServingError("dataset: expected the name of a dataset with a registered mcompass_student")
    store = store or model_store(tracking_uri)
    folder = Path(cache) if cache is not None else covlab_home() / "serving"
    name = f"covlab.{dataset}.{STUDENT_MODEL}"
    if store.aliases(name) is None:
        raise ServingError(f"dataset: {dataset!r} has no registered MCompassRAG student ({name}); datasets with "
                           f"one: {retrievable_datasets(store)}")
    used = registered_alias(STUDENT_MODEL, alias)
    ref, weights = registered_version(store, dataset, STUDENT_MODEL, used, folder)
    corpus_hash = ref.tags.get(ATTACHED_TAG_PREFIX + RETRIEVAL_CORPUS)
    if corpus_hash is None:
        raise ServingError(f"dataset: {ref.uri} carries no retrieval corpus beside its weights (it was registered "
                           "before students carried one); materialize mcompass_student again")
    local = folder / name / f"corpus-{corpus_hash[:16]}"
    if not local.is_dir():
        store.download_attached(ref, RETRIEVAL_CORPUS, local)
    corpus = RetrievalCorpus.load(local)
    trained_on = student_info(weights).get("bank_content_hash")
    if trained_on != corpus.bank.content_hash():
        raise ServingError(f"dataset: {ref.uri} was trained on bank {trained_on}, but the corpus it carries holds "
                           f"bank {corpus.bank.content_hash()}")
    encoder = (shared_encoder(corpus.encoder.path(), device, corpus.encoder.max_length) if corpus.encoder is not None
               else shared_encoder(default_base_model(), device))  # a bank that did not record its encoder: the default
    problem = corpus.encoder_mismatch(encoder)
    if problem:
        raise ServingError(f"dataset: the encoder {encoder.model} is not the one that embedded the bank of "
                           f"{ref.uri}: {problem}")
    folds, students = load_students(weights, torch.device(device))
    first = folds[0].index  # the train split's students: the registered model and its ablations
    return CorpusRetriever(dataset, corpus, {m: model for (fold, m), model in students.items() if fold == first},
                           encoder, device, [ModelProvenance.of(ref, used)])
