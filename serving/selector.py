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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pybase64
from pydantic import TypeAdapter

from covlab.models.comparison import atom_sentences
from covlab.models.explain import Reason, explain
from covlab.models.biencoder import coverage_anchor
from covlab.models.registry import (METHOD, Coverage, Method, PoolOrder, Role, SelectorSettings, TrainedSelector,
                                    pyfunc_selector)
from covlab.models.registry import method as registry_method
from covlab.models.replay import RecordedDecisions
from covlab.models.runtime import DEFAULT_RUNTIME, Runtime
from covlab.models.selectors import NORM_TOLERANCE, Blend, Budget, Pool, RelevanceOrder, Selection, Selector
from covlab.resources.model_store import (ADOPTED_FROM_TAG, CONTENT_HASH_TAG, PROMOTED_BY_TAG, TRAINED_ON_TAG,
                                         ModelStore, ModelVersionRef, WeightsChanged, recorded_decisions,
                                         weights_change)
from covlab.serving.shared import VersionFiles, served_models, shared_encoder

# Bytes of texts and counts a selector's token counter keeps, the least recently counted dropped first
# (models/tokens.py `max_cached_bytes`): a long-lived caller's memory stays bounded whatever texts it is sent, however
# long (~3,300 texts of 20,000 characters, or ~250,000 of a sentence).
TOKEN_CACHE_BYTES = 64 * 2**20


class ServingError(ValueError):
    """A request a selector cannot serve, in words naming the field and what was expected (HTTP 4xx)."""


class FieldError(ServingError):
    """A request field covlab cannot read (HTTP 422): `loc` is its path in the request (("candidates", 3,
    "embedding")); the message names it and says what was expected."""

    def __init__(self, loc: Sequence[str | int], message: str):
        super().__init__(message)
        self.loc = tuple(loc)


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
    atoms as numbers or `vectors_base64` strings); a FieldError naming `candidates[i].<field>` for the first
    that is not one, for duplicate ids, for embeddings given for some candidates only, and for vectors that are
    not finite, not all of one width or not unit length (`_require_unit_vectors`)."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not len(items):
        raise _refused(("candidates",), "expected a non-empty list of texts or {id, text} records")
    found = []
    for i, item in enumerate(items):
        if isinstance(item, Candidate):
            candidate = item
        elif isinstance(item, str):
            candidate = Candidate(str(i), item)
        elif isinstance(item, Mapping):
            unknown = set(item) - {"id", "text", "embedding", "atoms", "metadata"}
            if unknown:
                raise _refused(("candidates", i), f"unknown field(s) {sorted(unknown)}; expected id, text, "
                                                  "embedding, atoms, metadata")
            if not isinstance(item.get("text"), str):
                raise _refused(("candidates", i, "text"), f"expected a string, got {type(item.get('text')).__name__}")
            embedding = _decoded(item.get("embedding"), ("candidates", i, "embedding"), 1)
            candidate = Candidate(str(item.get("id", i)), item["text"], embedding,
                                  _decoded(item.get("atoms"), ("candidates", i, "atoms"), 2,
                                           None if embedding is None else len(embedding)),
                                  dict(item.get("metadata") or {}))
        else:
            raise _refused(("candidates", i), f"expected a text or an {{id, text}} record, got {type(item).__name__}")
        if not candidate.text.strip():
            raise _refused(("candidates", i, "text"), "empty; a candidate takes tokens of the context")
        found.append(candidate)
    _require_all_or_none(found)
    _require_unit_vectors(_given_vectors(found))
    ids = [c.id for c in found]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise _refused(("candidates",), f"id {duplicate!r} appears more than once; ids must be distinct")
    return found


