"""Context selection under a budget of k items or B tokens (METHODS.md §2 "Problem", "Baselines"; §3; §5),
behind one typed interface: every selector is a small frozen dataclass called as `selector(pool, budget)`.

Conventions shared by every selector here:
- a selection is an array of distinct indices into the pool, in selection order, whose cost never exceeds
  the budget (k items, or B tokens summed over `Pool.tokens`);
- "fits" means the item's cost in budget units (1 per item under a k budget, its tokens under a token
  budget) still fits what is left of the budget; an item that does not fit is skipped, not a reason to stop;
- greedy selectors evaluate their candidates in relevance order, so ties go to the more relevant item, then
  to the lower index (as in models/selection.py);
- similarities are dot products of L2-normalised embeddings (cosines); MMR and AdaGReS keep one similarity
  row per selected item and update their penalties from it; nothing pool x pool is precomputed except the
  facility-location similarity matrix, which is that method's definition.

`select_batch(selector, pools, budget)` returns exactly `[selector(pool, budget) for pool in pools]`.
CoverageGreedy and FacilityLocation have a batched path (`_select_batch`; a single pool is a batch of one,
run by `_budgeted_greedy`): several pools run the greedy loop in lockstep (`_greedy_batch`, which steps each
row as `_budgeted_greedy` steps a pool), so each step's fitting, masking, scoring and argmax are one array
operation for the whole batch, every score coming out bit for bit as for the pool alone. CoverageGreedy scores
the batch with one padded pools x items x viewpoints coverage array and the function that scores one pool
(`_expected_new`). Facility location's gains are column sums of each pool's own similarity matrix, which
numpy adds pairwise in groups set by the column's length, so those stay one matrix per pool, in lockstep
groups of at most LOCKSTEP_BYTES (`_in_groups`). MMR and AdaGReS run pool by pool: their step work is one
similarity row per pool (a matrix-vector product over the pool's embeddings), and BLAS results depend on the
operands' shapes, so stacked or padded rows would change the last bits, and with them near-tied choices;
with one product per pool and step, a lockstep saved at most 7% of CPU time on ArgKP-shaped batches (the
rows leave the cache between steps) and cost a single pool 10-15%.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, runtime_checkable

import numpy as np

# How far an embedding row's norm may stray from 1 and still count as L2-normalised (float32 encoders).
NORM_TOLERANCE = 1e-4
# adaptive_beta's fallback (METHODS.md §3, official code), and how close to 0 a mean pairwise similarity
# must be to count as 0 there.
ADAPTIVE_BETA_FALLBACK = 0.01
ZERO_SIMILARITY = 1e-12
# How much pool data (similarity matrix and gain terms) one lockstep group of facility location holds
# (`_in_groups`): a bound on the batch's memory, and a group that stays in a core's cache between steps runs
# faster (CPU time on 62 random pools of ArgKP's shape, 117 x 384, B = 1,024 tokens: 1 MiB 13% below 0.5 MiB
# and 4% below a single group).
LOCKSTEP_BYTES = 1 << 20


@dataclass(frozen=True)
class Budget:
    """A selection budget: exactly one of `k` (items) or `tokens` (B, summed token cost), METHODS.md §2."""
    k: int | None = None
    tokens: int | None = None

    def __post_init__(self):
        if (self.k is None) == (self.tokens is None):
            raise ValueError(f"a Budget is either k items or B tokens, exactly one; got k={self.k!r}, "
                             f"tokens={self.tokens!r}")
        value = self.limit
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"a Budget's {'k' if self.k is not None else 'tokens'} must be a non-negative "
                             f"integer; got {value!r}")

    @property
    def limit(self) -> int:
        """The budget in its own unit: items for a k budget, tokens for a token budget."""
        return self.k if self.k is not None else self.tokens

    def costs(self, tokens: np.ndarray) -> np.ndarray:
        """Each item's cost in budget units: 1 per item under a k budget, its tokens under a token budget."""
        tokens = np.asarray(tokens)
        return np.ones(len(tokens), dtype=np.int64) if self.k is not None else tokens.astype(np.int64)

    def fits(self, costs_so_far, cost):
        """Whether an item of `cost` (budget units; scalar or array) can join a selection that already
        spends `costs_so_far` without exceeding the budget."""
        return np.asarray(costs_so_far) + np.asarray(cost) <= self.limit


