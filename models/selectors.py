"""Context selection under a budget of k items or B tokens (METHODS.md §1 greedy, §2 "Problem",
"Allocation", "Baselines", §3, §5), behind one typed interface: every selector is a small frozen dataclass
called as `selector(pool, budget) -> Selection`, for k and token budgets alike.

Conventions shared by every selector here:
- a `Selection` holds distinct indices into the pool, in selection order, whose cost never exceeds the
  budget (k items, or B tokens summed over `Pool.tokens`), with each item's score at the step it was
  chosen (`gains`; NaN for an item added by a fill, which has no score);
- "fits" means the item's cost in budget units (1 per item under a k budget, its tokens under a token
  budget) still fits what is left of the budget; an item that does not fit is skipped, not a reason to stop;
- every greedy selector walks its candidates in relevance order (`relevance_order`: `Pool.relevance`,
  higher first, then lower index), so ties go to the more relevant item, and runs the one greedy loop of the
  package (`greedy`): each step the argmax of its scores among the items that fit, then its state update;
- similarities are dot products of L2-normalised embeddings (cosines); MMR and AdaGReS keep one similarity
  row per selected item and update their penalties from it; nothing pool x pool is precomputed except the
  facility-location similarity matrix, which is that method's definition.

A greedy selector exposes its steps (`steps(pool, budget) -> GreedySteps`: the walk, the costs, the score
and update functions, its stopping rule), so that `Blend` can wrap any of them: the blend with the fallback
order that keeps a selection on an uninformative estimate near relevance order (METHODS.md §1 [chosen]).

`select_batch(selector, pools, budget)` returns exactly `[selector(pool, budget) for pool in pools]`.
CoverageGreedy and FacilityLocation have a batched path (`select_batch`'s `_select_batch`): several pools run
the greedy loop in lockstep (`_greedy_lockstep`, which steps each row as `greedy` steps a pool), so each
step's fitting, masking, scoring and argmax are one array operation for the whole batch, every score coming
out bit for bit as for the pool alone. CoverageGreedy scores the batch with one padded pools x items x
viewpoints coverage array and the function that scores one pool (`_expected_new`). Facility location's gains
are column sums of each pool's own similarity matrix, which numpy adds pairwise in groups set by the column's
length, so those stay one matrix per pool, in lockstep groups of at most LOCKSTEP_BYTES (`_in_groups`). MMR
and AdaGReS run pool by pool: their step work is one similarity row per pool, and BLAS results depend on the
operands' shapes, so stacked or padded rows would change the last bits, and with them near-tied choices
(bench/selection.py measures both paths).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Protocol, runtime_checkable

import numpy as np

from covlab.models.oracles import rvc1_oracle, rvc2_oracle

# How far an embedding row's norm may stray from 1 and still count as L2-normalised (float32 encoders).
NORM_TOLERANCE = 1e-4
# adaptive_beta's fallback (METHODS.md §3, official code), and how close to 0 a mean pairwise similarity
# must be to count as 0 there.
ADAPTIVE_BETA_FALLBACK = 0.01
ZERO_SIMILARITY = 1e-12
# How much pool data (similarity matrix and gain terms) one lockstep group of facility location holds
# (`_in_groups`): a bound on the batch's memory, and a group that stays in a core's cache between steps runs
# faster (bench/selection.py).
LOCKSTEP_BYTES = 1 << 20


def check_budget_value(value, unit: str) -> int:
    """A budget's limit as given in config or code: a non-negative integer (a bool is not one); else a
    ValueError naming `unit` ("k" or "tokens") and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"a Budget's {unit} must be a non-negative integer; got {value!r}")
    return int(value)


def check_token_budgets(budgets) -> list[int]:
    """Token budgets as given in config: positive integers that an int64 holds (selections store them so);
    else a ValueError naming the first that is not."""
    bad = [b for b in budgets if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 1 <= b < 2 ** 63]
    if bad:
        raise ValueError(f"token budgets must be positive integers below 2**63 (stored as int64); got {bad}")
    return list(budgets)


# The units a Budget is given in (`Budget.unit`): items or summed token costs.
BUDGET_UNITS = ("k", "tokens")