def field_name(loc: Sequence[str | int]) -> str:
    """A request field's path as messages write it: ("candidates", 3, "embedding") -> "candidates[3].embedding"."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" if n else part for n, part in enumerate(loc))


def _refused(loc: Sequence[str | int], reason: str) -> FieldError:
    return FieldError(loc, f"{field_name(loc)}: {reason}")


def _positions(indices: Sequence[int], shown: int = 10) -> str:
    """Candidate positions as a message lists them: the first `shown`, then how many in all."""
    listed = ", ".join(str(i) for i in indices[:shown])
    return listed if len(indices) <= shown else f"{listed}, ... ({len(indices)} in all)"


def _require_all_or_none(items: Sequence[Candidate]) -> None:
    """A FieldError unless every candidate has an embedding or none has (the encoder's vectors and a caller's are
    not comparable): it names those without one, or those with one, whichever list is shorter."""
    given = [i for i, c in enumerate(items) if c.embedding is not None]
    if 0 < len(given) < len(items):
        missing = [i for i, c in enumerate(items) if c.embedding is None]
        which, reason = ((missing, "missing") if len(missing) <= len(given)
                         else (given, f"given for {len(given)} of {len(items)} candidates only"))
        raise FieldError(("candidates",), f"candidates[{_positions(which)}].embedding: {reason}; give an embedding "
                                          "for every candidate or for none")


def _given_vectors(items: Sequence[Candidate]) -> list[tuple[tuple, np.ndarray]]:
    """(loc, array) of every embedding and atoms matrix the candidates came with, in request order."""
    return [(("candidates", i, name), np.asarray(array)) for i, c in enumerate(items)
            for name, array in (("embedding", c.embedding), ("atoms", c.atoms)) if array is not None]


def _require_width(vectors: Sequence[tuple[tuple, np.ndarray]], width: int, whose: str) -> None:
    """A FieldError naming the first of `vectors` ((loc, array) pairs: vectors, or matrices of one row per atom)
    whose rows are not `width` wide (`whose`: whose width that is)."""
    for loc, array in vectors:
        if array.shape[-1] != width:
            raise _refused(loc, f"expected width {width} ({whose}), got {array.shape[-1]}")


def _require_unit_vectors(vectors: Sequence[tuple[tuple, np.ndarray]]) -> None:
    """A FieldError naming the first of `vectors` ((loc, array) pairs) that is not as wide as the first, holds a
    value that is not finite, or has a row that is not unit length (within the NORM_TOLERANCE a Pool allows): one
    pass over all of them (a check per vector costs more than the decoding), then a search only when it fails."""
    if not vectors:
        return
    width = vectors[0][1].shape[-1]
    _require_width(vectors, width, f"the first embedding's, {field_name(vectors[0][0])}")
    rows = np.concatenate([array.reshape(-1, width) for _, array in vectors])
    if (np.abs(np.sqrt(np.einsum("ij,ij->i", rows, rows)) - 1) <= NORM_TOLERANCE).all():  # NaN and inf fail too
        return
    _require_finite(vectors)
    for loc, array in vectors:
        norms = np.linalg.norm(array.reshape(-1, width), axis=1)
        off = np.flatnonzero(~(np.abs(norms - 1) <= NORM_TOLERANCE))
        if len(off):
            row = "" if array.ndim == 1 else f"row {off[0]} is "
            raise _refused(loc, f"{row}not unit length (norm {norms[off[0]]:.6f}); covlab expects unit-normalised "
                                "embeddings")


def _query_vector(value, items: Sequence[Candidate]) -> np.ndarray | None:
    """A request's `query_embedding` as a finite non-zero vector (a Pool reads its direction only) as wide as the
    candidates' vectors; a FieldError naming it otherwise."""
    loc = ("query_embedding",)
    array = _vectors(value, loc, 1)
    if array is None:
        return None
    given = _given_vectors(items)
    if given:
        _require_width([(loc, array)], given[0][1].shape[-1], f"the first embedding's, {field_name(given[0][0])}")
    if not np.linalg.norm(array) > 0:
        raise _refused(loc, "a zero vector; expected a non-zero vector (its direction is read)")
    return array


def _require_encoded_width(encoded: np.ndarray, query_embedding: np.ndarray | None, items: Sequence[Candidate],
                           atoms_encoded: bool) -> None:
    """A FieldError naming the first vector a request gave that is not as wide as the encoder's vectors of what it
    did not give (`encoded`: the query, the candidates, their sentence atoms)."""
    if not len(encoded):
        return
    made = [name for name, encoded_here in (("the query", query_embedding is None),
                                            ("the candidates", items[0].embedding is None),
                                            ("the sentence atoms", atoms_encoded)) if encoded_here]
    given = [(("query_embedding",), query_embedding)] if query_embedding is not None else []
    _require_width(given + _given_vectors(items), encoded.shape[-1],
                   f"the encoder's, which embedded {' and '.join(made)}")