@dataclass(frozen=True, eq=False)
class Pool:
    """One query's candidates, read-only.

    - embeddings: (n, d), L2-normalised rows (validated);
    - query: (d,), any non-zero vector (cosines use its normalised direction);
    - tokens: (n,) positive integer token costs t(d);
    - relevance: (n,) relevance scores; default the cosine of each item to the query;
    - covers: optional (n, V) matrix M[d, v] of coverage probabilities or 0/1, for the coverage selectors;
    - source_units: optional (n,) labels of the source unit each item comes from (RVC2, METHODS.md §2);
    - atoms, atom_items: optional (m, d) L2-normalised embeddings of the items' sentence-level atoms and the
      item index each belongs to (LMVU's atomic-state features, METHODS.md §2); without them every item is
      its own single atom. Every item has at least one atom.
    """
    embeddings: np.ndarray
    query: np.ndarray
    tokens: np.ndarray
    relevance: np.ndarray | None = None
    covers: np.ndarray | None = None
    source_units: np.ndarray | None = None
    atoms: np.ndarray | None = None
    atom_items: np.ndarray | None = None

    def __post_init__(self):
        embeddings = np.asarray(self.embeddings, dtype=float)
        if embeddings.ndim != 2:
            raise ValueError(f"embeddings must be a 2-D (n_items, dim) matrix; got shape {embeddings.shape}")
        n, dim = embeddings.shape
        if not np.isfinite(embeddings).all():
            raise ValueError("embeddings must be finite")
        norms = np.linalg.norm(embeddings, axis=1)
        off = np.flatnonzero(np.abs(norms - 1) > NORM_TOLERANCE)
        if len(off):
            raise ValueError(f"embeddings must have L2-normalised rows; row {off[0]} has norm {norms[off[0]]:.6f}")
        query = np.asarray(self.query, dtype=float)
        if query.shape != (dim,) or not np.isfinite(query).all() or not np.linalg.norm(query) > 0:
            raise ValueError(f"query must be a finite non-zero vector of dimension {dim}; got shape {query.shape}")
        tokens = np.asarray(self.tokens)
        if tokens.shape != (n,) or (n and (not np.issubdtype(tokens.dtype, np.integer) or tokens.min() < 1)):
            raise ValueError(f"tokens must be {n} positive integers (one per item); got shape {tokens.shape}, "
                             f"dtype {tokens.dtype}")
        object.__setattr__(self, "embeddings", _read_only(embeddings))
        object.__setattr__(self, "query", _read_only(query))
        object.__setattr__(self, "tokens", _read_only(tokens.astype(np.int64)))
        if self.relevance is None:
            relevance = self.query_similarity
        else:
            relevance = np.asarray(self.relevance, dtype=float)
            if relevance.shape != (n,) or not np.isfinite(relevance).all():
                raise ValueError(f"relevance must be {n} finite scores; got shape {relevance.shape}")
        object.__setattr__(self, "relevance", _read_only(relevance))
        if self.covers is not None:
            covers = np.asarray(self.covers, dtype=float)
            if covers.ndim != 2 or covers.shape[0] != n:
                raise ValueError(f"covers must be an (n_items={n}, n_viewpoints) matrix; got shape {covers.shape}")
            if not ((covers >= 0) & (covers <= 1)).all():
                raise ValueError("covers must hold probabilities in [0, 1] or 0/1")
            object.__setattr__(self, "covers", _read_only(covers))
        if self.source_units is not None:
            units = np.asarray(self.source_units)
            if units.shape != (n,):
                raise ValueError(f"source_units must hold one label per item ({n}); got shape {units.shape}")
            object.__setattr__(self, "source_units", _read_only(units))
        if (self.atoms is None) != (self.atom_items is None):
            raise ValueError("atoms and atom_items go together: give both or neither")
        if self.atoms is None:
            atoms, items = self.embeddings, np.arange(n)
        else:
            atoms, items = np.asarray(self.atoms, dtype=float), np.asarray(self.atom_items)
            if atoms.ndim != 2 or atoms.shape[1] != dim or items.shape != (len(atoms),):
                raise ValueError(f"atoms must be an (m, {dim}) matrix with one atom_items entry per row; got "
                                 f"shapes {atoms.shape} and {items.shape}")
            if not np.issubdtype(items.dtype, np.integer) or not np.array_equal(np.unique(items), np.arange(n)):
                raise ValueError(f"atom_items must be item indices in [0, {n}) naming every item at least once")
            norms = np.linalg.norm(atoms, axis=1)
            if not np.isfinite(atoms).all() or (np.abs(norms - 1) > NORM_TOLERANCE).any():
                raise ValueError("atoms must be finite with L2-normalised rows")
        object.__setattr__(self, "atoms", _read_only(atoms))
        object.__setattr__(self, "atom_items", _read_only(items.astype(np.int64)))

    @property
    def size(self) -> int:
        return len(self.tokens)

    @cached_property
    def query_similarity(self) -> np.ndarray:
        """sim(q, d): the cosine of every item to the query (METHODS.md §3: dot products of unit vectors)."""
        return _read_only(self.embeddings @ (self.query / np.linalg.norm(self.query)))


