"""LMVU, the learned marginal viewpoint utility ranker (METHODS.md §2 "Ranker", "Allocation"): a linear scorer
over 18 runtime-visible features of (candidate, current selection state, budget), trained pairwise on the
true marginal gain in gold viewpoints, and allocated greedily under a k or token budget (models/selectors.py).

Features (FEATURE_NAMES, in FEATURE_GROUPS [chosen], METHODS.md §2). "cost" is the item's cost in budget units
(its tokens under a token budget, 1 under a k budget); S is the current selection; cosines are dot products of
the pool's L2-normalised embeddings; over an empty S every mean / max / share below is 0, the residual norm 1.
candidate:
- relevance_cosine: sim(q, d), the cosine of the candidate to the query (`Pool.query_similarity`);
- relevance_percentile: the share of the other pool items strictly less relevant by `Pool.relevance` (1 = most
  relevant; 1 in a one-item pool);
- log_cost: log(1 + cost);
- cost_per_remaining: cost / the budget left (exact for every item that still fits);
- cost_per_budget: cost / the whole budget;
- relevance_above_mean: sim(q, d) minus the pool's mean sim(q, .);
evidence_state:
- max_cosine_selected: max cosine to the selected items;
- mean_cosine_selected: mean cosine to the selected items;
- cosine_selected_centroid: cosine to the centroid (sum) of the selected embeddings (0 if that sum is 0);
- residual_norm: the norm of what is left of the candidate after projection onto the span of the selected
  embeddings (Gram-Schmidt basis kept incrementally);
- near_duplicate_share: the share of selected items with cosine > NEAR_DUPLICATE_COSINE (0.7) to the candidate;
atomic_state (over the candidate's atoms, `Pool.atoms` rows of this item; an item without atoms is its own
atom), with an atom's novelty = 1 - max(0, max cosine to any atom of a selected item), so 1 over an empty S
and in [0, 1] [chosen: the clip at 0 keeps an opposed atom from looking more novel than a fresh one]:
- atom_novelty_mean: mean novelty of its atoms;
- atom_novelty_max: max novelty of its atoms;
- novel_atom_share: share of its atoms with novelty > NOVEL_ATOM (0.5);
- log_atoms: log(1 + number of its atoms);
shared_state (equal for every candidate at a state, so they cancel in the pairwise differences and carry no
weight in the ranking; kept because METHODS.md §2 lists the group, and they document the states sampled):
- selected_count: |S|;
- budget_used: the share of the budget S spends;
- log_remaining: log(1 + the budget left).
Under a k budget every cost is 1, so the cost features are equal across candidates too and cancel likewise.
Ratios whose denominator is a budget use max(denominator, 1), which changes nothing for an item that fits and
keeps the features finite for those that do not.

Gold labels are never read at selection time: `SelectionState` and `LMVU` read the pool's embeddings, query,
relevance, tokens and atoms only, never `covers` or `source_units`; the gold matrix enters through
`LabelledPool` in training and evaluation alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression

from covlab.models.protocol import Fold
from covlab.models.selection import QueryPool
from covlab.models.selectors import (Budget, GreedySteps, Pool, RelevanceOrder, Selection, fill, greedy,
                                     relevance_order, run_greedy)
from covlab.models.viewpoints import viewpoint_matrix

FEATURE_GROUPS: Mapping[str, tuple[str, ...]] = {
    "candidate": ("relevance_cosine", "relevance_percentile", "log_cost", "cost_per_remaining", "cost_per_budget",
                  "relevance_above_mean"),
    "evidence_state": ("max_cosine_selected", "mean_cosine_selected", "cosine_selected_centroid", "residual_norm",
                       "near_duplicate_share"),
    "atomic_state": ("atom_novelty_mean", "atom_novelty_max", "novel_atom_share", "log_atoms"),
    "shared_state": ("selected_count", "budget_used", "log_remaining"),
}
FEATURE_NAMES: tuple[str, ...] = tuple(name for names in FEATURE_GROUPS.values() for name in names)

# Cosine above which a selected item counts as a near duplicate of the candidate, and the novelty above which
# an atom counts as novel [chosen].
NEAR_DUPLICATE_COSINE = 0.7
NOVEL_ATOM = 0.5
# A new item whose residual after projection onto the selected span is shorter than this adds no direction.
SPAN_TOLERANCE = 1e-8
# How the true marginal gain of a candidate is measured in training: newly covered gold viewpoints, or those
# per unit of budget (per token under a token budget; the same as "viewpoints" under a k budget).
# [chosen] default per token: a token budget rewards cheap novel items, which only the per-token gain teaches
# (the README gives the dev RVC1 of both gains on ArgKP).
GAINS = ("viewpoints", "viewpoints_per_token")
DEFAULT_GAIN = "viewpoints_per_token"
# Roll-in policies the training states are drawn from (see `sample_states`).
ROLL_IN_POLICIES = ("gold_greedy", "relevance", "random")


class SelectionState:
    """The runtime-visible state of a selection in one pool under one budget, and the 18 features of every pool
    item against it (module docstring). Adding an item costs one similarity row per added item (embeddings
    times the added embedding, all atoms times the added item's atoms reduced per atom) and one projection row
    per new Gram-Schmidt basis vector; nothing pool x pool is ever formed."""

    def __init__(self, pool: Pool, budget: Budget):
        self.pool, self.budget = pool, budget
        n = pool.size
        self.costs = budget.costs(pool.tokens, pool.size)
        self.selected: list[int] = []
        self.used = 0
        self._is_selected = np.zeros(n, dtype=bool)
        cosine = pool.query_similarity
        less_relevant = np.searchsorted(np.sort(pool.relevance), pool.relevance, side="left")
        self._static = {
            "relevance_cosine": cosine,
            "relevance_percentile": less_relevant / (n - 1) if n > 1 else np.ones(n),
            "log_cost": np.log1p(self.costs),
            "cost_per_budget": self.costs / max(budget.limit, 1),
            "relevance_above_mean": cosine - cosine.mean() if n else cosine,
        }
        self._norm_sq = np.einsum("ij,ij->i", pool.embeddings, pool.embeddings)
        self._max_cosine = np.zeros(n)
        self._cosine_sum = np.zeros(n)  # e_d . c, c the sum of the selected embeddings
        self._centroid_sq = 0.0  # |c|^2
        self._near_duplicates = np.zeros(n)
        self._basis = np.zeros((0, pool.embeddings.shape[1]))  # orthonormal rows spanning the selected items
        self._projection_sq = np.zeros(n)  # |projection of e_d onto the span|^2
        atom_items = pool.atom_items
        if (atom_items[1:] >= atom_items[:-1]).all():  # grouped by item already, as pools are built: no copy
            self._atoms = pool.atoms
        else:
            by_item = np.argsort(atom_items, kind="stable")
            self._atoms, atom_items = pool.atoms[by_item], atom_items[by_item]
        self._atom_starts = np.searchsorted(atom_items, np.arange(n))
        self._atom_counts = np.diff(np.append(self._atom_starts, len(self._atoms)))
        self._atom_covered = np.zeros(len(self._atoms))  # max(0, max cosine to an atom of a selected item)

    def candidates(self) -> np.ndarray:
        """The unselected items whose cost still fits the budget, ascending."""
        return np.flatnonzero(~self._is_selected & self.budget.fits(self.used, self.costs))

    def add(self, item: int) -> None:
        """Select `item` (it must fit) and update every item's state features."""
        if self._is_selected[item] or not self.budget.fits(self.used, self.costs[item]):
            raise ValueError(f"item {item} is already selected or does not fit the budget left")
        embeddings, added = self.pool.embeddings, self.pool.embeddings[item]
        row = embeddings @ added
        self._centroid_sq += 2 * self._cosine_sum[item] + row[item]
        self._cosine_sum += row
        if self.selected:
            np.maximum(self._max_cosine, row, out=self._max_cosine)
        else:
            self._max_cosine[:] = row
        self._near_duplicates += row > NEAR_DUPLICATE_COSINE
        residual = added - self._basis.T @ (self._basis @ added)
        residual -= self._basis.T @ (self._basis @ residual)  # second pass: classical Gram-Schmidt, re-orthogonalised
        length = np.linalg.norm(residual)
        if length > SPAN_TOLERANCE:
            direction = residual / length
            self._basis = np.vstack([self._basis, direction])
            self._projection_sq += (embeddings @ direction) ** 2
        start = self._atom_starts[item]
        own = self._atoms[start:start + self._atom_counts[item]]
        np.maximum(self._atom_covered, (self._atoms @ own.T).max(axis=1), out=self._atom_covered)
        self.selected.append(int(item))
        self._is_selected[item] = True
        self.used += int(self.costs[item])

    def features(self) -> np.ndarray:
        """The (n_items, 18) feature matrix of every pool item at this state, columns in FEATURE_NAMES order."""
        n, size = self.pool.size, len(self.selected)
        if n == 0:
            return np.zeros((0, len(FEATURE_NAMES)))
        remaining = self.budget.limit - self.used
        per_selected = 1 / max(size, 1)
        novelty = 1 - self._atom_covered
        starts, counts = self._atom_starts, self._atom_counts
        centroid = np.sqrt(self._centroid_sq) if self._centroid_sq > SPAN_TOLERANCE else np.inf
        columns = dict(self._static)
        columns.update({
            "cost_per_remaining": self.costs / max(remaining, 1),
            "max_cosine_selected": self._max_cosine,
            "mean_cosine_selected": self._cosine_sum * per_selected,
            "cosine_selected_centroid": self._cosine_sum / centroid,
            "residual_norm": np.sqrt(np.maximum(self._norm_sq - self._projection_sq, 0.0)),
            "near_duplicate_share": self._near_duplicates * per_selected,
            "atom_novelty_mean": np.add.reduceat(novelty, starts) / counts,
            "atom_novelty_max": np.maximum.reduceat(novelty, starts),
            "novel_atom_share": np.add.reduceat((novelty > NOVEL_ATOM).astype(float), starts) / counts,
            "log_atoms": np.log1p(counts),
            "selected_count": np.full(n, float(size)),
            "budget_used": np.full(n, self.used / max(self.budget.limit, 1)),
            "log_remaining": np.full(n, np.log1p(remaining)),
        })
        return np.column_stack([columns[name] for name in FEATURE_NAMES])


@dataclass(frozen=True, eq=False)
class LMVURanker:
    """The trained linear scorer: score(d) = ((x_d - mean) / scale) . coef over the FEATURE_NAMES features,
    with the regularisation C it was chosen with and the gain it was trained on (METHODS.md §2 "Ranker")."""
    feature_names: tuple[str, ...]
    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    C: float
    gain: str

    def __post_init__(self):
        if tuple(self.feature_names) != FEATURE_NAMES:
            raise ValueError(_feature_mismatch(self.feature_names))
        for field in ("mean", "scale", "coef"):
            values = np.array(getattr(self, field), dtype=float)  # a private, read-only copy
            if values.shape != (len(FEATURE_NAMES),) or not np.isfinite(values).all():
                raise ValueError(f"LMVURanker {field} must hold {len(FEATURE_NAMES)} finite numbers; got shape "
                                 f"{values.shape}")
            values.setflags(write=False)
            object.__setattr__(self, field, values)
        if not (self.scale > 0).all():
            raise ValueError("LMVURanker scale must be positive")
        if self.gain not in GAINS:
            raise ValueError(f"LMVURanker gain must be one of {GAINS}; got {self.gain!r}")
        object.__setattr__(self, "feature_names", tuple(self.feature_names))

    def scores(self, features: np.ndarray) -> np.ndarray:
        """One score per row of an (n, 18) feature matrix; higher = larger predicted marginal gain."""
        return ((features - self.mean) / self.scale) @ self.coef

    def coefficients(self) -> dict[str, float]:
        """Feature name -> coefficient on the standardised feature."""
        return dict(zip(FEATURE_NAMES, self.coef.tolist()))

    def to_dict(self) -> dict:
        """A JSON-ready dict; `from_dict` restores an identical ranker (floats round-trip exactly)."""
        return {"feature_names": list(self.feature_names), "mean": self.mean.tolist(),
                "scale": self.scale.tolist(), "coef": self.coef.tolist(), "C": float(self.C), "gain": self.gain}

    @classmethod
    def from_dict(cls, data: Mapping) -> LMVURanker:
        """The ranker `to_dict` wrote; refuses one trained on other features than FEATURE_NAMES."""
        if tuple(data.get("feature_names", ())) != FEATURE_NAMES:
            raise ValueError(_feature_mismatch(data.get("feature_names", ())))
        return cls(feature_names=tuple(data["feature_names"]), mean=np.asarray(data["mean"], dtype=float),
                   scale=np.asarray(data["scale"], dtype=float), coef=np.asarray(data["coef"], dtype=float),
                   C=float(data["C"]), gain=str(data["gain"]))


@dataclass(frozen=True)
class LMVU:
    """LMVU allocation (METHODS.md §2 "Allocation"): each step, among the items that still fit, add the one the
    ranker scores highest at the current state (ties to the more relevant item, then the lower index, as every
    greedy selector in models/selectors.py), update the state, and stop when nothing fits or the pool is
    exhausted. A greedy `Selector`; never reads the pool's covers or source units."""
    ranker: LMVURanker

    @property
    def name(self) -> str:
        return "lmvu"

    def steps(self, pool: Pool, budget: Budget) -> GreedySteps:
        pool.require("embeddings", self.name)
        order = relevance_order(pool)
        state = SelectionState(pool, budget)
        chosen: list[int] = []  # added to the state when the next step's scores are asked for: after the last
        # choice nothing fits, so the most expensive update of the walk (every atom against the added item's)
        # is never made

        def scores() -> np.ndarray:
            while chosen:
                state.add(int(order[chosen.pop(0)]))
            return self.ranker.scores(state.features())[order]

        return GreedySteps(order, state.costs[order], scores, chosen.append)

    def __call__(self, pool: Pool, budget: Budget) -> Selection:
        return run_greedy(pool, self.steps(pool, budget), budget)


@dataclass(frozen=True, eq=False)
class LabelledPool:
    """One training or evaluation query: its pool and its gold matrix M[d, v] (n_items, n_viewpoints), 0/1."""
    query_id: str
    pool: Pool
    gold: np.ndarray

    def __post_init__(self):
        gold = viewpoint_matrix(self.gold)
        if len(gold) != self.pool.size:
            raise ValueError(f"query {self.query_id!r}: gold has {len(gold)} rows for {self.pool.size} pool items")
        gold.setflags(write=False)
        object.__setattr__(self, "gold", gold)


@dataclass(frozen=True, eq=False)
class TrainedLMVU:
    """The outcome of `train_lmvu`: the ranker, the dev pairwise accuracy of every C tried, the chosen C and
    the number of training and dev pairs."""
    ranker: LMVURanker
    dev_accuracy: Mapping[float, float]
    C: float
    train_pairs: int
    dev_pairs: int

    def coefficients(self) -> dict[str, float]:
        """Feature name -> coefficient on the standardised feature."""
        return self.ranker.coefficients()


@dataclass(frozen=True)
class LMVUSettings:
    """How the ranker is trained (METHODS.md §2 "Ranker"): the regularisation strengths C tried (the one with
    the best dev pairwise accuracy is kept), the states sampled per query and budget, the candidate pairs
    drawn per state, and the seed of all sampling."""
    Cs: tuple[float, ...] = (0.1, 1.0, 10.0)
    states_per_query: int = 10
    max_pairs_per_state: int = 10
    seed: int = 0


@dataclass(frozen=True, eq=False)
class FoldRanker:
    """The LMVU ranker of one cross-validation fold (models/protocol.py `Fold`): trained on the fold's `train`
    queries, C chosen on its `tune` queries, applied to its `evaluated` ones."""
    fold: Fold
    trained: TrainedLMVU


RANKER_FILE = "lmvu_ranker.json"  # the ranker trained on the train split, in a registered model's directory
FOLDS_FILE = "lmvu_fold_rankers.json"  # the per-fold rankers of topic-grouped cross-validation, beside it


def save_rankers(folder: str | Path, ranker: LMVURanker, folds: Sequence[FoldRanker]) -> None:
    """Write the ranker (RANKER_FILE) and, under cross-validation, every fold's ranker with its fold's queries
    (FOLDS_FILE) into `folder`: what a registered LMVU model version holds."""
    folder = Path(folder)
    (folder / RANKER_FILE).write_text(json.dumps(ranker.to_dict(), indent=2))
    if folds:
        (folder / FOLDS_FILE).write_text(json.dumps([{**asdict(f.fold), "ranker": f.trained.ranker.to_dict()}
                                                     for f in folds], indent=2))


def load_rankers(folder: str | Path) -> tuple[LMVURanker, list[tuple[Fold, LMVURanker]]]:
    """The ranker and the fold rankers `save_rankers` wrote (no folds: trained under the split protocol)."""
    folder = Path(folder)
    ranker = LMVURanker.from_dict(json.loads((folder / RANKER_FILE).read_text()))
    if not (folder / FOLDS_FILE).exists():
        return ranker, []
    folds = [(Fold(f["index"], tuple(f["train"]), tuple(f["tune"]), tuple(f["evaluated"])),
              LMVURanker.from_dict(f["ranker"])) for f in json.loads((folder / FOLDS_FILE).read_text())]
    return ranker, folds


def labelled_pools(query_pools: Mapping[str, QueryPool], query_ids: Iterable[str]) -> list[LabelledPool]:
    """The LabelledPools of `query_ids` among `query_pools` that have viewpoints (a query without any has no
    true gain)."""
    chosen = [query_pools[q] for q in query_ids if q in query_pools]
    return [LabelledPool(p.query_id, p.pool, p.gold_labels()) for p in chosen if p.gold_labels().shape[1]]


def fit_lmvu(query_pools: Mapping[str, QueryPool], train: Iterable[str], tune: Iterable[str],
             budgets: Sequence[Budget], settings: LMVUSettings) -> TrainedLMVU:
    """`train_lmvu` on the `train` queries' pools, C chosen on the `tune` queries', at `budgets`."""
    return train_lmvu(labelled_pools(query_pools, train), labelled_pools(query_pools, tune), budgets,
                      Cs=settings.Cs, states_per_query=settings.states_per_query,
                      max_pairs_per_state=settings.max_pairs_per_state, seed=settings.seed)


def fold_rankers(query_pools: Mapping[str, QueryPool], plan: Sequence[Fold], budgets: Sequence[Budget],
                 settings: LMVUSettings) -> list[FoldRanker]:
    """One ranker per fold of `plan` (topic-grouped cross-validation, models/protocol.py): fit on the fold's
    train queries, C chosen on its tune fold, so each evaluated query is selected by a ranker that never saw
    its topic."""
    return [FoldRanker(fold, fit_lmvu(query_pools, fold.train, fold.tune, budgets, settings)) for fold in plan]


def true_gain(gold: np.ndarray, state: SelectionState, items: np.ndarray, gain: str) -> np.ndarray:
    """The true marginal gain of each of `items` at `state` (METHODS.md §2): the gold viewpoints it covers that
    the selection does not yet cover, per unit of budget when gain is "viewpoints_per_token"."""
    if gain not in GAINS:
        raise ValueError(f"gain must be one of {GAINS}; got {gain!r}")
    open_viewpoints = ~gold[state.selected].any(axis=0)
    new = gold[items][:, open_viewpoints].sum(axis=1).astype(float)
    return new / state.costs[items] if gain == "viewpoints_per_token" else new


def sample_states(pools: Sequence[LabelledPool], budgets: Sequence[Budget], states_per_query: int,
                  rng: np.random.Generator, roll_in: Sequence[str] = ROLL_IN_POLICIES
                  ) -> Iterator[tuple[LabelledPool, SelectionState]]:
    """Selection states at which to compare candidates (METHODS.md §2 "sampled states" [chosen]): for every query
    and budget, `states_per_query` times, a roll-in policy drawn uniformly from `roll_in` selects in full, and the
    state is the prefix before one of its steps, the step drawn uniformly (so at least one candidate fits).

    The policies: "gold_greedy" adds the item covering the most uncovered gold viewpoints per unit of budget
    (ties by relevance) until none adds any, the states a good selection passes through, where the choice
    between redundant and novel items matters; "relevance" walks relevance order, the redundancy-heavy states a
    relevance-driven scorer reaches; "random" adds a random order of fitting items, states off both paths, so
    the ranker also learns where it lands after a mistake. Queries or budgets where nothing fits give none."""
    unknown = set(roll_in) - set(ROLL_IN_POLICIES)
    if unknown or not roll_in:
        raise ValueError(f"roll_in must name policies among {ROLL_IN_POLICIES}; got {tuple(roll_in)}")
    for labelled in pools:
        for budget in budgets:
            deterministic: dict[str, np.ndarray] = {}
            for _ in range(states_per_query):
                policy = roll_in[int(rng.integers(len(roll_in)))]
                if policy == "random":
                    costs = budget.costs(labelled.pool.tokens, labelled.pool.size)
                    walk = fill(rng.permutation(labelled.pool.size), costs, budget, used=0, chosen=[])
                else:
                    if policy not in deterministic:
                        deterministic[policy] = (_gold_greedy(labelled, budget) if policy == "gold_greedy"
                                                 else RelevanceOrder()(labelled.pool, budget).items)
                    walk = deterministic[policy]
                if not len(walk):
                    continue
                state = SelectionState(labelled.pool, budget)
                for item in walk[:int(rng.integers(len(walk)))]:
                    state.add(int(item))
                yield labelled, state


def train_lmvu(train: Sequence[LabelledPool], dev: Sequence[LabelledPool], budgets: Sequence[Budget], *,
               Cs: Sequence[float] = (0.1, 1.0, 10.0), states_per_query: int = 10, max_pairs_per_state: int = 10,
               gain: str = DEFAULT_GAIN, roll_in: Sequence[str] = ROLL_IN_POLICIES, seed: int = 0) -> TrainedLMVU:
    """Pairwise training of the LMVU ranker (METHODS.md §2 "Ranker"): at states sampled from the training
    queries (`sample_states`), at most `max_pairs_per_state` pairs of fitting candidates with unequal true gain
    (`true_gain`), drawn without replacement; input = the standardised feature difference x_a - x_b, label =
    gain_a > gain_b, pair orientations shuffled so that the labels are balanced. Features are standardised by
    the mean and scale of every training candidate's features (scale 1 for a constant feature). One logistic
    regression without intercept per C in `Cs`; the C with the best dev pairwise accuracy (ties to the smaller
    C) gives the ranker. All sampling uses one numpy Generator seeded with `seed`."""
    if gain not in GAINS:
        raise ValueError(f"gain must be one of {GAINS}; got {gain!r}")
    if not Cs or any(not c > 0 for c in Cs):
        raise ValueError(f"Cs must be positive regularisation strengths; got {tuple(Cs)}")
    if max_pairs_per_state < 1 or states_per_query < 1:
        raise ValueError("states_per_query and max_pairs_per_state must be at least 1")
    rng = np.random.default_rng(seed)
    train_x, train_y, candidates = _pairs(train, budgets, states_per_query, max_pairs_per_state, gain, roll_in, rng)
    dev_x, dev_y, _ = _pairs(dev, budgets, states_per_query, max_pairs_per_state, gain, roll_in, rng)
    if not len(train_y) or not len(dev_y):
        raise ValueError(f"no candidate pairs with unequal gain ({len(train_y)} train, {len(dev_y)} dev): the "
                         f"queries need items covering gold viewpoints that fit the budgets {list(budgets)}")
    mean, scale = candidates.mean(axis=0), candidates.std(axis=0)
    scale[scale <= SPAN_TOLERANCE] = 1.0
    train_x, dev_x = train_x / scale, dev_x / scale  # (x_a - mean)/scale - (x_b - mean)/scale
    models = {}
    for c in sorted(float(c) for c in Cs):
        models[c] = LogisticRegression(C=c, fit_intercept=False, max_iter=1000).fit(train_x, train_y).coef_[0]
    accuracy = {c: float(np.mean((dev_x @ coef > 0) == dev_y)) for c, coef in models.items()}
    chosen = max(accuracy, key=lambda c: (accuracy[c], -c))
    ranker = LMVURanker(feature_names=FEATURE_NAMES, mean=mean, scale=scale, coef=models[chosen], C=chosen,
                        gain=gain)
    return TrainedLMVU(ranker=ranker, dev_accuracy=accuracy, C=chosen, train_pairs=len(train_y),
                       dev_pairs=len(dev_y))


def heldout_top1_accuracy(ranker: LMVURanker, pools: Sequence[LabelledPool], budgets: Sequence[Budget], *,
                          states_per_query: int = 10, seed: int = 0,
                          roll_in: Sequence[str] = ROLL_IN_POLICIES) -> tuple[float, float]:
    """How often the ranker's top candidate has the largest true gain (the ranker's `gain`) at states sampled as
    in training (`sample_states`), and the chance rate: the mean over the same states of the share of
    candidates with the largest gain. States where every candidate has the same gain are skipped (any pick is
    best there). The top candidate is chosen as `LMVU` chooses: ties to the more relevant item, then lower index."""
    hits, chance = [], []
    for labelled, state in sample_states(pools, budgets, states_per_query, np.random.default_rng(seed), roll_in):
        candidates = state.candidates()
        candidates = candidates[np.argsort(-labelled.pool.relevance[candidates], kind="stable")]
        gains = true_gain(labelled.gold, state, candidates, ranker.gain)
        if gains.min() == gains.max():
            continue
        top = int(np.argmax(ranker.scores(state.features()[candidates])))
        hits.append(gains[top] == gains.max())
        chance.append(np.mean(gains == gains.max()))
    if not hits:
        raise ValueError("no sampled state has candidates of unequal gain: nothing to evaluate")
    return float(np.mean(hits)), float(np.mean(chance))


def _pairs(pools: Sequence[LabelledPool], budgets: Sequence[Budget], states_per_query: int, max_pairs: int,
           gain: str, roll_in: Sequence[str], rng: np.random.Generator):
    """Raw feature differences and labels of the candidate pairs at sampled states, and the features of every
    candidate seen (for standardisation)."""
    width = len(FEATURE_NAMES)
    differences, labels, seen = [np.zeros((0, width))], [np.zeros(0, dtype=bool)], [np.zeros((0, width))]
    for labelled, state in sample_states(pools, budgets, states_per_query, rng, roll_in):
        candidates = state.candidates()
        features = state.features()[candidates]
        seen.append(features)
        gains = true_gain(labelled.gold, state, candidates, gain)
        first, second = np.triu_indices(len(candidates), k=1)
        unequal = gains[first] != gains[second]
        first, second = first[unequal], second[unequal]
        if len(first) > max_pairs:
            keep = rng.choice(len(first), size=max_pairs, replace=False)
            first, second = first[keep], second[keep]
        larger_first = rng.permutation(np.arange(len(first)) % 2 == 0)  # balanced labels, random orientation
        higher = np.where(gains[first] > gains[second], first, second)
        lower = first + second - higher
        a, b = np.where(larger_first, higher, lower), np.where(larger_first, lower, higher)
        differences.append(features[a] - features[b])
        labels.append(larger_first)
    return np.concatenate(differences), np.concatenate(labels), np.concatenate(seen)


def _gold_greedy(labelled: LabelledPool, budget: Budget) -> np.ndarray:
    """The gold greedy roll-in: each step the fitting item covering the most uncovered gold viewpoints per unit of
    budget (ties by relevance, then lower index), until no fitting item covers a new one."""
    order = relevance_order(labelled.pool)
    costs = budget.costs(labelled.pool.tokens, labelled.pool.size)[order]
    covers = labelled.gold[order].astype(float)
    open_viewpoints = np.ones(covers.shape[1])

    def add(best: int) -> None:
        open_viewpoints[covers[best] > 0] = 0.0

    chosen, _, _ = greedy(costs, budget, lambda: (covers @ open_viewpoints) / costs, add, stop_at_nonpositive=True)
    return order[chosen]


def _feature_mismatch(names: Sequence[str]) -> str:
    names = tuple(names)
    missing = [name for name in FEATURE_NAMES if name not in names]
    extra = [name for name in names if name not in FEATURE_NAMES]
    detail = (f"missing {missing}, unknown {extra}" if missing or extra
              else "the same names in another order")
    return (f"this LMVU ranker was trained on other features than this code computes ({detail}); FEATURE_NAMES "
            f"is {list(FEATURE_NAMES)}: retrain it")