@dataclass(frozen=True)
class Budget:
    """A selection budget: exactly one of `k` (items) or `tokens` (B, summed token cost), METHODS.md §2."""
    k: int | None = None
    tokens: int | None = None

    def __post_init__(self):
        if (self.k is None) == (self.tokens is None):
            raise ValueError(f"a Budget is either k items or B tokens, exactly one; got k={self.k!r}, "
                             f"tokens={self.tokens!r}")
        check_budget_value(self.limit, self.unit)

    @property
    def limit(self) -> int:
        """The budget in its own unit: items for a k budget, tokens for a token budget."""
        return self.k if self.k is not None else self.tokens

    @property
    def unit(self) -> str:
        return "k" if self.k is not None else "tokens"

    def costs(self, tokens: np.ndarray | None, n_items: int | None = None) -> np.ndarray:
        """Each item's cost in budget units: 1 per item under a k budget (`n_items` of them, or one per token
        count), its tokens under a token budget (which needs them)."""
        if self.k is not None:
            return np.ones(len(tokens) if n_items is None else n_items, dtype=np.int64)
        if tokens is None:
            raise ValueError(f"a budget of {self.tokens} tokens needs the pool's tokens (token counts); this pool "
                             "has none")
        return np.asarray(tokens).astype(np.int64)

    def fits(self, costs_so_far, cost):
        """Whether an item of `cost` (budget units; scalar or array) can join a selection that already
        spends `costs_so_far` without exceeding the budget."""
        return np.asarray(costs_so_far) + np.asarray(cost) <= self.limit


@dataclass(frozen=True, eq=False)
class Pool:
    """One query's candidates, read-only. What a selector reads of them; a selector refuses, naming the
    field, a pool without what it needs.

    - relevance: (n,) relevance scores (the walk and tie order of every selector); default the cosine of
      each item to the query, which then needs embeddings;
    - embeddings: optional (n, d), L2-normalised rows (validated), with `query`, any non-zero (d,) vector
      (cosines use its normalised direction): MMR, facility location, AdaGReS, LMVU;
    - tokens: optional (n,) positive integer token costs t(d): every token budget;
    - covers: optional (n, V) matrix M[d, v] of coverage probabilities or 0/1: the coverage selectors and
      the exact oracles;
    - source_units: optional (n,) labels of the source unit each item comes from (RVC2, METHODS.md §2);
    - atoms, atom_items: optional (m, d) L2-normalised embeddings of the items' sentence-level atoms and the
      item index each belongs to (LMVU's atomic-state features, METHODS.md §2); without them every item is
      its own single atom. Every item has at least one atom.
    """
    embeddings: np.ndarray | None = None
    query: np.ndarray | None = None
    tokens: np.ndarray | None = None
    relevance: np.ndarray | None = None
    covers: np.ndarray | None = None
    source_units: np.ndarray | None = None
    atoms: np.ndarray | None = None
    atom_items: np.ndarray | None = None

    def __post_init__(self):
        if self.embeddings is None:
            if self.relevance is None:
                raise ValueError("a pool needs relevance scores, or embeddings and a query to compute them from")
            if self.query is not None or self.atoms is not None:
                raise ValueError("query and atoms go with embeddings; this pool has none")
            n = len(np.asarray(self.relevance))
        else:
            n = self._set_embeddings()
        if self.tokens is not None:
            tokens = np.asarray(self.tokens)
            if tokens.shape != (n,) or (n and (not np.issubdtype(tokens.dtype, np.integer) or tokens.min() < 1)):
                raise ValueError(f"tokens must be {n} positive integers (one per item); got shape {tokens.shape}, "
                                 f"dtype {tokens.dtype}")
            object.__setattr__(self, "tokens", _read_only(tokens.astype(np.int64)))
        if self.relevance is None:
            relevance = self.query_similarity
        else:
            relevance = np.array(self.relevance, dtype=float)
            if relevance.shape != (n,) or not np.isfinite(relevance).all():
                raise ValueError(f"relevance must be {n} finite scores; got shape {relevance.shape}")
        object.__setattr__(self, "relevance", _read_only(relevance))
        if self.covers is not None:
            covers = np.array(self.covers, dtype=float)
            if covers.ndim != 2 or covers.shape[0] != n:
                raise ValueError(f"covers must be an (n_items={n}, n_viewpoints) matrix; got shape {covers.shape}")
            if not ((covers >= 0) & (covers <= 1)).all():
                raise ValueError("covers must hold probabilities in [0, 1] or 0/1")
            object.__setattr__(self, "covers", _read_only(covers))
        if self.source_units is not None:
            units = np.array(self.source_units)
            if units.shape != (n,):
                raise ValueError(f"source_units must hold one label per item ({n}); got shape {units.shape}")
            object.__setattr__(self, "source_units", _read_only(units))

    def _set_embeddings(self) -> int:
        embeddings = np.array(self.embeddings, dtype=float)
        if embeddings.ndim != 2:
            raise ValueError(f"embeddings must be a 2-D (n_items, dim) matrix; got shape {embeddings.shape}")
        n, dim = embeddings.shape
        if not np.isfinite(embeddings).all():
            raise ValueError("embeddings must be finite")
        norms = np.linalg.norm(embeddings, axis=1)
        off = np.flatnonzero(np.abs(norms - 1) > NORM_TOLERANCE)
        if len(off):
            raise ValueError(f"embeddings must have L2-normalised rows; row {off[0]} has norm {norms[off[0]]:.6f}")
        query = np.array(self.query, dtype=float) if self.query is not None else np.zeros(0)
        if query.shape != (dim,) or not np.isfinite(query).all() or not np.linalg.norm(query) > 0:
            raise ValueError(f"query must be a finite non-zero vector of dimension {dim}; got shape {query.shape}")
        object.__setattr__(self, "embeddings", _read_only(embeddings))
        object.__setattr__(self, "query", _read_only(query))
        if (self.atoms is None) != (self.atom_items is None):
            raise ValueError("atoms and atom_items go together: give both or neither")
        if self.atoms is None:
            atoms, items = self.embeddings, np.arange(n)
        else:
            atoms, items = np.array(self.atoms, dtype=float), np.asarray(self.atom_items)
            if atoms.ndim != 2 or atoms.shape[1] != dim or items.shape != (len(atoms),):
                raise ValueError(f"atoms must be an (m, {dim}) matrix with one atom_items entry per row; got "
                                 f"shapes {atoms.shape} and {items.shape}")
            if not np.issubdtype(items.dtype, np.integer) or not np.array_equal(np.unique(items), np.arange(n)):
                raise ValueError(f"atom_items must be item indices in [0, {n}) naming every item at least once")
            # A row holding an infinity or a NaN has an infinite or NaN norm, which fails the comparison: one pass
            # checks both (the atoms are most of a served request's numbers).
            norms = np.sqrt(np.einsum("ij,ij->i", atoms, atoms))
            if not (np.abs(norms - 1) <= NORM_TOLERANCE).all():
                raise ValueError("atoms must be finite with L2-normalised rows")
        object.__setattr__(self, "atoms", _read_only(atoms))
        object.__setattr__(self, "atom_items", _read_only(items.astype(np.int64)))
        return n

    @property
    def size(self) -> int:
        return len(self.relevance)

    def require(self, field_name: str, selector: str) -> np.ndarray:
        """The pool's `field_name` array, or a ValueError saying that `selector` needs it."""
        value = getattr(self, field_name)
        if value is None:
            raise ValueError(f"{selector} needs the pool's {field_name}; this pool has none")
        return value

    @cached_property
    def query_similarity(self) -> np.ndarray:
        """sim(q, d): the cosine of every item to the query (METHODS.md §3: dot products of unit vectors)."""
        embeddings = self.require("embeddings", "the query similarity")
        return _read_only(embeddings @ (self.query / np.linalg.norm(self.query)))