@runtime_checkable
class Selector(Protocol):
    """The one selector signature: distinct pool indices in selection order, within `budget`."""
    name: str

    def __call__(self, pool: Pool, budget: Budget) -> np.ndarray: ...


@dataclass(frozen=True)
class RelevanceOrder:
    """Relevance order under a budget (METHODS.md §2 "Baselines"): walk the items by relevance (higher
    first, then lower index), add each one that still fits, skip the ones that do not."""

    @property
    def name(self) -> str:
        return "relevance"

    def __call__(self, pool: Pool, budget: Budget) -> np.ndarray:
        costs = budget.costs(pool.tokens)
        return _fill(_relevance_order(pool), costs, budget, used=0, chosen=[])


@dataclass(frozen=True)
class MMR:
    """Maximal marginal relevance (Carbonell & Goldstein 1998, METHODS.md §5; §2 baseline, lambda default 0.5):
    each step, among the items that fit, argmax lam * sim(d, q) - (1 - lam) * max_{s in S} sim(d, s), the
    penalty being 0 while S is empty. sim(d, q) is the pool's relevance (the cosine to the query unless the
    pool carries another score), so lam = 1 is exactly `RelevanceOrder`. Stops when nothing fits."""
    lam: float = 0.5

    def __post_init__(self):
        if not 0 <= self.lam <= 1:
            raise ValueError(f"MMR lam must lie in [0, 1]; got {self.lam!r}")

    @property
    def name(self) -> str:
        return f"mmr_{self.lam:g}"

    def __call__(self, pool: Pool, budget: Budget) -> np.ndarray:
        order = _relevance_order(pool)
        embeddings, costs = pool.embeddings[order], budget.costs(pool.tokens)[order]
        relevance = self.lam * pool.relevance[order]
        max_similarity = np.full(len(order), -np.inf)  # max_{s in S} sim(d, s), updated one row at a time
        penalty = np.zeros(len(order))  # (1 - lam) * max_similarity, 0 while S is empty

        def add(best: int) -> None:
            np.maximum(max_similarity, embeddings @ embeddings[best], out=max_similarity)
            np.multiply(1 - self.lam, max_similarity, out=penalty)

        chosen, _ = _budgeted_greedy(costs, budget, lambda: relevance - penalty, add)
        return order[chosen]