def vectors_base64(array) -> str:
    """Vectors in their compact wire form: base64 of little-endian float32 values, row-major (a matrix's rows
    as long as the candidate's embedding). A request's embeddings and atoms may be numbers or this: a body
    of 100 candidates with ~10 atoms each is ~2 MB instead of ~9 MB of JSON numbers, and parses in
    milliseconds."""
    return pybase64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode("ascii")


def _vectors(value, loc: Sequence[str | int], ndim: int, width: int | None = None) -> np.ndarray | None:
    """`value` (numbers, nested lists, an array or `vectors_base64`'s string) as a finite vector (ndim 1) or matrix
    of one row per atom (ndim 2; a base64 matrix's rows are `width` long); a FieldError naming the request field
    at `loc` otherwise."""
    array = _decoded(value, loc, ndim, width)
    if array is not None:
        _require_finite([(loc, array)])
    return array


def _decoded(value, loc: Sequence[str | int], ndim: int, width: int | None = None) -> np.ndarray | None:
    """`_vectors` without the check for finite values, which `as_candidates` makes once over all of a request's
    vectors (a check per vector costs more than the decoding). Base64 gives a read-only float32 array over the
    decoded bytes, numbers a float array."""
    if value is None:
        return None
    if isinstance(value, str):
        try:  # pybase64: the standard library's decoder, SIMD-accelerated; ~2 MB of atoms in ~0.2 ms, not ~5 ms
            raw = pybase64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise _refused(loc, "a string must be base64 of little-endian float32 values") from None
        if len(raw) % 4:
            raise _refused(loc, f"{len(raw)} bytes of base64 are not whole float32 values")
        array = np.frombuffer(raw, dtype="<f4")
        if ndim == 2:
            if width is None:
                raise _refused(loc, "a base64 matrix takes its row length from the candidate's embedding; give the "
                                    "embedding too")
            if not len(array) or len(array) % width:
                raise _refused(loc, f"{len(array)} float32 values are not whole rows of {width} (the embedding's "
                                    "length)")
            array = array.reshape(-1, width)
    else:
        try:
            array = np.asarray(value, dtype=float)
        except (TypeError, ValueError):
            raise _refused(loc, "expected numbers") from None
    if array.ndim != ndim or not array.size:
        raise _refused(loc, f"expected a finite {_SHAPES[ndim]}")
    return array


_SHAPES = {1: "vector", 2: "matrix (one row per atom)"}


def _require_finite(vectors: Sequence[tuple[tuple, np.ndarray]]) -> None:
    """A FieldError naming the first of `vectors` ((loc, array) pairs) that holds a value that is not finite: one
    check over all of them, then a search only when it fails."""
    if vectors and not np.isfinite(np.concatenate([array.ravel() for _, array in vectors])).all():
        loc, array = next((w, a) for w, a in vectors if not np.isfinite(a).all())
        raise _refused(loc, f"expected a finite {_SHAPES[array.ndim]}")


@dataclass(frozen=True)
class ModelProvenance:
    """A model version a selector read: name, version and the alias it was loaded by, its URI and MLflow run,
    the content hash of its files, the Dagster run that registered it, the report figure that promoted it
    (the version's PROMOTED_BY_TAG: report, results-store id, method, metric, split, value), the dataset it was
    trained on, and, for a version adopted from another dataset (models/adoption.py), the version it is."""
    name: str
    version: int
    alias: str | None
    uri: str
    mlflow_run_id: str | None
    content_hash: str | None
    dagster_run_id: str | None
    promoted_by: dict | None
    trained_on: str | None = None
    adopted_from: str | None = None

    @classmethod
    def of(cls, ref: ModelVersionRef, alias: str | None) -> ModelProvenance:
        promoted = ref.tags.get(PROMOTED_BY_TAG)
        return cls(ref.name, ref.version, alias, ref.uri, ref.run_id, ref.tags.get(CONTENT_HASH_TAG),
                   ref.tags.get("dagster.run_id"), json.loads(promoted) if promoted else None,
                   ref.tags.get(TRAINED_ON_TAG, ref.tags.get("dagster.partition")), ref.tags.get(ADOPTED_FROM_TAG))


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


