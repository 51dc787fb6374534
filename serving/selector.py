"""A registry method as a context selector for any caller: `load_selector(method, dataset, alias)` returns a
`ContextSelector` whose `select(query, candidates, budget)` builds the pool the pipeline's selections build
(the packaged encoder's unit embeddings, the packaged tokenizer's token counts, sentence atoms) and runs the
same selector object (models/runs.py's path: the registry entry, the estimator gate and the tuned blend), then
says why each item is in or out (models/explain.py) and which model versions made the choice.

Trained methods load their model from the MLflow registry by alias (`champion` by default), verified against
the content hash the version carries; untrained ones need none. Nothing here imports Dagster.
"""

from __future__ import annotations

import binascii
import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pybase64
from pydantic import TypeAdapter

from covlab.models.comparison import ITEM_EMBEDDING_BATCH, ITEM_EMBEDDING_MAX_LENGTH, atom_sentences
from covlab.models.explain import Reason, explain
from covlab.models.registry import METHOD, Coverage, Method, PoolOrder, Report, SelectorSettings
from covlab.models.registry import method as registry_method
from covlab.models.selectors import Blend, Budget, Pool, RelevanceOrder, Selection, Selector
from covlab.models.trust import MIN_ESTIMATOR_DEV_AUC, estimator_trusted
from covlab.resources.model_store import (CONTENT_HASH_TAG, PROMOTED_BY_TAG, SELECTION_TAG_PREFIX, ModelStore,
                                         ModelVersionRef)

# How many subquestions the offline decomposition of the candidates gives a query at serve time.
SUBQUESTIONS = 10
# The tokens of a text the encoder reads: its max_length less the [CLS] and [SEP] of the BERT-family encoders
# covlab uses; TokenCounter counts without them, and in full.
ENCODER_TOKENS = ITEM_EMBEDDING_MAX_LENGTH - 2
# Distinct texts a selector's token counter keeps counts of (models/tokens.py `max_cached`): a long-lived caller's
# memory stays bounded whatever texts it is sent.
TOKEN_CACHE_TEXTS = 200_000


class ServingError(ValueError):
    """A request a selector cannot serve, in words naming the field and what was expected (HTTP 4xx)."""


@dataclass(frozen=True)
class Candidate:
    """One candidate passage: its id and text, and optionally its unit embedding and its sentence atoms'
    embeddings (as the pipeline's item_embeddings hold them); what is absent is computed."""
    id: str
    text: str
    embedding: np.ndarray | None = None
    atoms: np.ndarray | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