@dataclass(frozen=True)
class FacilityLocation:
    """Facility location (Lin & Bilmes 2011, METHODS.md §5; §2 baseline): f(S) = sum_i max_{j in S} s_ij with
    s_ij = max(cos(d_i, d_j), 0) over the whole pool. Budgeted cost-scaled greedy: each step, among the items
    that fit, argmax of the marginal gain divided by the item's cost in budget units, until nothing fits;
    then the better of that set and the best single feasible item (the set wins ties)."""

    @property
    def name(self) -> str:
        return "facloc"

    def __call__(self, pool: Pool, budget: Budget) -> np.ndarray:
        return self._select_batch([pool], budget)[0]

    def _select_batch(self, pools: Sequence[Pool], budget: Budget) -> list[np.ndarray]:
        return _in_groups(pools, _similarity_bytes, lambda group: self._lockstep(group, budget))

    def _lockstep(self, pools: Sequence[Pool], budget: Budget) -> list[np.ndarray]:
        """The greedy for a batch of pools (`_greedy_batch`), then each pool's best single item. Each pool keeps
        its own similarity matrix, stored by columns: a gain is a sum over the pool's items, which numpy adds
        pairwise along a contiguous row, grouped by the row's length, so rows of different pools are neither
        stacked nor padded (that would change the last bits, and with them near-tied choices)."""
        batch = _Batch(pools, budget)
        columns = []  # s_ij with one row per j: the pool's column j, contiguous
        for pool, order in zip(pools, batch.orders):
            embeddings = pool.embeddings[order]
            columns.append(np.ascontiguousarray(np.maximum(embeddings @ embeddings.T, 0.0).T))
        best_cover = [np.zeros(size) for size in batch.sizes]  # max_{j in S} s_ij for every i (0 for the empty set)
        excess = [np.empty_like(column) for column in columns]  # max(s_ij - best_cover_i, 0)
        gains = np.zeros(batch.shape)
        value = np.zeros(len(pools))
        costs = np.where(batch.available(), batch.costs, 1)  # padding costs 1: never divided by 0

        def scores(going: np.ndarray) -> np.ndarray:
            for row in going.tolist():
                np.subtract(columns[row], best_cover[row], out=excess[row])
                np.maximum(excess[row], 0.0, out=excess[row])
                excess[row].sum(axis=1, out=gains[row, :batch.sizes[row]])
            return gains / costs

        def add(going: np.ndarray, best: np.ndarray) -> None:
            value[going] += gains[going, best]
            for row, item in zip(going.tolist(), best.tolist()):
                np.maximum(best_cover[row], columns[row][item], out=best_cover[row])

        chosen = _greedy_rows(batch, budget, scores, add)
        for row, (size, column) in enumerate(zip(batch.sizes, columns)):
            feasible = np.flatnonzero(budget.fits(0, batch.costs[row, :size]))
            if len(feasible):
                singles = column[feasible].sum(axis=1)  # f({j})
                single = int(np.argmax(singles))
                if singles[single] > value[row]:
                    chosen[row] = [int(feasible[single])]
        return batch.selections(chosen)


def adaptive_beta(pool: Pool, budget: Budget, alpha: float = 1.0) -> float:
    """AdaGReS's closed-form redundancy weight (METHODS.md §3, official code):
    beta* = alpha * mean_qc / (((k_bar - 1) / 2) * mean_cc), with
    k_bar = max(1, floor(B / mean item tokens)) under a token budget (lengths in tokens, the unit of B) and
    k_bar = k under a k budget, mean_qc the mean sim(q, c) over the pool and mean_cc the mean pairwise
    sim(c_i, c_j) over the pool (i < j). When mean_cc is 0 (within 1e-12, or undefined for fewer than two
    items) or k_bar <= 1, beta = 0.01.

    The pairwise mean uses sum_{i<j} e_i . e_j = (|sum_i e_i|^2 - sum_i |e_i|^2) / 2, so no n x n matrix."""
    n = pool.size
    if n < 2:
        return ADAPTIVE_BETA_FALLBACK
    k_bar = budget.k if budget.k is not None else max(1, math.floor(budget.tokens / pool.tokens.mean()))
    total = pool.embeddings.sum(axis=0)
    pair_sum = (total @ total - np.einsum("ij,ij->", pool.embeddings, pool.embeddings)) / 2
    mean_cc = pair_sum / (n * (n - 1) / 2)
    if abs(mean_cc) <= ZERO_SIMILARITY or k_bar <= 1:
        return ADAPTIVE_BETA_FALLBACK
    mean_qc = float(pool.query_similarity.mean())
    return float(alpha * mean_qc / (((k_bar - 1) / 2) * mean_cc))


