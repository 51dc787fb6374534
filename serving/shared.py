"""The models a serving process loads once and shares, and the bounded memory of what they computed.

Every selector a process serves (`covlab serve`'s methods, the pyfuncs of one MLflow process, a notebook's
`load_selector` calls) reads its texts through the same base encoder and, for the methods on estimated coverage,
the same estimator version: `shared_encoder` and `served_models` hand out one loaded object per model (per
version content hash, for a trained selector, whichever verified folder holds its files: load_selector's copy or
the one MLflow made for a pyfunc) for as long as a selector holds it, instead of a copy per method. Each
remembers what it computed (a text's embedding, a (subquestion, passage) pair's estimated coverage) by a digest of
its texts, within a bound in bytes, so that a passage sent again (at another budget, to another method, by the
next request on a popular document) is not encoded or scored again, and a long-lived server's memory stays
bounded whatever it is sent. Values are returned exactly as first computed."""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from covlab.models.encoders import ENCODER_BATCH, ENCODER_MAX_LENGTH
from covlab.models.lru import BoundedLRU
from covlab.models.runtime import DEFAULT_RUNTIME, Runtime, check_runtime
from covlab.models.registry import Role, TrainedSelector

# Bytes of text embeddings an encoder keeps (~21,000 texts of a 384-wide float64 vector), and of estimated pair
# coverages an estimator keeps (~300,000 pairs).
EMBEDDING_CACHE_BYTES = 64 * 2**20
PAIR_CACHE_BYTES = 32 * 2**20
# What one cached entry holds besides its value: the digest key and the ordered dict's entry.
ENTRY_BYTES = 120


def text_digest(*texts: str) -> bytes:
    """A 16-byte digest of one text or of a tuple of texts (each length-prefixed, so that ("ab", "c") and
    ("a", "bc") differ): the key a cached value is kept by, in place of the texts themselves."""
    digest = hashlib.blake2b(digest_size=16)
    for text in texts:
        raw = text.encode("utf-8", "surrogatepass")
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)
    return digest.digest()


class _Memo:
    """Values computed by `compute(items)` (one value per item, in order) remembered by the digest of each item's
    texts within `max_bytes`: a call computes only the distinct items it has not seen, in one batch."""

    def __init__(self, compute: Callable[[list], Sequence], texts_of: Callable[[object], tuple[str, ...]],
                 max_bytes: int):
        self._compute, self._texts_of = compute, texts_of
        self._cache: BoundedLRU[bytes, object] = BoundedLRU(max_bytes)
        self._lock = threading.Lock()

    def values(self, items: Sequence) -> list:
        keys = [text_digest(*self._texts_of(item)) for item in items]
        with self._lock:
            found = {key: value for key in keys if (value := self._cache.get(key)) is not None}
        missing = {key: item for key, item in zip(keys, items) if key not in found}
        if missing:
            computed = self._compute(list(missing.values()))
            with self._lock:
                for key, value in zip(missing, computed, strict=True):
                    found[key] = value
                    self._cache.put(key, value, ENTRY_BYTES + getattr(value, "nbytes", 8))
        return [found[key] for key in keys]


class CachedTexts:
    """A texts -> vectors function (a loaded bi-encoder) that encodes each distinct text once while it is among
    those most recently seen within `max_bytes` (default EMBEDDING_CACHE_BYTES as it is when the copy is made)."""

    def __init__(self, encode: Callable[[list[str]], np.ndarray], max_bytes: int | None = None):
        self._memo = _Memo(lambda texts: list(np.asarray(encode(texts), dtype=float)), lambda text: (text,),
                           EMBEDDING_CACHE_BYTES if max_bytes is None else max_bytes)

    def __call__(self, texts: list[str]) -> np.ndarray:
        rows = self._memo.values(list(texts))
        return np.stack(rows) if rows else np.zeros((0, 0))


class CachedPairs:
    """A (subquestion, text) pairs -> coverage probabilities function (a loaded coverage estimator) that scores
    each distinct pair once while it is among those most recently seen within `max_bytes` (default
    PAIR_CACHE_BYTES as it is when the copy is made)."""

    def __init__(self, score: Callable[[list[tuple[str, str]]], np.ndarray], max_bytes: int | None = None):
        self._memo = _Memo(lambda pairs: np.asarray(score(pairs), dtype=float).tolist(), lambda pair: pair,
                           PAIR_CACHE_BYTES if max_bytes is None else max_bytes)

    def __call__(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        return np.asarray(self._memo.values(list(pairs)), dtype=float)


class Encoder:
    """A bi-encoder (models/biencoder.load_first_stage) loaded on first use, shared by threads (one lock), with
    its embeddings cached (CachedTexts); it reads the first `max_length` tokens of a text with its [CLS] and
    [SEP], `max_tokens` of the text itself, and runs on `runtime` (models/runtime.py: torch, or an ONNX export
    saved beside the model's weights)."""

    def __init__(self, model: str, device: str = "cpu", max_length: int = ENCODER_MAX_LENGTH,
                 runtime: Runtime = DEFAULT_RUNTIME):
        self.model, self.device, self.max_length, self.runtime = model, device, max_length, check_runtime(runtime)
        self.max_tokens = max_length - 2  # less the [CLS] and [SEP]
        self._encode: CachedTexts | None = None
        self._lock = threading.Lock()

    def __call__(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            if self._encode is None:
                import torch

                from covlab.models.biencoder import load_first_stage

                self._encode = CachedTexts(load_first_stage(self.model, batch_size=ENCODER_BATCH,
                                                            max_length=self.max_length,
                                                            device=torch.device(self.device),
                                                            runtime=self.runtime))
            return self._encode(texts)


# One loaded object per model for as long as any selector holds it (weak values: a version no selector serves
# any longer, e.g. after its alias moved, is freed with its cache).
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()
# How a trained selector's loaded object is shared, by its role: the estimator and the order encoder with their
# computations cached; the others (a ranker applied per request) as loaded, one per selector.
_CACHED_ROLES: Mapping[Role, Callable] = {Role.COVERAGE_ESTIMATOR: CachedPairs, Role.ORDER_ENCODER: CachedTexts}


def _shared(key: tuple, make: Callable[[], object]) -> object:
    with _SHARED_LOCK:
        found = _SHARED.get(key)
        if found is None:
            found = make()
            _SHARED[key] = found
        return found


def shared_encoder(model: str, device: str = "cpu", max_length: int = ENCODER_MAX_LENGTH,
                   runtime: Runtime = DEFAULT_RUNTIME) -> Encoder:
    """The process's Encoder of `model` on `device` reading `max_length` tokens, run by `runtime`."""
    return _shared(("encoder", model, device, max_length, runtime),
                   lambda: Encoder(model, device, max_length, runtime))


@dataclass(frozen=True)
class VersionFiles:
    """A trained selector version's files: the folder they were verified in and the content hash they have."""
    path: Path
    content_hash: str


def served_models(versions: Mapping[TrainedSelector, VersionFiles], device: str = "cpu") -> dict[Role, object]:
    """Each trained selector's loaded object by its Role, from its verified version files, loaded by its registry
    entry; the process's one copy of a cached role's (an estimator, an order encoder) per content hash."""
    loaded = {}
    for trained, files in versions.items():
        wrap = _CACHED_ROLES.get(trained.role)
        loaded[trained.role] = (trained.load(files.path, device) if wrap is None else
                                _shared(("trained", trained.asset, files.content_hash, device),
                                        lambda t=trained, f=files.path, w=wrap: w(t.load(f, device))))
    return loaded