class ContextSelector:
    """One registry method ready to select (module docstring). `models` are the loaded versions of the trained
    selectors it serves by, by their registry Role (models/registry.py: the ranker its selector applies, the
    estimator that scores (subquestion, text) pairs for the coverage methods, the bi-encoder that ranks its
    pool where the pipeline ranks by it); `decisions` what the evaluation decided per budget on the estimator's
    output (models/replay.py), which each selection replays; the encoder and token counter build the pool;
    `provenance` names the model versions loaded."""

    def __init__(self, method: Method, settings: SelectorSettings, encoder: Encoder, counter, *,
                 models: Mapping[Role, object] | None = None, decisions: RecordedDecisions | None = None,
                 provenance: Sequence[ModelProvenance] = ()):
        self.method, self.settings, self.encoder, self.counter = method, settings, encoder, counter
        self.models = dict(models or {})
        self.decisions = decisions if decisions is not None else RecordedDecisions({})
        self.provenance = tuple(provenance)
        self._count_lock, self._order_lock = threading.Lock(), threading.Lock()

    def describe(self) -> dict:
        """What /v1/methods shows of a loaded selector (its model versions are added there)."""
        return {"method": self.method.name, "label": self.method.label, "description": self.method.description,
                "trained_models": [t.asset for t in self.method.served_models()],
                "evaluated_budgets": sorted(self.decisions.budgets)}

    def select(self, query: str, candidates: Sequence, budget: Budget, *, query_embedding=None,
               subquestions: Sequence[str] | None = None, blend_weight: float | None = None) -> ServedSelection:
        """The selection of `candidates` for `query` within `budget` (module docstring); `query_embedding` and
        the candidates' own embeddings replace the encoder's, `subquestions` the offline decomposition, and
        `blend_weight` the weight the evaluation chose (coverage methods)."""
        if not isinstance(query, str) or not query.strip():
            raise ServingError("query: expected a non-empty string")
        items = as_candidates(candidates)
        pool = self.pool(query, items, _query_vector(query_embedding, items), subquestions, budget)
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
             subquestions: Sequence[str] | None, budget: Budget) -> Pool:
        """The Pool the method reads at `budget`: embeddings, atoms and token counts of the candidates, relevance
        ranked as the pipeline ranks this method's pool at that budget (Method.order_at: the caller's order for
        BM25 / pool order, the coverage-trained bi-encoder's cosine for a pool it ranks, else the embeddings'
        cosine), and the estimated coverage of the subquestions for coverage methods."""
        with self._count_lock:
            tokens = np.asarray(self.counter.count([c.text for c in items]), dtype=np.int64)
        order = self.method.order_at(budget)
        if order is PoolOrder.BM25 and self.method.coverage is Coverage.NONE:
            return Pool(relevance=-np.arange(1, len(items) + 1, dtype=float), tokens=tokens)
        embeddings, query_vector, atoms, atom_items = self._embeddings(query, items, query_embedding)
        covers = self._covers(query, items, subquestions) if self.method.coverage.estimated else None
        relevance = (self._order_relevance(query, items) if order is PoolOrder.COVERAGE_TRAINED
                     and Role.ORDER_ENCODER in self.models else None)
        return Pool(embeddings=embeddings, query=query_vector, tokens=tokens, relevance=relevance, covers=covers,
                    atoms=atoms, atom_items=atom_items)

    def _order_relevance(self, query: str, items: list[Candidate]) -> np.ndarray:
        """The cosine of each candidate to the query under the order encoder, the query read in the uncovered
        state it was trained with (models/biencoder.py coverage_anchor), as the pipeline's pool scores rank."""
        with self._order_lock:
            vectors = np.asarray(self.models[Role.ORDER_ENCODER]([coverage_anchor(query, [])]
                                                                  + [c.text for c in items]), dtype=float)
        return vectors[1:] @ vectors[0]

    def _embeddings(self, query: str, items: list[Candidate], query_embedding: np.ndarray | None):
        """The items' and the query's embeddings, and the items' sentence atoms for a method that reads them
        (Method.atoms; the others' pool has no atoms of its own); what the caller did not give is encoded."""
        missing = [c.text for c in items if c.embedding is None]
        sentences = {c.id: atom_sentences(c.text) for c in items if c.atoms is None} if self.method.atoms else {}
        texts = ([] if query_embedding is not None else [query]) + missing + [s for v in sentences.values() for s in v]
        encoded = np.asarray(self.encoder(texts)) if texts else np.zeros((0, 0))
        _require_encoded_width(encoded, query_embedding, items, any(sentences.values()))
        vectors = iter(encoded)
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
        if subquestions is None:  # the pipeline's default offline decomposition, over the first candidates
            from covlab.models.subquestions import POOL_DEPTH, focused_decomposition

            subquestions = list(focused_decomposition(pd.DataFrame({"query_id": ["query"], "text": [query]}),
                                                      {"query": [c.text for c in items[:POOL_DEPTH]]},
                                                      self.encoder)["text"])
        if not subquestions:
            return np.zeros((len(items), 0))
        probabilities = self.models[Role.COVERAGE_ESTIMATOR]([(s, c.text) for c in items for s in subquestions])
        return np.asarray(probabilities, dtype=float).reshape(len(items), len(subquestions))

    def _selector(self, budget: Budget, blend_weight: float | None) -> tuple[Selector, dict]:
        """The selector at `budget` and, for a method on estimated coverage, the decision it replays
        (models/replay.py): the evaluation's at that budget, the nearest evaluated budget's, or the fallback
        order, each said in the decision; a request's `blend_weight` replaces the replayed weight (the rule is
        then "request") unless the evaluation's estimator gate sent this method back to its fallback."""
        base = self.method.selector(self.settings, self.models.get(Role.SELECTOR_MODEL))
        if not self.method.coverage.estimated:
            return base, {}
        replayed = self.decisions.at(budget)
        recorded = replayed.decision
        decision = {"fell_back": recorded.fell_back, "estimator_gate": recorded.estimator_gate,
                    "rule": replayed.rule, "reason": replayed.reason, "blend_weight": recorded.blend_weight,
                    "blend_chosen_for": replayed.chosen_for}
        if blend_weight is not None and (isinstance(blend_weight, bool) or not isinstance(blend_weight, (int, float))
                                         or not 0 <= blend_weight <= 1):
            raise FieldError(("blend_weight",), f"blend_weight: expected a number in [0, 1], got {blend_weight!r}")
        if blend_weight is not None and replayed.rule != "fallback" and recorded.fell_back:
            decision["reason"] += "; the request's blend_weight is not applied below the estimator gate"
        elif blend_weight is not None:
            decision.update(fell_back=False, rule="request", blend_weight=float(blend_weight),
                            blend_chosen_for="request", reason="the request's blend_weight")
        if decision["fell_back"]:
            return RelevanceOrder(), decision
        weight = decision["blend_weight"]
        return (base, decision) if weight is None else (Blend(base, weight), decision)

    def _served(self, items: list[Candidate], pool: Pool, selection: Selection, budget: Budget,
                decision: dict) -> ServedSelection:
        chosen_reasons, left = explain(pool, selection, budget, [c.id for c in items])
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
                  *, settings: SelectorSettings | None = None, device: str = "cpu",
                  cache: str | Path | None = None, runtime: Runtime = DEFAULT_RUNTIME) -> ContextSelector:
    """A ready ContextSelector for registry method `method` (module docstring): the trained selectors it serves
    by (Method.served_models) of `dataset` loaded from the MLflow registry at `tracking_uri` (default covlab's:
    COVLAB_MLFLOW_TRACKING_URI, else the embedded store of COVLAB_HOME) by `alias`, each by its registry entry's
    loader, their files kept under `cache` (default `<COVLAB_HOME>/serving`) and verified against the hash each
    version carries, with the decisions the evaluation recorded on them. `settings` default: the settings those
    decisions were taken under, else the registry's defaults. The texts of a request are encoded on `runtime`
    (models/runtime.py); the trained selectors run on torch."""
    from covlab.models.encoders import default_base_model
    from covlab.models.tokens import TokenCounter

    try:
        entry = registry_method(method)
    except ValueError as error:
        raise ServingError(f"method: {error}; servable: {list(SERVABLE)}") from None
    if not servable(entry):
        raise ServingError(f"method: {method!r} cannot select for a caller ("
                           f"{'it reads gold labels' if entry.bound else 'a retriever'}); servable: {list(SERVABLE)}")
    needs = entry.served_models()
    if needs and dataset is None:
        raise ServingError(f"dataset: {method} needs its trained {', '.join(t.asset for t in needs)} of a dataset; "
                           "name the dataset")
    loaded, decisions = _served_versions(entry, dataset, alias, tracking_uri, cache)
    return ContextSelector(entry, settings or decisions.settings or SelectorSettings(),
                           shared_encoder(default_base_model(), device, runtime=runtime),
                           TokenCounter(max_cached_bytes=TOKEN_CACHE_BYTES),
                           models=served_models({t: VersionFiles(path, ref.tags[CONTENT_HASH_TAG])
                                                 for t, (ref, path) in loaded.items()}, device),
                           decisions=decisions, provenance=[ModelProvenance.of(ref, alias) for ref, _ in loaded.values()])