@dataclass(frozen=True)
class AdaGReS:
    """AdaGReS (METHODS.md §3): each step, among the items that fit, argmax of the marginal gain
    alpha * sim(q, x) - beta * sum_{s in S} sim(x, s), sim being the cosine; stops when nothing fits, or
    [chosen, off by default] when `stop_on_nonpositive_gain` and the best gain is <= 0.
    beta None means the adaptive beta* of `adaptive_beta`, computed per pool and budget."""
    alpha: float = 1.0
    beta: float | None = None
    stop_on_nonpositive_gain: bool = False

    @property
    def name(self) -> str:
        return "adagres" if self.beta is None else f"adagres_beta{self.beta:g}"

    def __call__(self, pool: Pool, budget: Budget) -> np.ndarray:
        beta = adaptive_beta(pool, budget, self.alpha) if self.beta is None else self.beta
        order = _relevance_order(pool)
        embeddings, costs = pool.embeddings[order], budget.costs(pool.tokens)[order]
        relevance = self.alpha * pool.query_similarity[order]
        redundancy = np.zeros(len(order))  # sum_{s in S} sim(x, s), one row added per selected item

        def add(best: int) -> None:
            np.add(redundancy, embeddings @ embeddings[best], out=redundancy)

        chosen, _ = _budgeted_greedy(costs, budget, lambda: relevance - beta * redundancy, add,
                                     stop_at_nonpositive=self.stop_on_nonpositive_gain)
        return order[chosen]


@dataclass(frozen=True)
class CoverageGreedy:
    """Budget-aware greedy coverage (METHODS.md §1 greedy and its soft extension, §2 "Problem"): each step,
    among the items that fit, argmax of the marginal coverage gain per unit of budget (per token under a
    token budget, per item under a k budget, where it is exactly models/selection.py's greedy), ties by
    relevance. soft: the expected number of newly covered viewpoints, sum_v p_dv * prod_{s in S} (1 - p_sv),
    over the pool's `covers` probabilities; hard: the number of newly covered viewpoints with covered iff
    p >= tau. Once no fitting item adds coverage, the rest is filled in relevance order while items fit
    (those that do not fit are skipped)."""
    soft: bool
    tau: float = 0.3

    def __post_init__(self):
        if not 0 < self.tau <= 1:
            raise ValueError(f"CoverageGreedy tau must lie in (0, 1]; got {self.tau!r}")

    @property
    def name(self) -> str:
        return "coverage_soft" if self.soft else f"coverage_hard_tau{self.tau:g}"

    def __call__(self, pool: Pool, budget: Budget) -> np.ndarray:
        return self._select_batch([pool], budget)[0]

    def _select_batch(self, pools: Sequence[Pool], budget: Budget) -> list[np.ndarray]:
        for pool in pools:
            if pool.covers is None:
                raise ValueError(f"{self.name} needs the pool's covers matrix M[d, v]; the pool has none")
        batch = _Batch(pools, budget)
        own = [pool.covers[order] if self.soft else (pool.covers[order] >= self.tau).astype(float)
               for pool, order in zip(pools, batch.orders)]  # each pool's M[d, v] in relevance order
        available = batch.available()
        if len(pools) == 1:
            covers, costs = own[0], batch.costs[0]
            uncovered = np.ones(covers.shape[1])  # prod_{s in S} (1 - p_sv): probability v is still open

            def add_one(best: int) -> None:
                available[0, best] = False
                _close(uncovered, covers[best])

            picked, spent = _budgeted_greedy(costs, budget, lambda: _expected_new(covers, uncovered) / costs,
                                             add_one, stop_at_nonpositive=True)
            chosen, used = [picked.tolist()], [spent]
        else:
            chosen, used = self._lockstep(batch, own, available)
        # Then the relevance-order fill over the items not chosen (`available` is now exactly those).
        return batch.selections([_fill(np.flatnonzero(available[row, :size]), batch.costs[row, :size], budget,
                                       spent, picked)
                                 for row, (size, picked, spent) in enumerate(zip(batch.sizes, chosen, used))])

    def _lockstep(self, batch: _Batch, own: list[np.ndarray], available: np.ndarray):
        """The greedy part for several pools at once (`_greedy_batch`), scored by `_expected_new` as one pool
        alone is. With 0/1 coverage (always when hard) every product and sum in a gain is an exact small
        integer, so one stacked product over the padded (n_pools, n_items, n_viewpoints) matrix gives each
        pool's own matrix-vector product bit for bit; probabilities keep one product per pool, on its own
        array, as when it is alone."""
        covers = np.zeros(batch.shape + (max(matrix.shape[1] for matrix in own),))  # 0 beyond items, viewpoints
        for row, matrix in enumerate(own):
            covers[row, :len(matrix), :matrix.shape[1]] = matrix
        costs = np.where(available, batch.costs, 1)  # padding costs 1: never divided by 0
        if not self.soft or ((covers == 0) | (covers == 1)).all():
            uncovered = np.ones((len(own), covers.shape[2]))  # a padding viewpoint stays open, adds 0 to gains

            def scores(rows: np.ndarray) -> np.ndarray:
                return _expected_new(covers, uncovered) / costs

            def add(rows: np.ndarray, best: np.ndarray) -> None:
                uncovered[rows] = _close(uncovered[rows], covers[rows, best])
        else:
            open_ = [np.ones(matrix.shape[1]) for matrix in own]
            gains = np.zeros(batch.shape)  # the rows of the pools still going

            def scores(rows: np.ndarray) -> np.ndarray:
                for row in rows.tolist():
                    gains[row, :len(own[row])] = _expected_new(own[row], open_[row])
                return gains / costs

            def add(rows: np.ndarray, best: np.ndarray) -> None:
                for row, item in zip(rows.tolist(), best.tolist()):
                    _close(open_[row], own[row][item])

        chosen, used = _greedy_batch(batch.costs, batch.limits, available, scores, add, stop_at_nonpositive=True)
        return chosen, used.tolist()