def as_candidates(items: Sequence) -> list[Candidate]:
    """Texts, `{id, text, embedding?, atoms?, metadata?}` records or Candidates as Candidates (embeddings and
    atoms as numbers or `vectors_base64` strings); a ServingError naming `candidates[i].<field>` for the first
    that is not one, and for duplicate ids."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not len(items):
        raise ServingError("candidates: expected a non-empty list of texts or {id, text} records")
    found, vectors = [], []
    for i, item in enumerate(items):
        if isinstance(item, Candidate):
            candidate = item
        elif isinstance(item, str):
            candidate = Candidate(str(i), item)
        elif isinstance(item, Mapping):
            unknown = set(item) - {"id", "text", "embedding", "atoms", "metadata"}
            if unknown:
                raise ServingError(f"candidates[{i}]: unknown field(s) {sorted(unknown)}; expected id, text, "
                                   "embedding, atoms, metadata")
            if not isinstance(item.get("text"), str):
                raise ServingError(f"candidates[{i}].text: expected a string, got {type(item.get('text')).__name__}")
            embedding = _decoded(item.get("embedding"), f"candidates[{i}].embedding", 1)
            candidate = Candidate(str(item.get("id", i)), item["text"], embedding,
                                  _decoded(item.get("atoms"), f"candidates[{i}].atoms", 2,
                                           None if embedding is None else len(embedding)),
                                  dict(item.get("metadata") or {}))
            vectors += [(f"candidates[{i}].{name}", array) for name, array in
                        (("embedding", candidate.embedding), ("atoms", candidate.atoms)) if array is not None]
        else:
            raise ServingError(f"candidates[{i}]: expected a text or an {{id, text}} record, got "
                               f"{type(item).__name__}")
        if not candidate.text.strip():
            raise ServingError(f"candidates[{i}].text: empty; a candidate takes tokens of the context")
        found.append(candidate)
    _require_finite(vectors)
    ids = [c.id for c in found]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ServingError(f"candidates: id {duplicate!r} appears more than once; ids must be distinct")
    return found


def vectors_base64(array) -> str:
    """Vectors in their compact wire form: base64 of little-endian float32 values, row-major (a matrix's rows
    as long as the candidate's embedding). A request's embeddings and atoms may be numbers or this: a body
    of 100 candidates with ~10 atoms each is ~2 MB instead of ~9 MB of JSON numbers, and parses in
    milliseconds."""
    return pybase64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode("ascii")


def _vectors(value, where: str, ndim: int, width: int | None = None) -> np.ndarray | None:
    """`value` (numbers, nested lists, an array or `vectors_base64`'s string) as a finite vector (ndim 1) or matrix
    of one row per atom (ndim 2; a base64 matrix's rows are `width` long); a ServingError naming `where`
    otherwise."""
    array = _decoded(value, where, ndim, width)
    if array is not None:
        _require_finite([(where, array)])
    return array


def _decoded(value, where: str, ndim: int, width: int | None = None) -> np.ndarray | None:
    """`_vectors` without the check for finite values, which `as_candidates` makes once over all of a request's
    vectors (a check per vector costs more than the decoding). Base64 gives a read-only float32 array over the
    decoded bytes, numbers a float array."""
    if value is None:
        return None
    if isinstance(value, str):
        try:  # pybase64: the standard library's decoder, SIMD-accelerated; ~2 MB of atoms in ~0.2 ms, not ~5 ms
            raw = pybase64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ServingError(f"{where}: a string must be base64 of little-endian float32 values") from None
        if len(raw) % 4:
            raise ServingError(f"{where}: {len(raw)} bytes of base64 are not whole float32 values")
        array = np.frombuffer(raw, dtype="<f4")
        if ndim == 2:
            if width is None:
                raise ServingError(f"{where}: a base64 matrix takes its row length from the candidate's embedding; "
                                   "give the embedding too")
            if not len(array) or len(array) % width:
                raise ServingError(f"{where}: {len(array)} float32 values are not whole rows of {width} (the "
                                   "embedding's length)")
            array = array.reshape(-1, width)
    else:
        try:
            array = np.asarray(value, dtype=float)
        except (TypeError, ValueError):
            raise ServingError(f"{where}: expected numbers") from None
    if array.ndim != ndim or not array.size:
        raise ServingError(f"{where}: expected a finite {_SHAPES[ndim]}")
    return array


_SHAPES = {1: "vector", 2: "matrix (one row per atom)"}


def _require_finite(vectors: Sequence[tuple[str, np.ndarray]]) -> None:
    """A ServingError naming the first of `vectors` ((where, array) pairs) that holds a value that is not finite:
    one check over all of them, then a search only when it fails."""
    if vectors and not np.isfinite(np.concatenate([array.ravel() for _, array in vectors])).all():
        where, array = next((w, a) for w, a in vectors if not np.isfinite(a).all())
        raise ServingError(f"{where}: expected a finite {_SHAPES[array.ndim]}")


@dataclass(frozen=True)
class ModelProvenance:
    """A model version a selector read: name, version and the alias it was loaded by, its URI and MLflow run,
    the content hash of its files, the Dagster run that trained it, and the report figure that promoted it
    (the version's PROMOTED_BY_TAG: report, results-store id, method, metric, split, value)."""
    name: str
    version: int
    alias: str | None
    uri: str
    mlflow_run_id: str | None
    content_hash: str | None
    dagster_run_id: str | None
    promoted_by: dict | None

    @classmethod
    def of(cls, ref: ModelVersionRef, alias: str | None) -> ModelProvenance:
        promoted = ref.tags.get(PROMOTED_BY_TAG)
        return cls(ref.name, ref.version, alias, ref.uri, ref.run_id, ref.tags.get(CONTENT_HASH_TAG),
                   ref.tags.get("dagster.run_id"), json.loads(promoted) if promoted else None)


@dataclass(frozen=True)
class ChosenItem:
    """A chosen candidate: its id, rank in the context, tokens, its method's score at its step (None for a
    fill) and why it was chosen."""
    id: str
    rank: int
    tokens: int
    gain: float | None
    reason: str


@dataclass(frozen=True)
class LeftOutItem:
    """A candidate left out, and why (models/explain.py): over budget, redundant with a chosen item (its id and
    their cosine), no uncovered facet, or ranked below the chosen items."""
    id: str
    tokens: int
    kind: str
    reason: str
    redundant_with: str | None = None
    similarity: float | None = None


@dataclass(frozen=True)
class OverEncoderLimit:
    """A candidate longer than the encoder reads: counted in full (`tokens`) against the budget, embedded from
    its first `encoded_tokens` tokens."""
    id: str
    tokens: int
    encoded_tokens: int


@dataclass(frozen=True)
class ServedSelection:
    """What `ContextSelector.select` returns: the chosen items in context order, the tokens they take, what was
    left out and why, the budget, what the estimator gate and blend decided (coverage methods), the model
    versions behind the choice, and the candidates the encoder embedded from their beginning only."""
    method: str
    budget: dict
    tokens: int
    chosen: tuple[ChosenItem, ...]
    left_out: tuple[LeftOutItem, ...]
    decision: dict
    provenance: tuple[ModelProvenance, ...]
    over_encoder_limit: tuple[OverEncoderLimit, ...] = ()

    @property
    def ids(self) -> list[str]:
        return [item.id for item in self.chosen]

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> bytes:
        """The selection as JSON, the same document as `to_dict`'s (pydantic's serialiser of this dataclass: ~0.1 ms
        against ~2 ms for json.dumps of `to_dict`); a value JSON has no type for (candidate metadata) as its str."""
        return _SELECTION_JSON.dump_json(self, fallback=str)


_SELECTION_JSON = TypeAdapter(ServedSelection)


class Encoder:
    """A bi-encoder (models/biencoder.load_first_stage) loaded on first use, shared by threads (one lock); it
    reads the first `max_length` tokens of a text with its [CLS] and [SEP], `max_tokens` of the text itself."""

    def __init__(self, model: str, device: str = "cpu", max_length: int = ITEM_EMBEDDING_MAX_LENGTH):
        self.model, self.device, self.max_length = model, device, max_length
        self.max_tokens = max_length - 2  # less the [CLS] and [SEP], as ENCODER_TOKENS
        self._encode: Callable[[list[str]], np.ndarray] | None = None
        self._lock = threading.Lock()

    def __call__(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            if self._encode is None:
                import torch

                from covlab.models.biencoder import load_first_stage

                self._encode = load_first_stage(self.model, batch_size=ITEM_EMBEDDING_BATCH,
                                                max_length=self.max_length,
                                                device=torch.device(self.device))
            return np.asarray(self._encode(texts), dtype=float)


class ContextSelector:
    """One registry method ready to select (module docstring). `model` is the trained model its selector needs
    (LMVU's ranker); `estimator` scores (subquestion, text) pairs for the coverage methods, with `trust` its
    gate and `blend_weights` the weight chosen on the tune split per budget ("k=10", "tokens=1024"); the
    encoder and token counter build the pool; `provenance` names the model versions loaded."""

    def __init__(self, method: Method, settings: SelectorSettings, encoder: Encoder, counter, *,
                 model: object = None, estimator: Callable[[list[tuple[str, str]]], np.ndarray] | None = None,
                 estimator_dev_auc: float | None = None, blend_weights: Mapping[str, float] | None = None,
                 provenance: Sequence[ModelProvenance] = ()):
        self.method, self.settings, self.encoder, self.counter = method, settings, encoder, counter
        self.model, self.estimator, self.estimator_dev_auc = model, estimator, estimator_dev_auc
        self.blend_weights = dict(blend_weights or {})
        self.provenance = tuple(provenance)
        self._count_lock = threading.Lock()

    def describe(self) -> dict:
        """What /v1/methods shows of a loaded selector (its model versions are added there)."""
        return {"method": self.method.name, "label": self.method.label, "description": self.method.description,
                "trained_models": needed_models(self.method)}

    def select(self, query: str, candidates: Sequence, budget: Budget, *, query_embedding=None,
               subquestions: Sequence[str] | None = None, blend_weight: float | None = None) -> ServedSelection:
        """The selection of `candidates` for `query` within `budget` (module docstring); `query_embedding` and
        the candidates' own embeddings replace the encoder's, `subquestions` the offline decomposition, and
        `blend_weight` the weight chosen on the tune split (coverage methods)."""
        if not isinstance(query, str) or not query.strip():
            raise ServingError("query: expected a non-empty string")
        items = as_candidates(candidates)
        pool = self.pool(query, items, _vectors(query_embedding, "query_embedding", 1), subquestions)
        selector, decision = self._selector(budget, blend_weight)
        selection = selector(pool, budget)
        return self._served(items, pool, selection, budget, decision)

    def _over_encoder_limit(self, items: list[Candidate], pool: Pool) -> tuple[OverEncoderLimit, ...]:
        """The candidates this selector's encoder embedded (no embedding given) that are longer than it reads."""
        limit = getattr(self.encoder, "max_tokens", None)
        if limit is None or pool.embeddings is None:
            return ()
        return tuple(OverEncoderLimit(c.id, int(t), limit) for c, t in zip(items, pool.tokens.tolist())
                     if c.embedding is None and t > limit)

    def pool(self, query: str, items: list[Candidate], query_embedding: np.ndarray | None,
             subquestions: Sequence[str] | None) -> Pool:
        """The Pool the method reads: embeddings, atoms and token counts of the candidates, relevance (the
        caller's order for BM25 / pool order), and the estimated coverage of the subquestions for coverage
        methods."""
        with self._count_lock:
            tokens = np.asarray(self.counter.count([c.text for c in items]), dtype=np.int64)
        if self.method.order is PoolOrder.BM25 and self.method.coverage is Coverage.NONE:
            return Pool(relevance=-np.arange(1, len(items) + 1, dtype=float), tokens=tokens)
        embeddings, query_vector, atoms, atom_items = self._embeddings(query, items, query_embedding)
        covers = self._covers(query, items, subquestions) if self.method.coverage.estimated else None
        return Pool(embeddings=embeddings, query=query_vector, tokens=tokens, covers=covers, atoms=atoms,
                    atom_items=atom_items)

    def _embeddings(self, query: str, items: list[Candidate], query_embedding: np.ndarray | None):
        """The items' and the query's embeddings, and the items' sentence atoms for a method that reads them
        (Method.atoms; the others' pool has no atoms of its own); what the caller did not give is encoded."""
        missing = [c.text for c in items if c.embedding is None]
        sentences = {c.id: atom_sentences(c.text) for c in items if c.atoms is None} if self.method.atoms else {}
        texts = ([] if query_embedding is not None else [query]) + missing + [s for v in sentences.values() for s in v]
        vectors = iter(self.encoder(texts)) if texts else iter(())
        query_vector = query_embedding if query_embedding is not None else next(vectors)
        embeddings = [c.embedding if c.embedding is not None else next(vectors) for c in items]
        if not self.method.atoms:
            return np.stack(embeddings), np.asarray(query_vector), None, None
        computed = {key: [next(vectors) for _ in value] for key, value in sentences.items()}
        atom_rows = [c.atoms if c.atoms is not None else (np.stack(computed[c.id]) if computed[c.id]
                                                           else np.asarray([e])) for c, e in zip(items, embeddings)]
        return (np.stack(embeddings), np.asarray(query_vector), np.concatenate(atom_rows),
                np.repeat(np.arange(len(items)), [len(a) for a in atom_rows]))

    def _covers(self, query: str, items: list[Candidate], subquestions: Sequence[str] | None) -> np.ndarray:
        if subquestions is None:  # the pipeline's default offline decomposition, over the candidates
            from covlab.models.subquestions import FocusSettings, focused_decomposition

            subquestions = list(focused_decomposition(pd.DataFrame({"query_id": ["query"], "text": [query]}),
                                                      {"query": [c.text for c in items]}, self.encoder,
                                                      FocusSettings(n=SUBQUESTIONS))["text"])
        if not subquestions:
            return np.zeros((len(items), 0))
        probabilities = self.estimator([(s, c.text) for c in items for s in subquestions])
        return np.asarray(probabilities, dtype=float).reshape(len(items), len(subquestions))

    def _selector(self, budget: Budget, blend_weight: float | None) -> tuple[Selector, dict]:
        base = self.method.selector(self.settings, self.model)
        if not self.method.coverage.estimated:
            return base, {}
        gate = estimator_trusted(self.estimator_dev_auc if self.estimator_dev_auc is not None else math.nan,
                                 MIN_ESTIMATOR_DEV_AUC)
        decision = {"fell_back": not gate.trusted, "estimator_gate": gate.reason}
        if not gate.trusted:
            return RelevanceOrder(), decision
        weight, chosen_for = (blend_weight, "request") if blend_weight is not None else self._blend_weight(budget)
        decision.update(blend_weight=weight, blend_chosen_for=chosen_for)
        return Blend(base, weight), decision

    def _blend_weight(self, budget: Budget) -> tuple[float, str | None]:
        """The weight chosen on the tune split at this budget, else at the nearest budget of the same unit
        that was evaluated, else 0 (the fallback order: never worse than it)."""
        key = f"{budget.unit}={budget.limit}"
        if key in self.blend_weights:
            return self.blend_weights[key], key
        same = [(abs(int(k.split("=")[1]) - budget.limit), k) for k in self.blend_weights
                if k.split("=")[0] == budget.unit]
        if same:
            nearest = min(same)[1]
            return self.blend_weights[nearest], nearest
        return 0.0, None

    def _served(self, items: list[Candidate], pool: Pool, selection: Selection, budget: Budget,
                decision: dict) -> ServedSelection:
        chosen_reasons, left = explain(pool, selection, budget)
        chosen = tuple(ChosenItem(items[i].id, rank, int(pool.tokens[i]), None if math.isnan(g) else float(g),
                                  reason.text)
                       for rank, (i, g, reason) in enumerate(zip(selection.items.tolist(),
                                                                 selection.gains.tolist(), chosen_reasons), start=1))
        left_out = tuple(_left_out(items, pool, i, reason) for i, reason in left.items())
        return ServedSelection(self.method.name, {budget.unit: budget.limit}, int(pool.tokens[selection.items].sum()),
                               chosen, left_out, decision, self.provenance, self._over_encoder_limit(items, pool))


def _left_out(items: list[Candidate], pool: Pool, index: int, reason: Reason) -> LeftOutItem:
    return LeftOutItem(items[index].id, int(pool.tokens[index]), reason.kind, reason.text,
                       items[reason.other].id if reason.other is not None else None, reason.similarity)


def servable(method: Method) -> bool:
    """Whether a registry method can select for a caller: a selector (not a retriever) that reads no gold
    labels."""
    return method.build is not None and not method.bound


SERVABLE = tuple(name for name, m in METHOD.items() if servable(m))


def load_selector(method: str, dataset: str | None = None, alias: str = "champion", tracking_uri: str | None = None,
                  *, settings: SelectorSettings = SelectorSettings(), device: str = "cpu",
                  cache: str | Path | None = None) -> ContextSelector:
    """A ready ContextSelector for registry method `method` (module docstring): trained models of `dataset`
    loaded from the MLflow registry at `tracking_uri` (default covlab's: COVLAB_MLFLOW_TRACKING_URI, else the
    embedded store of COVLAB_HOME) by `alias`, their files kept under `cache` (default
    `<COVLAB_HOME>/serving`) and verified against the hash each version carries."""
    from covlab.models.encoders import default_base_model
    from covlab.models.tokens import TokenCounter
    from covlab.orchestration.settings import covlab_home

    try:
        entry = registry_method(method)
    except ValueError as error:
        raise ServingError(f"method: {error}; servable: {list(SERVABLE)}") from None
    if not servable(entry):
        raise ServingError(f"method: {method!r} cannot select for a caller ("
                           f"{'it reads gold labels' if entry.bound else 'a retriever'}); servable: {list(SERVABLE)}")
    needs = needed_models(entry)
    if needs and dataset is None:
        raise ServingError(f"dataset: {method} needs its trained {', '.join(needs)} of a dataset; name the dataset")
    store = model_store(tracking_uri)
    folder = Path(cache) if cache is not None else covlab_home() / "serving"
    loaded = {name: registered_version(store, dataset, name, alias, folder) for name in needs}
    encoder = Encoder(loaded["coverage_biencoder"][1] if "coverage_biencoder" in loaded else default_base_model(),
                      device)
    kwargs: dict = {}
    if "lmvu_ranker" in loaded:
        from covlab.models.lmvu import load_rankers

        kwargs["model"] = load_rankers(loaded["lmvu_ranker"][1])[0]
    if "coverage_estimator" in loaded:
        import torch

        from covlab.models.coverage import load_estimator_scorer

        ref, path = loaded["coverage_estimator"]
        kwargs["estimator"] = load_estimator_scorer(str(path), batch_size=ITEM_EMBEDDING_BATCH,
                                                    device=torch.device(device))
        kwargs["estimator_dev_auc"] = _logged(store, ref, "dev_auc")
        recorded = ref.tags.get(SELECTION_TAG_PREFIX + method)
        kwargs["blend_weights"] = {k: v["blend_weight"] for k, v in json.loads(recorded).items()
                                   if v.get("blend_weight") is not None} if recorded else {}
    return ContextSelector(entry, settings, encoder, TokenCounter(max_cached=TOKEN_CACHE_TEXTS), **kwargs,
                           provenance=[ModelProvenance.of(ref, alias) for ref, _ in loaded.values()])


def model_store(tracking_uri: str | None = None) -> ModelStore:
    """The model registry `load_selector` reads: `tracking_uri`, default covlab's (COVLAB_MLFLOW_TRACKING_URI, else
    the embedded store of COVLAB_HOME)."""
    from covlab.orchestration.settings import mlflow_tracking_uri

    return ModelStore(tracking_uri or mlflow_tracking_uri())


def needed_models(entry: Method) -> list[str]:
    """The trained selectors (registered as covlab.<dataset>.<name>) a servable method loads: LMVU its ranker,
    the coverage methods the estimator, the coverage-trained ranking its bi-encoder; [] for the others."""
    return [name for name, needed in (("lmvu_ranker", entry.trained == "lmvu_ranker"),
                                      ("coverage_estimator", entry.coverage.estimated),
                                      ("coverage_biencoder", _orders_by_coverage_biencoder(entry))) if needed]


def _orders_by_coverage_biencoder(entry: Method) -> bool:
    """A method whose whole rule is the coverage-trained bi-encoder's ranking (k-pool order, no coverage read):
    that bi-encoder is then its encoder."""
    return (Report.COVERAGE in entry.reports and entry.order is PoolOrder.COVERAGE_TRAINED
            and entry.coverage is Coverage.NONE)


def registered_version(store: ModelStore, dataset: str, selector: str, alias: str,
                       cache: Path) -> tuple[ModelVersionRef, Path]:
    """The version of covlab.<dataset>.<selector> with `alias` and its files (downloaded once into `cache`)."""
    name = f"covlab.{dataset}.{selector}"
    ref = store.version_for_alias(name, alias)
    if ref is None:
        raise ServingError(f"dataset: {name} has no version with alias {alias!r}; materialize {selector} (and "
                           "model_promotions for champion) on that dataset first")
    digest = ref.tags.get(CONTENT_HASH_TAG)
    local = cache / name / f"v{ref.version}-{(digest or 'unverified')[:16]}"
    if not local.is_dir():
        store.download(ref, local)
    return ref, local


def _logged(store: ModelStore, ref: ModelVersionRef, key: str) -> float | None:
    try:
        return store.metric(ref, key)
    except KeyError:
        return None