@dataclass(frozen=True, eq=False)
class Selection:
    """What a selector chose from a pool: `items` (pool indices in selection order), `gains` (each item's
    score at the step it was chosen: the method's marginal gain, or its relevance for relevance order; NaN
    for an item a fill added) and `tokens` (the items' token total; None for a pool without token counts)."""
    items: np.ndarray
    gains: np.ndarray
    tokens: int | None

    def __post_init__(self):
        items = np.array(self.items, dtype=np.int64)
        gains = np.array(self.gains, dtype=float)
        if gains.shape != items.shape:
            raise ValueError(f"a Selection needs one gain per item; got {gains.shape} for {items.shape}")
        object.__setattr__(self, "items", _read_only(items))
        object.__setattr__(self, "gains", _read_only(gains))

    def __len__(self) -> int:
        return len(self.items)

    @classmethod
    def of(cls, pool: Pool, items, gains=None) -> Selection:
        """A selection of `items` from `pool`, its token total read off the pool; gains default to NaN."""
        items = np.asarray(items, dtype=np.int64)
        return cls(items, np.full(len(items), np.nan) if gains is None else gains,
                   None if pool.tokens is None else int(pool.tokens[items].sum()))


class Refused(ValueError):
    """A selector cannot select from this pool by its definition (an exact oracle's inventory too large for its
    DP): callers leave the query out and report the reason, never an approximation."""