def _expected_new(covers: np.ndarray, uncovered: np.ndarray) -> np.ndarray:
    """CoverageGreedy's gain before division by cost: sum_v p_dv * uncovered_v for every item d, the expected
    number of viewpoints d newly covers (an (n_items, V) matrix and (V,) vector: one pool; (n_pools, n_items, V)
    and (n_pools, V): a batch)."""
    if covers.ndim == 2:
        return covers @ uncovered
    return np.matmul(covers, uncovered[:, :, None])[:, :, 0]


def _close(uncovered: np.ndarray, covered: np.ndarray) -> np.ndarray:
    """CoverageGreedy's state after adding an item: uncovered_v *= 1 - p_dv (in place, and returned)."""
    return np.multiply(uncovered, 1.0 - covered, out=uncovered)


# The default line-up: relevance, MMR (lambda 0.5), FacLoc, AdaGReS (adaptive beta), coverage greedy soft/hard.
SELECTORS: tuple[Selector, ...] = (RelevanceOrder(), MMR(0.5), FacilityLocation(), AdaGReS(),
                                   CoverageGreedy(soft=True), CoverageGreedy(soft=False))


def select_batch(selector: Selector, pools: Sequence[Pool], budget: Budget) -> list[np.ndarray]:
    """Exactly `[selector(pool, budget) for pool in pools]`, computed for the whole batch at once by the
    selectors that have a batched path (`_select_batch`: FacilityLocation, CoverageGreedy; module docstring);
    any other selector is called pool by pool."""
    pools = list(pools)
    batched = getattr(selector, "_select_batch", None)
    if batched is None or not pools:
        return [selector(pool, budget) for pool in pools]
    return batched(pools, budget)


def _relevance_order(pool: Pool) -> np.ndarray:
    """Pool indices by relevance, higher first, ties by lower index."""
    return np.argsort(-pool.relevance, kind="stable")