def pyfunc_model_config(method: str, dataset: str, alias: str = "champion", tracking_uri: str | None = None, *,
                        cache: str | Path | None = None) -> dict:
    """The model config under which the pyfunc of `method`'s version (serving/pyfunc.py) serves as load_selector
    serves it: the method, the decisions the evaluation recorded, its weights' content hash, and the verified
    folders of the other trained selectors it serves by with theirs (which the pyfunc verifies again), all of
    `dataset` by `alias`; for `mlflow.pyfunc.load_model(uri, model_config=...)`."""
    entry = registry_method(method)
    own = pyfunc_selector(entry.name)
    loaded, decisions = _served_versions(entry, dataset, alias, tracking_uri, cache)
    content_hash = loaded[own][0].tags[CONTENT_HASH_TAG]
    models = {trained.asset: {"path": str(path), "content_hash": ref.tags[CONTENT_HASH_TAG]}
              for trained, (ref, path) in loaded.items() if trained is not own}
    return {"method": method, "decisions": decisions.to_json(), "content_hash": content_hash, "models": models}


def _served_versions(entry: Method, dataset: str, alias: str, tracking_uri: str | None, cache: str | Path | None
                     ) -> tuple[dict[TrainedSelector, tuple[ModelVersionRef, Path]], RecordedDecisions]:
    """The verified version of each trained selector `entry` serves by (`registered_version`, files under `cache`,
    default `<COVLAB_HOME>/serving`), and the decisions the evaluation recorded on them for `entry`."""
    from covlab.resources.home import covlab_home

    store = model_store(tracking_uri)
    folder = Path(cache) if cache is not None else covlab_home() / "serving"
    loaded = {t: registered_version(store, dataset, t.asset, alias, folder) for t in entry.served_models()}
    decisions = RecordedDecisions({})
    for trained, (ref, _) in loaded.items():
        if trained.records_decisions:
            decisions = decisions.merged(recorded_decisions(ref, entry.name))
    return loaded, decisions