@runtime_checkable
class Selector(Protocol):
    """The one selector signature: a Selection of distinct pool indices in selection order, within `budget`."""
    name: str

    def __call__(self, pool: Pool, budget: Budget) -> Selection: ...


@dataclass
class GreedySteps:
    """One pool's greedy selection, as `run_greedy` runs it: `order`, the pool indices in the order the walk
    visits them (relevance order), which positions below index; `costs`, each position's cost in budget units;
    `scores()`, each position's score at the current state; `add(position)`, the state update once a
    position is chosen. `stop_at_nonpositive`: stop before taking a position whose score is <= 0; `fill`: once
    stopped, add the remaining positions in order while they fit. `scale`: the range of a score, what `Blend`
    puts the fallback score on (the viewpoints per mean item cost for coverage; 1 otherwise)."""
    order: np.ndarray
    costs: np.ndarray
    scores: Callable[[], np.ndarray]
    add: Callable[[int], None]
    stop_at_nonpositive: bool = False
    fill: bool = False
    scale: float = 1.0


class GreedySelector(Protocol):
    """A selector whose selection is one greedy walk (`GreedySteps`); `Blend` wraps any of them."""
    name: str

    def steps(self, pool: Pool, budget: Budget) -> GreedySteps: ...

    def __call__(self, pool: Pool, budget: Budget) -> Selection: ...


def run_greedy(pool: Pool, steps: GreedySteps, budget: Budget) -> Selection:
    """The Selection of one greedy walk: `greedy` over the steps, then (with `fill`) the remaining positions in
    walk order while they fit."""
    chosen, gains, used = greedy(steps.costs, budget, steps.scores, steps.add, steps.stop_at_nonpositive)
    if steps.fill:
        taken = np.zeros(len(steps.order), dtype=bool)
        taken[chosen] = True
        filled = fill(np.flatnonzero(~taken), steps.costs, budget, used, chosen.tolist())
        gains = np.concatenate([gains, np.full(len(filled) - len(chosen), np.nan)])
        chosen = filled
    return Selection.of(pool, steps.order[chosen], gains)