def _budgeted_greedy(costs: np.ndarray, budget: Budget, scores: Callable[[], np.ndarray],
                     add: Callable[[int], None], stop_at_nonpositive: bool = False) -> tuple[np.ndarray, int]:
    """The greedy loop MMR, AdaGReS and CoverageGreedy share (METHODS.md §2 "Allocation"): each step, among
    the items not yet chosen whose cost still fits the budget, take the argmax of `scores()` (one score per
    item; ties to the lower index, the more relevant item since callers index in relevance order), then
    `add(best)` updates the caller's state for the next step's scores. Stops when nothing fits, or, with
    `stop_at_nonpositive`, before taking an item whose score is <= 0.
    Returns the chosen indices in selection order and the budget units they spend."""
    costs = np.asarray(costs)
    step_costs = costs.tolist()
    chosen: list[int] = []
    used = 0
    available = np.ones(len(costs), dtype=bool)
    candidates = np.empty(len(costs), dtype=bool)
    limit, integer = _limit(budget), np.issubdtype(costs.dtype, np.integer)
    while True:
        _fitting(costs, limit, used, integer, out=candidates)
        np.logical_and(candidates, available, out=candidates)
        if not candidates.any():
            break
        masked = np.where(candidates, scores(), -np.inf)
        best = int(masked.argmax())
        if stop_at_nonpositive and masked[best] <= 0:
            break
        chosen.append(best)
        available[best] = False
        used += step_costs[best]
        add(best)
    return np.asarray(chosen, dtype=np.int64), used


def _greedy_batch(costs: np.ndarray, limits: np.ndarray, available: np.ndarray,
                  scores: Callable[[np.ndarray], np.ndarray], add: Callable[[np.ndarray, np.ndarray], None],
                  stop_at_nonpositive: bool = False) -> tuple[list[list[int]], np.ndarray]:
    """`_budgeted_greedy` for a batch of pools in lockstep, one pool per row of the (n_pools, n_items) arrays
    (rows padded to the largest pool; `available` False on the padding, and updated in place): each step,
    every pool still going takes the argmax of its row of `scores(rows)` among its available items whose
    cost still fits its limit (ties to the lower index), then `add(rows, best)` updates the callers' state
    for the pools in `rows` (their step's items `best`). `scores(rows)` returns (n_pools, n_items) scores of
    which only the rows listed, the pools still going, are read. A pool stops when nothing fits, or, with
    `stop_at_nonpositive`, before taking an item whose score is <= 0; a stopped pool's state is never read
    again. Returns each pool's chosen indices in selection order and the budget units each spends (one row of
    a batch goes exactly as `_budgeted_greedy` goes on it alone: tests/test_budgeted.py)."""
    n_pools = len(costs)
    used = np.zeros(n_pools, dtype=np.result_type(costs.dtype, np.int64))
    chosen: list[list[int]] = [[] for _ in range(n_pools)]
    going = np.ones(n_pools, dtype=bool)
    every = np.arange(n_pools)
    candidates = np.empty(costs.shape, dtype=bool)
    limits, integer = limits[:, None], np.issubdtype(costs.dtype, np.integer)
    while True:
        _fitting(costs, limits, used[:, None], integer, out=candidates)
        np.logical_and(candidates, available, out=candidates)
        going &= candidates.any(axis=1)
        rows = going.nonzero()[0]
        if not len(rows):
            break
        masked = np.where(candidates, scores(rows), -np.inf)
        best = masked.argmax(axis=1)
        if stop_at_nonpositive:
            going &= ~(masked[every, best] <= 0)
            rows = going.nonzero()[0]
            if not len(rows):
                break
        best = best[rows]
        for row, item in zip(rows.tolist(), best.tolist()):
            chosen[row].append(item)
        available[rows, best] = False
        used[rows] += costs[rows, best]
        add(rows, best)
    return chosen, used


def _greedy_rows(batch: _Batch, budget: Budget, scores: Callable[[np.ndarray], np.ndarray],
                 add: Callable[[np.ndarray, np.ndarray], None], stop_at_nonpositive: bool = False) -> list[list[int]]:
    """Each pool's greedy choices (positions in relevance order), with `scores` and `add` as `_greedy_batch`
    takes them: several pools in lockstep, and one pool, as row 0 of a batch of one, through `_budgeted_greedy`
    (the same steps without the lockstep's row bookkeeping, which costs a single pool more than it saves)."""
    if len(batch.sizes) != 1:
        return _greedy_batch(batch.costs, batch.limits, batch.available(), scores, add, stop_at_nonpositive)[0]
    going, best = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)  # a batch of one has no padding

    def add_one(item: int) -> None:
        best[0] = item
        add(going, best)

    chosen, _ = _budgeted_greedy(batch.costs[0], budget, lambda: scores(going)[0], add_one, stop_at_nonpositive)
    return [chosen.tolist()]


