"""Measures of a selection S against a query's viewpoints and gold evidence: RVC1 and RVC2 (METHODS.md §2
"Metrics"), IOU and redundancy (§3 "Metrics"), and the tokens a selection spends.

`covers_bool` is the (n_items, n_viewpoints) matrix M[d, v], boolean or 0/1; `selected` holds distinct
item indices (any order). A query without viewpoints has no RVC: the measures refuse it and callers skip it.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


def rvc1(covers_bool: np.ndarray, selected: np.ndarray) -> float:
    """RVC1 (METHODS.md §2): the fraction of viewpoints with at least one supporting selected item."""
    covers = viewpoint_matrix(covers_bool)
    chosen = selection(selected, len(covers))
    return float(covers[chosen].any(axis=0).mean())


def rvc2(covers_bool: np.ndarray, source_units: np.ndarray, selected: np.ndarray) -> float:
    """RVC2 (METHODS.md §2): each viewpoint scores 1/2 when exactly one distinct source unit among the selected
    items supports it and 1 when two or more do; the mean over viewpoints. Two selected items from the same
    source unit count once per viewpoint."""
    covers = viewpoint_matrix(covers_bool)
    units = unit_codes(source_units, len(covers))
    chosen = selection(selected, len(covers))
    support = np.zeros((units.max(initial=-1) + 1, covers.shape[1]), dtype=bool)  # unit u supports v
    np.logical_or.at(support, units[chosen], covers[chosen])
    return float((np.minimum(support.sum(axis=0), 2) / 2).mean())


def iou(selected_ids: Iterable, gold_ids: Iterable) -> float:
    """IOU (METHODS.md §3 "Metrics"): |S ∩ G| / |S ∪ G| over item ids against the gold evidence G. Undefined,
    and refused, when both are empty."""
    selected, gold = set(selected_ids), set(gold_ids)
    union = selected | gold
    if not union:
        raise ValueError("IOU is undefined with no selected and no gold ids; skip the query")
    return len(selected & gold) / len(union)


def redundancy(embeddings: np.ndarray, selected: np.ndarray) -> float:
    """Redundancy (METHODS.md §3 "Metrics"): the mean pairwise cosine over the pairs i < j inside S; 0 when
    S has fewer than two items."""
    embeddings = np.asarray(embeddings, dtype=float)
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings must be a 2-D (n_items, dim) matrix; got shape {embeddings.shape}")
    chosen = selection(selected, len(embeddings))
    if len(chosen) < 2:
        return 0.0
    rows = embeddings[chosen]
    norms = np.linalg.norm(rows, axis=1)
    if not (norms > 0).all():
        raise ValueError("redundancy needs non-zero embeddings for every selected item")
    rows = rows / norms[:, None]
    upper = np.triu_indices(len(rows), k=1)
    return float((rows @ rows.T)[upper].mean())


def tokens_used(tokens: np.ndarray, selected: np.ndarray) -> int:
    """The token cost of S: sum of t(d) over the selected items."""
    tokens = np.asarray(tokens)
    return int(tokens[selection(selected, len(tokens))].sum())


def viewpoint_matrix(covers_bool: np.ndarray) -> np.ndarray:
    """M[d, v] as a boolean (n_items, n_viewpoints) matrix; refuses other values and zero viewpoints."""
    covers = np.asarray(covers_bool)
    if covers.ndim != 2:
        raise ValueError(f"covers must be a 2-D (n_items, n_viewpoints) matrix; got shape {covers.shape}")
    if covers.dtype != bool and not np.isin(covers, (0, 1)).all():
        raise ValueError("covers must be boolean or 0/1; threshold probabilities first (covered iff p >= tau)")
    if covers.shape[1] == 0:
        raise ValueError("no viewpoints: RVC is undefined for this query; skip it")
    return covers.astype(bool)


def unit_codes(source_units: np.ndarray, n_items: int) -> np.ndarray:
    """Source-unit labels (any hashable values, one per item) as integer codes 0..n_units-1."""
    units = np.asarray(source_units)
    if units.shape != (n_items,):
        raise ValueError(f"source_units must hold one label per item ({n_items}); got shape {units.shape}")
    return np.unique(units, return_inverse=True)[1].reshape(n_items).astype(np.int64)


def selection(selected: np.ndarray, n_items: int) -> np.ndarray:
    """`selected` as an int array of distinct indices into n_items items."""
    chosen = np.asarray(selected)
    if chosen.size == 0:
        return np.zeros(0, dtype=np.int64)
    if chosen.ndim != 1 or not np.issubdtype(chosen.dtype, np.integer):
        raise ValueError(f"a selection must be a 1-D array of item indices; got {chosen!r}")
    if chosen.min() < 0 or chosen.max() >= n_items or len(np.unique(chosen)) != len(chosen):
        raise ValueError(f"a selection must hold distinct indices in [0, {n_items}); got {chosen.tolist()}")
    return chosen.astype(np.int64)