def greedy(costs: np.ndarray, budget: Budget, scores: Callable[[], np.ndarray], add: Callable[[int], None],
           stop_at_nonpositive: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
    """The greedy loop of every greedy selector (METHODS.md §2 "Allocation", §1 greedy): each step, among the
    items not yet chosen whose cost still fits the budget, take the argmax of `scores()` (one score per item;
    ties to the lower index, the more relevant item since callers index in relevance order), then `add(best)`
    updates the caller's state for the next step's scores. Stops when nothing fits, or, with
    `stop_at_nonpositive`, before taking an item whose score is <= 0.
    Returns the chosen indices in selection order, each one's score at its step, and the budget units spent."""
    costs = np.asarray(costs)
    step_costs = costs.tolist()
    chosen: list[int] = []
    gains: list[float] = []
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
        gains.append(float(masked[best]))
        available[best] = False
        used += step_costs[best]
        add(best)
    return np.asarray(chosen, dtype=np.int64), np.asarray(gains, dtype=float), used


def fill(walk: np.ndarray, costs: np.ndarray, budget: Budget, used: int, chosen: list[int]) -> np.ndarray:
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


def relevance_order(pool: Pool) -> np.ndarray:
    """Pool indices by relevance, higher first, ties by lower index: the walk of every selector."""
    return np.argsort(-pool.relevance, kind="stable")


@dataclass(frozen=True)
class RelevanceOrder:
    """Relevance order under a budget (METHODS.md §2 "Baselines"; under a k budget the first k): walk the items
    by relevance (higher first, then lower index), add each one that still fits, skip the ones that do not.
    The fallback order of every selection on estimated coverage."""

    @property
    def name(self) -> str:
        return "relevance"

    def __call__(self, pool: Pool, budget: Budget) -> Selection:
        items = fill(relevance_order(pool), budget.costs(pool.tokens, pool.size), budget, used=0, chosen=[])
        return Selection.of(pool, items, pool.relevance[items])


@dataclass(frozen=True)
class Blend:
    """A greedy selector blended with its fallback order (relevance order) [chosen, METHODS.md §1]: each step
    the position p maximising

        weight * score_p + (1 - weight) * scale * f_p,    f_p = 1 - p / n,

    score_p the wrapped selector's score, f_p the fallback score of the p-th of the n items in relevance
    order and `scale` the range of a score (`GreedySteps.scale`: for coverage the number m of viewpoints per
    mean item cost, so under a k budget the rule is weight * g / m + (1 - weight) * f, times m, and under a
    token budget the gain per token is set against m per mean item's tokens). Weight 0 is exactly relevance
    order (under a token budget: the items in relevance order that fit, as `RelevanceOrder`), weight 1 exactly
    the wrapped selector (its scores plus an exact 0, bit for bit); an uninformative estimate then degrades
    toward the fallback instead of away from it. The weight is chosen on the tune split
    (models/trust.py `choose_blend_weight`)."""
    selector: GreedySelector
    weight: float

    def __post_init__(self):
        if not callable(getattr(self.selector, "steps", None)):
            raise TypeError(f"Blend wraps a greedy selector (one with steps(pool, budget)); got {self.selector!r}")
        check_weight(self.weight)

    @property
    def name(self) -> str:
        return self.selector.name if self.weight == 1 else f"{self.selector.name}_blend{self.weight:g}"

    def steps(self, pool: Pool, budget: Budget) -> GreedySteps:
        inner = self.selector.steps(pool, budget)
        n = len(inner.order)
        fallback = (1.0 - self.weight) * inner.scale * (1.0 - np.arange(n) / max(n, 1))
        return replace(inner, scores=lambda: self.weight * inner.scores() + fallback)

    def __call__(self, pool: Pool, budget: Budget) -> Selection:
        return run_greedy(pool, self.steps(pool, budget), budget)


def check_weight(weight: float) -> float:
    """A blend weight: a number in [0, 1]; else a ValueError naming it."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.floating)) or not 0 <= weight <= 1:
        raise ValueError(f"a blend weight must lie in [0, 1]; got {weight!r}")
    return float(weight)


def check_tau(tau: float) -> float:
    """The coverage threshold tau of hard greedy (covered iff p >= tau): a number in (0, 1]; else a ValueError."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float, np.floating)) or not 0 < tau <= 1:
        raise ValueError(f"tau (covered iff p >= tau) must lie in (0, 1]; got {tau!r}")
    return float(tau)


# The defaults of the two evaluation settings a selector reads (models/registry.py SelectorSettings, the
# evaluation resource's fields and serving all read these): tau of hard coverage greedy, lambda of MMR.
DEFAULT_TAU = 0.3
DEFAULT_MMR_LAMBDA = 0.5


def check_mmr_lambda(lam: float) -> float:
    """MMR's relevance weight lambda: a number in [0, 1]; else a ValueError."""
    if isinstance(lam, bool) or not isinstance(lam, (int, float, np.floating)) or not 0 <= lam <= 1:
        raise ValueError(f"MMR lambda must lie in [0, 1]; got {lam!r}")
    return float(lam)


@dataclass(frozen=True)
class MMR:
    """Maximal marginal relevance (Carbonell & Goldstein 1998, METHODS.md §5; §2 baseline, lambda default 0.5):
    each step, among the items that fit, argmax lam * sim(d, q) - (1 - lam) * max_{s in S} sim(d, s), the
    penalty being 0 while S is empty. sim(d, q) is the pool's relevance (the cosine to the query unless the
    pool carries another score), so lam = 1 is exactly `RelevanceOrder`. Stops when nothing fits."""
    lam: float = DEFAULT_MMR_LAMBDA

    def __post_init__(self):
        check_mmr_lambda(self.lam)

    @property
    def name(self) -> str:
        return f"mmr_{self.lam:g}"

    def steps(self, pool: Pool, budget: Budget) -> GreedySteps:
        order = relevance_order(pool)
        embeddings = pool.require("embeddings", self.name)[order]
        costs = budget.costs(pool.tokens, pool.size)[order]
        relevance = self.lam * pool.relevance[order]
        max_similarity = np.full(len(order), -np.inf)  # max_{s in S} sim(d, s), updated one row at a time
        penalty = np.zeros(len(order))  # (1 - lam) * max_similarity, 0 while S is empty

        def add(best: int) -> None:
            np.maximum(max_similarity, embeddings @ embeddings[best], out=max_similarity)
            np.multiply(1 - self.lam, max_similarity, out=penalty)

        return GreedySteps(order, costs, lambda: relevance - penalty, add)

    def __call__(self, pool: Pool, budget: Budget) -> Selection:
        return run_greedy(pool, self.steps(pool, budget), budget)


@dataclass(frozen=True)
class FacilityLocation:
    """Facility location (Lin & Bilmes 2011, METHODS.md §5; §2 baseline): f(S) = sum_i max_{j in S} s_ij with
    s_ij = max(cos(d_i, d_j), 0) over the whole pool. Budgeted cost-scaled greedy: each step, among the items
    that fit, argmax of the marginal gain divided by the item's cost in budget units, until nothing fits;
    then the better of that set and the best single feasible item (the set wins ties)."""

    @property
    def name(self) -> str:
        return "facloc"

    def __call__(self, pool: Pool, budget: Budget) -> Selection:
        return self._select_batch([pool], budget)[0]

    def _select_batch(self, pools: Sequence[Pool], budget: Budget) -> list[Selection]:
        for pool in pools:
            pool.require("embeddings", self.name)
        return _in_groups(pools, _similarity_bytes, lambda group: self._lockstep(group, budget))

    def _lockstep(self, pools: Sequence[Pool], budget: Budget) -> list[Selection]:
        """The greedy for a batch of pools (`_greedy_rows`), then each pool's best single item. Each pool keeps
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

        chosen, step_gains = _greedy_rows(batch, budget, scores, add)
        for row, (size, column) in enumerate(zip(batch.sizes, columns)):
            feasible = np.flatnonzero(budget.fits(0, batch.costs[row, :size]))
            if len(feasible):
                singles = column[feasible].sum(axis=1)  # f({j})
                single = int(np.argmax(singles))
                if singles[single] > value[row]:
                    chosen[row] = [int(feasible[single])]
                    step_gains[row] = [float(singles[single] / batch.costs[row, feasible[single]])]
        return batch.selections(pools, chosen, step_gains)


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
    embeddings = pool.require("embeddings", "adaptive_beta")
    k_bar = (budget.k if budget.k is not None
             else max(1, math.floor(budget.tokens / pool.require("tokens", "adaptive_beta").mean())))
    total = embeddings.sum(axis=0)
    pair_sum = (total @ total - np.einsum("ij,ij->", embeddings, embeddings)) / 2
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

    def steps(self, pool: Pool, budget: Budget) -> GreedySteps:
        pool.require("embeddings", self.name)
        beta = adaptive_beta(pool, budget, self.alpha) if self.beta is None else self.beta
        order = relevance_order(pool)
        embeddings = pool.require("embeddings", self.name)[order]
        costs = budget.costs(pool.tokens, pool.size)[order]
        relevance = self.alpha * pool.query_similarity[order]
        redundancy = np.zeros(len(order))  # sum_{s in S} sim(x, s), one row added per selected item

        def add(best: int) -> None:
            np.add(redundancy, embeddings @ embeddings[best], out=redundancy)

        return GreedySteps(order, costs, lambda: relevance - beta * redundancy, add,
                           stop_at_nonpositive=self.stop_on_nonpositive_gain)

    def __call__(self, pool: Pool, budget: Budget) -> Selection:
        return run_greedy(pool, self.steps(pool, budget), budget)


@dataclass(frozen=True)
class CoverageGreedy:
    """Budget-aware greedy coverage (METHODS.md §1 greedy and its soft extension, §2 "Problem"): each step,
    among the items that fit, argmax of the marginal coverage gain per unit of budget (per token under a
    token budget, per item under a k budget: the paper's greedy max coverage), ties by relevance. soft: the
    expected number of newly covered viewpoints, sum_v p_dv * prod_{s in S} (1 - p_sv), over the pool's
    `covers` probabilities; hard: the number of newly covered viewpoints with covered iff p >= tau (tau 1 on
    gold 0/1 links: oracle greedy). Once no fitting item adds coverage, the rest is filled in relevance order
    while items fit (those that do not fit are skipped)."""
    soft: bool
    tau: float = DEFAULT_TAU

    def __post_init__(self):
        check_tau(self.tau)

    @property
    def name(self) -> str:
        return "coverage_soft" if self.soft else f"coverage_hard_tau{self.tau:g}"

    def _matrix(self, pool: Pool, order: np.ndarray) -> np.ndarray:
        """The pool's M[d, v] in walk order: probabilities (soft) or p >= tau as 0/1 (hard)."""
        covers = pool.require("covers", self.name)[order]
        return covers if self.soft else (covers >= self.tau).astype(float)

    def steps(self, pool: Pool, budget: Budget) -> GreedySteps:
        order = relevance_order(pool)
        covers = self._matrix(pool, order)
        costs = budget.costs(pool.tokens, pool.size)[order]
        uncovered = np.ones(covers.shape[1])  # prod_{s in S} (1 - p_sv): probability v is still open
        # A score is a gain per unit of budget: at most the m viewpoints per item under k, per token about
        # m / (a typical item's tokens) under tokens, the range Blend puts the fallback score on.
        scale = float(covers.shape[1]) / (float(costs.mean()) if len(costs) else 1.0)
        return GreedySteps(order, costs, lambda: _expected_new(covers, uncovered) / costs,
                           lambda best: _close(uncovered, covers[best]), stop_at_nonpositive=True, fill=True,
                           scale=scale)

    def __call__(self, pool: Pool, budget: Budget) -> Selection:
        return run_greedy(pool, self.steps(pool, budget), budget)

    def _select_batch(self, pools: Sequence[Pool], budget: Budget) -> list[Selection]:
        if len(pools) == 1:
            return [self(pools[0], budget)]
        batch = _Batch(pools, budget)
        own = [self._matrix(pool, order) for pool, order in zip(pools, batch.orders)]
        available = batch.available()
        chosen, step_gains, used = self._lockstep(batch, own, available)
        # Then the relevance-order fill over the items not chosen (`available` is now exactly those).
        filled = [fill(np.flatnonzero(available[row, :size]), batch.costs[row, :size], budget, spent, picked)
                  for row, (size, picked, spent) in enumerate(zip(batch.sizes, chosen, used))]
        gains = [np.concatenate([g, np.full(len(f) - len(g), np.nan)]) for g, f in zip(step_gains, filled)]
        return batch.selections(pools, filled, gains)

    def _lockstep(self, batch: _Batch, own: list[np.ndarray], available: np.ndarray):
        """The greedy part for several pools at once (`_greedy_lockstep`), scored by `_expected_new` as one pool
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

        chosen, step_gains, used = _greedy_lockstep(batch.costs, batch.limits, available, scores, add,
                                                    stop_at_nonpositive=True)
        return chosen, [np.asarray(g, dtype=float) for g in step_gains], used.tolist()


@dataclass(frozen=True)
class ExactOracle:
    """The exact RVC1 or RVC2 oracle (METHODS.md §2 "Exact oracles", models/oracles.py) as a selector over the
    pool's gold `covers` (and `source_units` for RVC2) under a token budget: the item set of the best value
    within B, in the order the DP lists it (a set: no rank order). A pool without viewpoints has no RVC: the
    selection is empty. An inventory too large for the DP is `Refused` with the oracle's reason."""
    measure: str  # "rvc1" or "rvc2"

    def __post_init__(self):
        if self.measure not in ("rvc1", "rvc2"):
            raise ValueError(f"ExactOracle measure must be 'rvc1' or 'rvc2'; got {self.measure!r}")

    @property
    def name(self) -> str:
        return f"oracle_{self.measure}"

    def __call__(self, pool: Pool, budget: Budget) -> Selection:
        covers = pool.require("covers", self.name)
        if budget.tokens is None:
            raise ValueError(f"{self.name} is defined under a token budget; got k = {budget.k}")
        if covers.shape[1] == 0:
            return Selection.of(pool, [])
        tokens = pool.require("tokens", self.name)
        try:
            result = (rvc1_oracle(covers, tokens, budget.tokens) if self.measure == "rvc1"
                      else rvc2_oracle(covers, tokens, pool.require("source_units", self.name), budget.tokens))
        except ValueError as error:
            raise Refused(str(error)) from None
        return Selection.of(pool, result.items)


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


def select_batch(selector: Selector, pools: Sequence[Pool], budget: Budget) -> list[Selection]:
    """Exactly `[selector(pool, budget) for pool in pools]`, computed for the whole batch at once by the
    selectors that have a batched path (`_select_batch`: FacilityLocation, CoverageGreedy; module docstring);
    any other selector is called pool by pool."""
    pools = list(pools)
    batched = getattr(selector, "_select_batch", None)
    if batched is None or not pools:
        return [selector(pool, budget) for pool in pools]
    return batched(pools, budget)


def _greedy_lockstep(costs: np.ndarray, limits: np.ndarray, available: np.ndarray,
                     scores: Callable[[np.ndarray], np.ndarray], add: Callable[[np.ndarray, np.ndarray], None],
                     stop_at_nonpositive: bool = False) -> tuple[list[list[int]], list[list[float]], np.ndarray]:
    """`greedy` for a batch of pools in lockstep, one pool per row of the (n_pools, n_items) arrays (rows
    padded to the largest pool; `available` False on the padding, and updated in place): each step, every
    pool still going takes the argmax of its row of `scores(rows)` among its available items whose cost still
    fits its limit (ties to the lower index), then `add(rows, best)` updates the callers' state for the pools
    in `rows` (their step's items `best`). `scores(rows)` returns (n_pools, n_items) scores of which only the
    rows listed, the pools still going, are read. A pool stops when nothing fits, or, with
    `stop_at_nonpositive`, before taking an item whose score is <= 0; a stopped pool's state is never read
    again. Returns each pool's chosen indices in selection order, their scores at their steps, and the budget
    units each spends (one row of a batch goes exactly as `greedy` goes on it alone: tests/test_selectors.py)."""
    n_pools = len(costs)
    used = np.zeros(n_pools, dtype=np.result_type(costs.dtype, np.int64))
    chosen: list[list[int]] = [[] for _ in range(n_pools)]
    gains: list[list[float]] = [[] for _ in range(n_pools)]
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
            gains[row].append(float(masked[row, item]))
        available[rows, best] = False
        used[rows] += costs[rows, best]
        add(rows, best)
    return chosen, gains, used


def _greedy_rows(batch: _Batch, budget: Budget, scores: Callable[[np.ndarray], np.ndarray],
                 add: Callable[[np.ndarray, np.ndarray], None]) -> tuple[list[list[int]], list[list[float]]]:
    """Each pool's greedy choices (positions in relevance order) and their step scores, with `scores` and
    `add` as `_greedy_lockstep` takes them: several pools in lockstep, and one pool, as row 0 of a batch of
    one, through `greedy` (the same steps without the lockstep's row bookkeeping, which costs a single pool
    more than it saves)."""
    if len(batch.sizes) != 1:
        chosen, gains, _ = _greedy_lockstep(batch.costs, batch.limits, batch.available(), scores, add)
        return chosen, gains
    going, best = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)  # a batch of one has no padding

    def add_one(item: int) -> None:
        best[0] = item
        add(going, best)

    chosen, gains, _ = greedy(batch.costs[0], budget, lambda: scores(going)[0], add_one)
    return [chosen.tolist()], [gains.tolist()]


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
    """A batch of pools in relevance order, padded to the largest: `orders` (each pool's `relevance_order`),
    `sizes`, `shape` (n_pools, n_items), `costs` (budget units, 0 on the padding) and `limits`."""

    def __init__(self, pools: Sequence[Pool], budget: Budget):
        self.orders = [relevance_order(pool) for pool in pools]
        self.sizes = [len(order) for order in self.orders]
        self.shape = (len(self.orders), max(self.sizes, default=0))
        self.costs = self.pad([budget.costs(pool.tokens, pool.size) for pool in pools], dtype=np.int64)
        self.limits = np.full(len(self.orders), _limit(budget), dtype=np.int64)

    def pad(self, values: Sequence[np.ndarray], dtype=float) -> np.ndarray:
        """Per-pool item values (pool order) as one (n_pools, n_items) matrix in relevance order, 0 padded."""
        padded = np.zeros(self.shape, dtype=dtype)
        for row, (value, order) in enumerate(zip(values, self.orders)):
            padded[row, :len(order)] = value[order]
        return padded

    def available(self) -> np.ndarray:
        """True on every pool's items, False on the padding (a fresh array: `_greedy_lockstep` updates it)."""
        return np.arange(self.shape[1])[None, :] < np.asarray(self.sizes, dtype=np.int64)[:, None]

    def selections(self, pools: Sequence[Pool], chosen: Sequence, gains: Sequence) -> list[Selection]:
        """Positions in relevance order, per pool, as Selections of pool indices."""
        return [Selection.of(pool, order[np.asarray(picked, dtype=np.int64)], step_gains)
                for pool, order, picked, step_gains in zip(pools, self.orders, chosen, gains)]


def _in_groups(pools: Sequence[Pool], size: Callable[[Pool], int],
               run: Callable[[list[Pool]], list[Selection]]) -> list[Selection]:
    """`run` over consecutive groups of the pools, each group's `size` (bytes) summing to at most
    LOCKSTEP_BYTES (or a single pool), the selections concatenated in pool order."""
    selections: list[Selection] = []
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


def _read_only(array: np.ndarray) -> np.ndarray:
    """`array`, a new array of the pool's own (made by `np.array`, `astype` or arithmetic, never the caller's, so
    the caller's array stays writable and unaliased), made read-only. One copy per field: a served request's
    atoms (megabytes of float32) are converted to float64 once and not copied again."""
    array.setflags(write=False)
    return array