def _fitting(costs: np.ndarray, limit, used, integer: bool, out: np.ndarray) -> np.ndarray:
    """Budget.fits(used, costs) into `out`: used + cost <= limit. Integer costs compare against limit - used
    instead, the same test without overflow (used <= limit), one array operation fewer."""
    if integer:
        return np.less_equal(costs, np.subtract(limit, used), out=out)
    return np.less_equal(np.add(costs, used), limit, out=out)


def _limit(budget: Budget) -> int:
    """The budget's limit as an int64 (a larger limit than int64 holds lets everything fit, as this does)."""
    return min(budget.limit, np.iinfo(np.int64).max)


class _Batch:
    """A batch of pools in relevance order, padded to the largest: `orders` (each pool's `_relevance_order`),
    `sizes`, `shape` (n_pools, n_items), `costs` (budget units, 0 on the padding) and `limits`."""

    def __init__(self, pools: Sequence[Pool], budget: Budget):
        self.orders = [_relevance_order(pool) for pool in pools]
        self.sizes = [len(order) for order in self.orders]
        self.shape = (len(self.orders), max(self.sizes, default=0))
        self.costs = self.pad([budget.costs(pool.tokens) for pool in pools], dtype=np.int64)
        self.limits = np.full(len(self.orders), _limit(budget), dtype=np.int64)

    def pad(self, values: Sequence[np.ndarray], dtype=float) -> np.ndarray:
        """Per-pool item values (pool order) as one (n_pools, n_items) matrix in relevance order, 0 padded."""
        padded = np.zeros(self.shape, dtype=dtype)
        for row, (value, order) in enumerate(zip(values, self.orders)):
            padded[row, :len(order)] = value[order]
        return padded

    def available(self) -> np.ndarray:
        """True on every pool's items, False on the padding (a fresh array: `_greedy_batch` updates it)."""
        return np.arange(self.shape[1])[None, :] < np.asarray(self.sizes, dtype=np.int64)[:, None]

    def selections(self, chosen: Sequence) -> list[np.ndarray]:
        """Positions in relevance order, per pool, as pool indices."""
        return [order[np.asarray(picked, dtype=np.int64)] for order, picked in zip(self.orders, chosen)]


def _in_groups(pools: Sequence[Pool], size: Callable[[Pool], int],
               run: Callable[[list[Pool]], list[np.ndarray]]) -> list[np.ndarray]:
    """`run` over consecutive groups of the pools, each group's `size` (bytes) summing to at most
    LOCKSTEP_BYTES (or a single pool), the selections concatenated in pool order."""
    selections: list[np.ndarray] = []
    group: list[Pool] = []
    total = 0
    for pool in pools:
        if group and total + size(pool) > LOCKSTEP_BYTES:
            selections += run(group)
            group, total = [], 0
        group.append(pool)
        total += size(pool)
    return selections + (run(group) if group else [])


def _similarity_bytes(pool: Pool) -> int:
    """What facility location's lockstep holds per pool: its similarity matrix and the step's gain terms."""
    return 2 * pool.size * pool.size * 8


def _fill(walk: np.ndarray, costs: np.ndarray, budget: Budget, used: int, chosen: list[int]) -> np.ndarray:
    """`chosen` extended by the items of `walk`, in that order, that still fit; `costs` indexed like `walk`'s
    entries. (A plain loop over Python numbers: the same sums and comparisons as `Budget.fits`, without an
    array operation per item, which on ~100-item walks is faster than any vectorised form.)"""
    chosen = list(chosen)
    walk = np.asarray(walk, dtype=np.int64)
    limit = budget.limit
    for item, cost in zip(walk.tolist(), np.asarray(costs)[walk].tolist()):
        if used + cost <= limit:
            chosen.append(item)
            used += cost
    return np.asarray(chosen, dtype=np.int64)


def _read_only(array: np.ndarray) -> np.ndarray:
    array = np.array(array)  # a private copy, so the caller's array stays writable and unaliased
    array.setflags(write=False)
    return array
