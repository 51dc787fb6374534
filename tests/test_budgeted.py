"""Budgeted selectors (models/budgeted.py; METHODS.md §2 baselines, §3 AdaGReS, §5 MMR and facility location):
every selection fits its budget, the equivalences that pin the definitions down (MMR at lambda 1 and AdaGReS
at beta 0 are relevance order; coverage greedy under a k budget is models/selection.py's greedy), known
answers computed by hand, and the batched path (select_batch, the lockstep greedy loop, the fill) giving
exactly what the per-pool path gives."""

import numpy as np
import pytest

from covlab.models import budgeted
from covlab.models.budgeted import (MMR, SELECTORS, AdaGReS, Budget, CoverageGreedy, FacilityLocation, Pool,
                                    RelevanceOrder, Selector, _budgeted_greedy, _fill, _greedy_batch, adaptive_beta,
                                    select_batch)
from covlab.models.selection import greedy_coverage, soft_greedy_coverage

INSTANCES = 300


def unit_rows(matrix) -> np.ndarray:
    matrix = np.asarray(matrix, dtype=float)
    return matrix / np.linalg.norm(matrix, axis=1, keepdims=True)


def random_pool(rng: np.random.Generator, n_items: int, tied_relevance: bool = False) -> Pool:
    """A pool of n_items in 4 dimensions, some duplicated rows (exact similarity ties), token costs 1..20,
    coverage probabilities over 0..5 viewpoints and source units shared by about two items each."""
    embeddings = unit_rows(rng.normal(size=(max(n_items, 1), 4)))[:n_items]
    if n_items > 2:
        embeddings[-1] = embeddings[0]
    n_viewpoints = int(rng.integers(0, 6))
    covers = rng.random((n_items, n_viewpoints)) * (rng.random((n_items, n_viewpoints)) < 0.4)
    relevance = np.round(rng.random(n_items), 1) if tied_relevance else None
    return Pool(embeddings=embeddings, query=rng.normal(size=4), tokens=rng.integers(1, 21, n_items),
                relevance=relevance, covers=covers, source_units=rng.integers(0, max(n_items // 2, 1), n_items))


def random_budget(rng: np.random.Generator, pool: Pool) -> Budget:
    if rng.random() < 0.5:
        return Budget(k=int(rng.integers(0, pool.size + 2)))
    return Budget(tokens=int(rng.integers(0, int(pool.tokens.sum()) + 5)))


def random_cases(seed: int, **pool_options):
    rng = np.random.default_rng(seed)
    for _ in range(INSTANCES):
        pool = random_pool(rng, int(rng.integers(0, 11)), **pool_options)
        yield pool, random_budget(rng, pool)


VARIANTS = SELECTORS + (MMR(0.0), MMR(0.3), MMR(1.0), AdaGReS(alpha=2.0, beta=0.5),
                        AdaGReS(stop_on_nonpositive_gain=True), CoverageGreedy(soft=False, tau=0.7))


def test_every_selection_fits_its_budget_with_distinct_valid_indices():
    for pool, budget in random_cases(0, tied_relevance=True):
        for select in VARIANTS:
            chosen = select(pool, budget)
            assert chosen.ndim == 1 and np.issubdtype(chosen.dtype, np.integer), select.name
            assert len(np.unique(chosen)) == len(chosen), select.name
            assert ((chosen >= 0) & (chosen < pool.size)).all(), select.name
            spent = len(chosen) if budget.k is not None else pool.tokens[chosen].sum()
            assert spent <= budget.limit, (select.name, budget, chosen)


def test_selectors_share_one_typed_interface():
    assert [s.name for s in SELECTORS] == ["relevance", "mmr_0.5", "facloc", "adagres", "coverage_soft",
                                           "coverage_hard_tau0.3"]
    for select in VARIANTS:
        assert isinstance(select, Selector)
        with pytest.raises(AttributeError):
            select.name = "renamed"  # frozen: a selector is its parameters


def test_selectors_stop_only_when_nothing_fits():
    """Every selector except the early-stopping AdaGReS variant leaves no unselected item that still fits."""
    for pool, budget in random_cases(1):
        for select in SELECTORS:
            chosen = select(pool, budget)
            if len(chosen) == 1 and isinstance(select, FacilityLocation):
                continue  # the best single item may win over the greedy set and leave room
            spent = len(chosen) if budget.k is not None else int(pool.tokens[chosen].sum())
            rest = np.setdiff1d(np.arange(pool.size), chosen)
            assert not budget.fits(spent, budget.costs(pool.tokens)[rest]).any(), (select.name, budget)


def test_relevance_order_skips_what_does_not_fit():
    # By hand: relevance 0.9 > 0.8 > 0.7; item 0 (5 tokens) fits, item 1 (10) does not, item 2 (3) does: 8 <= 9.
    pool = Pool(embeddings=np.eye(3), query=np.ones(3), tokens=np.array([5, 10, 3]),
                relevance=np.array([0.9, 0.8, 0.7]))
    assert RelevanceOrder()(pool, Budget(tokens=9)).tolist() == [0, 2]
    assert RelevanceOrder()(pool, Budget(k=2)).tolist() == [0, 1]


# Known selections on seeded random pools (random_pool(default_rng(seed), 12 items, tied relevance for odd
# seeds)), one per PINNED_SELECTORS entry under Budget(k=5) and Budget(tokens=45): they pin every tie-break
# and stopping rule, so a change to the shared greedy loop that moves a single index fails here.
PINNED_SELECTORS = SELECTORS + (AdaGReS(stop_on_nonpositive_gain=True),)
PINNED_SELECTIONS = {
    (1, "k"): [[10, 11, 0, 9, 1], [10, 2, 11, 3, 9], [6, 11, 2, 4, 5], [4, 1, 10, 11, 3], [2, 8, 6, 1, 9],
               [2, 10, 11, 0, 9], [4, 1, 10, 11, 3]],
    (1, "tokens"): [[10, 11, 0, 9, 6, 7], [10, 2, 11, 3, 9], [6, 7, 2, 11, 4, 3], [4, 1, 10, 11, 6],
                    [6, 7, 2, 10, 8, 9], [7, 6, 10, 11, 0, 9], [4, 1, 10, 11]],
    (2, "k"): [[0, 11, 6, 10, 9], [0, 6, 10, 7, 11], [0, 8, 3, 10, 6], [0, 1, 7, 9, 3], [3, 2, 5, 0, 11],
               [3, 0, 11, 6, 10], [0, 1, 7, 9, 3]],
    (2, "tokens"): [[0, 11, 6, 10, 4], [0, 6, 10, 7, 11, 2, 8, 3], [8, 7, 0, 10, 2, 6, 3, 1],
                    [0, 1, 7, 9, 3, 8, 10], [3, 2, 5, 0, 11, 7, 8], [3, 0, 11, 6, 10, 7, 2, 8], [0, 1, 7, 9, 3, 8]],
    (5, "k"): [[4, 2, 0, 6, 5], [4, 2, 6, 5, 0], [8, 3, 0, 10, 1], [7, 1, 0, 2, 11], [8, 10, 11, 4, 1],
               [8, 4, 2, 0, 6], [7, 1, 0, 2, 11]],
    (5, "tokens"): [[4, 2, 0, 6, 7], [4, 2, 6, 0, 7], [0, 3, 10, 7, 4], [7, 1, 0, 2, 3], [0, 1, 10, 8],
                    [0, 1, 4, 2, 3], [7, 1, 0, 2]],
}


def test_selections_are_pinned_on_seeded_pools():
    for (seed, kind), expected in PINNED_SELECTIONS.items():
        pool = random_pool(np.random.default_rng(seed), 12, tied_relevance=seed % 2 == 1)
        budget = Budget(k=5) if kind == "k" else Budget(tokens=45)
        for select, indices in zip(PINNED_SELECTORS, expected, strict=True):
            assert select(pool, budget).tolist() == indices, (seed, kind, select.name)


def test_mmr_with_lambda_one_is_relevance_order():
    for pool, budget in random_cases(2, tied_relevance=True):
        assert MMR(1.0)(pool, budget).tolist() == RelevanceOrder()(pool, budget).tolist()


def test_mmr_by_hand():
    # q = e1; items: a = e1 (cos 1), b = (0.8, 0.6) (cos 0.8, sim(a, b) = 0.8), c = e2 (cos 0, sim(a, c) = 0,
    # sim(b, c) = 0.6). lam = 0.5: step 1 a (0.5); step 2 b: 0.4 - 0.4 = 0, c: 0 - 0 = 0, a tie that goes to
    # the more relevant b; step 3 c. With lam = 0.3: step 2 b: 0.24 - 0.56 < 0 = c, so c comes before b.
    pool = Pool(embeddings=np.array([[1, 0], [0.8, 0.6], [0, 1]]), query=np.array([1.0, 0]),
                tokens=np.ones(3, dtype=int))
    assert MMR(0.5)(pool, Budget(k=3)).tolist() == [0, 1, 2]
    assert MMR(0.3)(pool, Budget(k=3)).tolist() == [0, 2, 1]


def test_adagres_with_beta_zero_is_relevance_order():
    for pool, budget in random_cases(3):
        assert AdaGReS(beta=0.0)(pool, budget).tolist() == RelevanceOrder()(pool, budget).tolist()


def three_item_pool() -> Pool:
    # e1, e2 and (0.6, 0.8, 0); q = e1; tokens 100, 200, 300 (mean 200).
    return Pool(embeddings=np.array([[1, 0, 0], [0, 1, 0], [0.6, 0.8, 0]]), query=np.array([1.0, 0, 0]),
                tokens=np.array([100, 200, 300]))


def test_adaptive_beta_by_hand():
    pool = three_item_pool()
    # mean_qc = (1 + 0 + 0.6) / 3 = 1.6 / 3; mean_cc = (s12 + s13 + s23) / 3 = (0 + 0.6 + 0.8) / 3 = 1.4 / 3.
    # B = 600: k_bar = floor(600 / 200) = 3, beta* = (1.6 / 3) / (((3 - 1) / 2) * (1.4 / 3)) = 1.6 / 1.4 = 8 / 7.
    assert adaptive_beta(pool, Budget(tokens=600)) == pytest.approx(8 / 7)
    assert adaptive_beta(pool, Budget(tokens=600), alpha=2.0) == pytest.approx(16 / 7)
    # B = 599: k_bar = floor(2.995) = 2, beta* = (1.6 / 3) / ((1 / 2) * (1.4 / 3)) = 16 / 7.
    assert adaptive_beta(pool, Budget(tokens=599)) == pytest.approx(16 / 7)
    # A k budget is k_bar itself.
    assert adaptive_beta(pool, Budget(k=3)) == pytest.approx(8 / 7)
    # k_bar = floor(300 / 200) = 1, and orthogonal items (mean_cc = 0): the fallback 0.01.
    assert adaptive_beta(pool, Budget(tokens=300)) == 0.01
    orthogonal = Pool(embeddings=np.eye(3), query=np.ones(3), tokens=np.array([100, 200, 300]))
    assert adaptive_beta(orthogonal, Budget(tokens=600)) == 0.01


def test_adagres_by_hand():
    pool = three_item_pool()
    # B = 400, beta* = 16 / 7 (k_bar = 2). Step 1: gains 1, 0, 0.6 -> item 0 (100 tokens). Step 2: item 1
    # 0 - beta * 0 = 0, item 2 0.6 - beta * 0.6 < 0 -> item 1 (300 tokens); item 2 no longer fits.
    assert AdaGReS()(pool, Budget(tokens=400)).tolist() == [0, 1]
    assert RelevanceOrder()(pool, Budget(tokens=400)).tolist() == [0, 2]
    # Stopping on a non-positive gain ends after item 0, whose successor's best gain is exactly 0.
    assert AdaGReS(stop_on_nonpositive_gain=True)(pool, Budget(tokens=400)).tolist() == [0]
    # B = 600: beta* = 8 / 7, the same first two steps, then item 2 fits (600 tokens).
    assert AdaGReS()(pool, Budget(tokens=600)).tolist() == [0, 1, 2]


def test_facility_location_returns_the_best_single_item_when_it_beats_the_greedy_set():
    # Item 0 = e1 costs 1 token and is orthogonal to the rest: f({0}) = 1, ratio 1. Items 1-3 cost 10 tokens
    # and sit around e2: f({1}) = 1 + 2 / sqrt(1.01) ~ 2.99, ratio ~0.3. With B = 10 the cost-scaled greedy
    # takes item 0, after which nothing fits (value 1); the best single item, 1, is worth ~2.99.
    embeddings = unit_rows([[1, 0, 0], [0, 1, 0], [0, 1, 0.1], [0, 1, -0.1]])
    pool = Pool(embeddings=embeddings, query=np.array([1.0, 1, 0]), tokens=np.array([1, 10, 10, 10]))
    assert FacilityLocation()(pool, Budget(tokens=10)).tolist() == [1]
    # With B = 11 the greedy set {0, 1} (value ~3.99) beats every single item.
    assert FacilityLocation()(pool, Budget(tokens=11)).tolist() == [0, 1]


def test_coverage_greedy_under_a_k_budget_is_the_selection_greedy():
    for pool, budget in random_cases(4, tied_relevance=True):
        k = budget.k if budget.k is not None else pool.size
        hard = greedy_coverage(pool.covers >= 0.3, pool.relevance, k)
        soft = soft_greedy_coverage(pool.covers, pool.relevance, k)
        assert CoverageGreedy(soft=False)(pool, Budget(k=k)).tolist() == hard.tolist()
        assert CoverageGreedy(soft=True)(pool, Budget(k=k)).tolist() == soft.tolist()


def test_coverage_greedy_gain_per_token_then_relevance_fill():
    # Item 0 covers {0, 1} for 10 tokens (0.2 per token), items 1 and 2 cover {0} and {1} for 2 tokens
    # (0.5 each; the tie goes to the more relevant item 2), item 3 covers nothing but is the most relevant.
    # B = 6: item 2, then item 1 (4 tokens); nothing adds coverage, so fill by relevance: item 3 (5 tokens);
    # item 0 does not fit.
    covers = np.array([[1, 1], [1, 0], [0, 1], [0, 0]])
    pool = Pool(embeddings=np.eye(4), query=np.ones(4), tokens=np.array([10, 2, 2, 1]),
                relevance=np.array([0.1, 0.2, 0.3, 0.9]), covers=covers)
    for soft in (True, False):
        assert CoverageGreedy(soft=soft)(pool, Budget(tokens=6)).tolist() == [2, 1, 3]
    # Expected coverage: 0.9 * 1 for item 0 (10 tokens: 0.09 per token) against 0.5 for item 1 (2 tokens:
    # 0.25 per token), so item 1, then item 0 (0.45 / 10), then the fill: 3, 2. Hard coverage at tau = 0.3
    # sees viewpoint 0 in both: item 1 (1 / 2 per token), after which nothing adds coverage: fill 3, 2, 0.
    probs = np.array([[0.9, 0.0], [0.5, 0.0], [0.0, 0.0], [0.0, 0.0]])
    pool = Pool(embeddings=np.eye(4), query=np.ones(4), tokens=np.array([10, 2, 2, 1]),
                relevance=np.array([0.1, 0.2, 0.3, 0.9]), covers=probs)
    assert CoverageGreedy(soft=True)(pool, Budget(tokens=20)).tolist() == [1, 0, 3, 2]
    assert CoverageGreedy(soft=False)(pool, Budget(tokens=20)).tolist() == [1, 3, 2, 0]


def test_budget_pool_and_selector_refusals():
    for bad in ({}, {"k": 1, "tokens": 2}, {"k": -1}, {"tokens": 1.5}, {"k": True}):
        with pytest.raises(ValueError, match="Budget"):
            Budget(**bad)
    with pytest.raises(ValueError, match="L2-normalised"):
        Pool(embeddings=np.array([[1.0, 1.0]]), query=np.ones(2), tokens=np.array([1]))
    with pytest.raises(ValueError, match="positive integers"):
        Pool(embeddings=np.eye(2), query=np.ones(2), tokens=np.array([1, 0]))
    with pytest.raises(ValueError, match="query"):
        Pool(embeddings=np.eye(2), query=np.zeros(2), tokens=np.array([1, 1]))
    with pytest.raises(ValueError, match="covers"):
        CoverageGreedy(soft=True)(Pool(embeddings=np.eye(2), query=np.ones(2), tokens=np.array([1, 1])),
                                  Budget(k=1))
    with pytest.raises(ValueError, match="lam"):
        MMR(1.5)


def test_select_batch_returns_exactly_the_per_pool_selections():
    """select_batch over batches of pools of different sizes (empty ones too), viewpoint counts, tied
    relevance, duplicated rows, items that do not fit, 0/1 coverage (one stacked product for the batch) and
    probabilities (a product per pool), under k and token budgets: what each pool gets alone."""
    rng = np.random.default_rng(9)
    for round_ in range(150):
        pools = [random_pool(rng, int(rng.integers(0, 15)), tied_relevance=bool(rng.integers(2)))
                 for _ in range(int(rng.integers(1, 7)))]
        if round_ % 3 == 0:  # 0/1 coverage throughout
            pools = [Pool(embeddings=p.embeddings, query=p.query, tokens=p.tokens, relevance=p.relevance,
                          covers=(p.covers > 0.5).astype(float), source_units=p.source_units) for p in pools]
        budget = random_budget(rng, pools[int(rng.integers(len(pools)))])
        for select in VARIANTS:
            expected = [select(pool, budget).tolist() for pool in pools]
            assert [chosen.tolist() for chosen in select_batch(select, pools, budget)] == expected, select.name
    assert select_batch(MMR(), [], Budget(k=3)) == []


def test_a_batch_row_goes_as_the_greedy_loop_goes_on_it_alone():
    """_greedy_batch (lockstep rows) against _budgeted_greedy (one pool): state-dependent scores with ties
    and non-positive values, integer and float costs, with and without stopping at a non-positive score."""
    rng = np.random.default_rng(10)
    for _ in range(200):
        n_pools, n_items = int(rng.integers(1, 6)), int(rng.integers(1, 12))
        float_costs = bool(rng.integers(2))
        sizes = rng.integers(0, n_items + 1, n_pools)
        # Quarters: every sum is exact, whichever order a product adds up in; ties are frequent.
        base = rng.integers(-4, 5, (n_pools, n_items)) / 4
        interaction = rng.integers(0, 3, (n_pools, n_items, n_items)) / 4
        costs = rng.integers(1, 8, (n_pools, n_items)) * (0.5 if float_costs else 1)
        limit = int(rng.integers(0, 25))
        stop = bool(rng.integers(2))
        expected = []
        for row, size in enumerate(sizes):
            taken = np.zeros(size)
            picked, spent = _budgeted_greedy(costs[row, :size], Budget(tokens=limit),
                                             lambda: base[row, :size] - interaction[row, :size, :size] @ taken,
                                             lambda best: taken.__setitem__(best, 1.0), stop_at_nonpositive=stop)
            expected.append((picked.tolist(), spent))
        taken = np.zeros((n_pools, n_items))
        available = np.arange(n_items)[None, :] < sizes[:, None]

        def scores(rows):
            return base - np.einsum("bij,bj->bi", interaction, taken)

        def add(rows, best):
            taken[rows, best] = 1.0

        chosen, used = _greedy_batch(costs, np.full(n_pools, limit), available, scores, add, stop)
        assert [(c, u) for c, u in zip(chosen, used.tolist())] == expected


def test_fill_is_the_walk_that_adds_every_item_that_still_fits():
    rng = np.random.default_rng(12)
    for _ in range(300):
        n_items = int(rng.integers(0, 15))
        costs = rng.integers(1, 10, n_items) * (0.25 if rng.integers(2) else 1)
        budget = Budget(tokens=int(rng.integers(0, 40)))
        walk = rng.permutation(n_items)[:int(rng.integers(0, n_items + 1))]
        used = costs[:2].sum() if budget.tokens >= costs[:2].sum() else 0
        expected, spent = [7], used
        for item in walk:  # the definition: Budget.fits item by item
            if budget.fits(spent, costs[item]):
                expected.append(int(item))
                spent += costs[item]
        assert _fill(walk, costs, budget, used, [7]).tolist() == expected


def test_facility_location_batched_equals_per_pool_on_mixed_pools(monkeypatch):
    """Facility location through select_batch (the lockstep over several pools' own similarity matrices)
    against each pool alone (the plain greedy loop): a few hundred pools of 0-60 items in 4 or 384
    dimensions, a quarter of each pool's rows duplicated (exact similarity ties), tied relevance, k and token
    budgets (some pools stopping long before others), whole batches in one lockstep group and split into
    groups of a few pools."""
    rng = np.random.default_rng(13)
    checked = 0
    for round_ in range(60):
        dim = 384 if round_ % 2 else 4
        pools = []
        for _ in range(int(rng.integers(2, 10))):
            n_items = int(rng.integers(0, 61))
            embeddings = unit_rows(rng.normal(size=(max(n_items, 1), dim)) + 0.2)[:n_items]
            if n_items > 3:
                copies = rng.choice(n_items, size=n_items // 4, replace=False)
                embeddings[rng.permutation(n_items)[:len(copies)]] = embeddings[copies]
            relevance = np.round(rng.random(n_items), 1) if rng.integers(2) else None
            pools.append(Pool(embeddings=embeddings, query=rng.normal(size=dim) + 0.2,
                              tokens=rng.integers(1, 40, n_items), relevance=relevance))
        budget = (Budget(k=int(rng.integers(0, 30))) if rng.integers(2)
                  else Budget(tokens=int(rng.integers(0, 700))))
        monkeypatch.setattr(budgeted, "LOCKSTEP_BYTES", 1 << 20 if round_ % 4 < 2 else 3 * 2 * 60 * 60 * 8)
        expected = [FacilityLocation()(pool, budget).tolist() for pool in pools]
        assert [chosen.tolist() for chosen in select_batch(FacilityLocation(), pools, budget)] == expected
        checked += len(pools)
    assert checked >= 200