def model_store(tracking_uri: str | None = None) -> ModelStore:
    """The model registry `load_selector` reads: `tracking_uri`, default covlab's (COVLAB_MLFLOW_TRACKING_URI, else
    the embedded store of COVLAB_HOME)."""
    from covlab.resources.home import mlflow_tracking_uri

    return ModelStore(tracking_uri or mlflow_tracking_uri())


def registered_version(store: ModelStore, dataset: str, selector: str, alias: str,
                       cache: Path) -> tuple[ModelVersionRef, Path]:
    """The version of covlab.<dataset>.<selector> with `alias` and its weights: downloaded once into `cache`, every
    file of the version verified there (`ModelStore.download`), and the copy verified against the version's
    content hash at every call, so that a copy changed since is never served. A ServingError names the version
    that carries no content hash or whose files were changed in the registry, and the folder and the files of a
    copy that differs, with how to recover."""
    name = f"covlab.{dataset}.{selector}"
    ref = store.version_for_alias(name, alias)
    if ref is None:
        raise ServingError(f"dataset: {name} has no version with alias {alias!r}; materialize {selector} (and "
                           "model_promotions for champion) on that dataset first")
    digest = ref.tags.get(CONTENT_HASH_TAG)
    if digest is None:
        raise ServingError(f"{name} v{ref.version} carries no content hash ({CONTENT_HASH_TAG}), so its files "
                           f"cannot be verified; materialize {selector} again to register a version that does")
    local = cache / name / f"v{ref.version}-{digest[:16]}"
    try:
        if not local.is_dir():
            store.download(ref, local)
        elif weights_change(local, digest):
            raise ServingError(f"{local}: the copy of {name} v{ref.version} is not the version registered: "
                               f"{', '.join(store.changed_files(ref, local))}; remove the folder to download it "
                               "again")
    except WeightsChanged as error:
        raise ServingError(f"{name} v{ref.version}: {error}") from None
    return ref, local
