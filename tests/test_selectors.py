"""Selectors (models/selectors.py; METHODS.md §1 greedy, §2 baselines and exact oracles, §3 AdaGReS, §5 MMR and
facility location): every Selection fits its budget, the equivalences that pin the definitions down (MMR at
lambda 1 and AdaGReS at beta 0 are relevance order; coverage greedy under a k budget is the paper's greedy max
coverage; Blend at weight 0 is relevance order and at weight 1 the selector it wraps), known answers computed by
hand (items and their step gains), selectors refusing a pool without what they need, the exact oracles as
selectors, and the batched path (select_batch, the lockstep greedy loop, the fill) giving exactly what the
per-pool path gives."""

import numpy as np
import pytest

from covlab.models import selectors
from covlab.models.oracles import rvc1_oracle, rvc2_oracle
from covlab.models.selectors import (MMR, AdaGReS, Blend, Budget, CoverageGreedy, ExactOracle, FacilityLocation,
                                     Pool, Refused, RelevanceOrder, Selection, Selector, _greedy_lockstep,
                                     adaptive_beta, fill, greedy, select_batch)

INSTANCES = 300
# The default line-up of the token comparison's selectors that need no trained model and read no gold labels.
LINEUP = (RelevanceOrder(), MMR(0.5), FacilityLocation(), AdaGReS(), CoverageGreedy(soft=True),
          CoverageGreedy(soft=False))


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


VARIANTS = LINEUP + (MMR(0.0), MMR(0.3), MMR(1.0), AdaGReS(alpha=2.0, beta=0.5),
                     AdaGReS(stop_on_nonpositive_gain=True), CoverageGreedy(soft=False, tau=0.7),
                     Blend(CoverageGreedy(soft=True), 0.5), Blend(CoverageGreedy(soft=False), 0.25),
                     Blend(MMR(0.5), 0.5))


def spent(pool: Pool, budget: Budget, items: np.ndarray) -> int:
    return len(items) if budget.k is not None else int(pool.tokens[items].sum())


def test_every_selection_fits_its_budget_with_distinct_valid_indices():
    for pool, budget in random_cases(0, tied_relevance=True):
        for select in VARIANTS:
            selection = select(pool, budget)
            assert isinstance(selection, Selection), select.name
            chosen = selection.items
            assert chosen.ndim == 1 and np.issubdtype(chosen.dtype, np.integer), select.name
            assert len(np.unique(chosen)) == len(chosen) == len(selection), select.name
            assert ((chosen >= 0) & (chosen < pool.size)).all(), select.name
            assert spent(pool, budget, chosen) <= budget.limit, (select.name, budget, chosen)
            assert selection.gains.shape == chosen.shape, select.name
            assert selection.tokens == int(pool.tokens[chosen].sum()), select.name
            assert not chosen.flags.writeable and not selection.gains.flags.writeable, select.name


def test_selectors_share_one_typed_interface():
    assert [s.name for s in LINEUP] == ["relevance", "mmr_0.5", "facloc", "adagres", "coverage_soft",
                                        "coverage_hard_tau0.3"]
    assert Blend(CoverageGreedy(soft=True), 1.0).name == "coverage_soft"
    assert Blend(CoverageGreedy(soft=True), 0.25).name == "coverage_soft_blend0.25"
    assert [ExactOracle("rvc1").name, ExactOracle("rvc2").name] == ["oracle_rvc1", "oracle_rvc2"]
    for select in VARIANTS + (ExactOracle("rvc1"), ExactOracle("rvc2")):
        assert isinstance(select, Selector)
        with pytest.raises(AttributeError):
            select.name = "renamed"  # frozen: a selector is its parameters


def test_selectors_stop_only_when_nothing_fits():
    """Every selector of the line-up leaves no unselected item that still fits (the early-stopping AdaGReS
    variant is not in it)."""
    for pool, budget in random_cases(1):
        for select in LINEUP:
            chosen = select(pool, budget).items
            if len(chosen) == 1 and isinstance(select, FacilityLocation):
                continue  # the best single item may win over the greedy set and leave room
            rest = np.setdiff1d(np.arange(pool.size), chosen)
            assert not budget.fits(spent(pool, budget, chosen), budget.costs(pool.tokens)[rest]).any(), \
                (select.name, budget)


def test_relevance_order_skips_what_does_not_fit():
    # By hand: relevance 0.9 > 0.8 > 0.7; item 0 (5 tokens) fits, item 1 (10) does not, item 2 (3) does: 8 <= 9.
    pool = Pool(embeddings=np.eye(3), query=np.ones(3), tokens=np.array([5, 10, 3]),
                relevance=np.array([0.9, 0.8, 0.7]))
    selection = RelevanceOrder()(pool, Budget(tokens=9))
    assert selection.items.tolist() == [0, 2] and selection.tokens == 8
    assert selection.gains.tolist() == [0.9, 0.7]  # relevance order's gains are the relevance scores
    assert RelevanceOrder()(pool, Budget(k=2)).items.tolist() == [0, 1]
    # A pool of relevance scores alone (no embeddings, no tokens) under a k budget: no token total.
    bare = RelevanceOrder()(Pool(relevance=np.array([0.3, 0.9, 0.3, 0.1])), Budget(k=3))
    assert bare.items.tolist() == [1, 0, 2] and bare.gains.tolist() == [0.9, 0.3, 0.3] and bare.tokens is None


# Known selections on seeded random pools (random_pool(default_rng(seed), 12 items, tied relevance for odd
# seeds)), one per PINNED_SELECTORS entry under Budget(k=5) and Budget(tokens=45): they pin every tie-break
# and stopping rule, so a change to the shared greedy loop that moves a single index fails here.
PINNED_SELECTORS = LINEUP + (AdaGReS(stop_on_nonpositive_gain=True),)
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
            assert select(pool, budget).items.tolist() == indices, (seed, kind, select.name)


def test_mmr_with_lambda_one_is_relevance_order():
    for pool, budget in random_cases(2, tied_relevance=True):
        assert MMR(1.0)(pool, budget).items.tolist() == RelevanceOrder()(pool, budget).items.tolist()


def test_mmr_by_hand():
    # q = e1; items: a = e1 (cos 1), b = (0.8, 0.6) (cos 0.8, sim(a, b) = 0.8), c = e2 (cos 0, sim(a, c) = 0,
    # sim(b, c) = 0.6). lam = 0.5: step 1 a (0.5); step 2 b: 0.4 - 0.4 = 0, c: 0 - 0 = 0, a tie that goes to
    # the more relevant b; step 3 c: 0 - 0.5 * 0.6 = -0.3. With lam = 0.3: step 2 b: 0.24 - 0.56 < 0 = c, so c
    # comes before b: 0.24 - 0.7 * 0.8 = -0.32.
    pool = Pool(embeddings=np.array([[1, 0], [0.8, 0.6], [0, 1]]), query=np.array([1.0, 0]),
                tokens=np.ones(3, dtype=int))
    half = MMR(0.5)(pool, Budget(k=3))
    assert half.items.tolist() == [0, 1, 2]
    assert half.gains.tolist() == pytest.approx([0.5, 0.0, -0.3], abs=1e-12)
    low = MMR(0.3)(pool, Budget(k=3))
    assert low.items.tolist() == [0, 2, 1]
    assert low.gains.tolist() == pytest.approx([0.3, 0.0, -0.32], abs=1e-12)


def test_adagres_with_beta_zero_is_relevance_order():
    for pool, budget in random_cases(3):
        assert AdaGReS(beta=0.0)(pool, budget).items.tolist() == RelevanceOrder()(pool, budget).items.tolist()


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
    chosen = AdaGReS()(pool, Budget(tokens=400))
    assert chosen.items.tolist() == [0, 1] and chosen.tokens == 300
    assert chosen.gains.tolist() == pytest.approx([1.0, 0.0], abs=1e-12)
    assert RelevanceOrder()(pool, Budget(tokens=400)).items.tolist() == [0, 2]
    # Stopping on a non-positive gain ends after item 0, whose successor's best gain is exactly 0.
    assert AdaGReS(stop_on_nonpositive_gain=True)(pool, Budget(tokens=400)).items.tolist() == [0]
    # B = 600: beta* = 8 / 7, the same first two steps, then item 2: 0.6 - (8 / 7) * (0.6 + 0.8) = -1.
    chosen = AdaGReS()(pool, Budget(tokens=600))
    assert chosen.items.tolist() == [0, 1, 2]
    assert chosen.gains.tolist() == pytest.approx([1.0, 0.0, -1.0], abs=1e-12)


def test_facility_location_returns_the_best_single_item_when_it_beats_the_greedy_set():
    # Item 0 = e1 costs 1 token and is orthogonal to the rest: f({0}) = 1, ratio 1. Items 1-3 cost 10 tokens
    # and sit around e2: f({1}) = 1 + 2 / sqrt(1.01) ~ 2.99, ratio ~0.3. With B = 10 the cost-scaled greedy
    # takes item 0, after which nothing fits (value 1); the best single item, 1, is worth ~2.99.
    embeddings = unit_rows([[1, 0, 0], [0, 1, 0], [0, 1, 0.1], [0, 1, -0.1]])
    pool = Pool(embeddings=embeddings, query=np.array([1.0, 1, 0]), tokens=np.array([1, 10, 10, 10]))
    single = FacilityLocation()(pool, Budget(tokens=10))
    assert single.items.tolist() == [1]
    assert single.gains.tolist() == pytest.approx([(1 + 2 / np.sqrt(1.01)) / 10])  # f({1}) per token
    # With B = 11 the greedy set {0, 1} (value ~3.99) beats every single item: gains f({0}) / 1, then
    # f({0, 1}) - f({0}) ~ 2.99 per 10 tokens.
    pair = FacilityLocation()(pool, Budget(tokens=11))
    assert pair.items.tolist() == [0, 1]
    assert pair.gains.tolist() == pytest.approx([1.0, (1 + 2 / np.sqrt(1.01)) / 10])


def reference_greedy(probs: np.ndarray, tie_break: np.ndarray, k: int, weight: float = 1.0) -> np.ndarray:
    """The paper's greedy max coverage on expected coverage (METHODS.md §1) written out as its definition, as
    the k selections ran it before the one selector interface: rows in tie-break order (higher first, then
    lower index), each step argmax weight * sum_j p_dj * open_j + (1 - weight) * m * (1 - rank / n) among the
    remaining rows, stopping at a score <= 0, then the rest in tie-break order up to k."""
    n_docs, n_subquestions = probs.shape
    order = np.argsort(-tie_break, kind="stable")
    ranked = probs[order]
    fallback = (1.0 - weight) * n_subquestions * (1.0 - np.arange(n_docs) / max(n_docs, 1))
    uncovered = np.ones(n_subquestions)
    available = np.ones(n_docs, dtype=bool)
    chosen: list[int] = []
    size = min(k, n_docs)
    while len(chosen) < size:
        scores = np.where(available, weight * (ranked @ uncovered) + fallback, -np.inf)
        best = int(np.argmax(scores))
        if scores[best] <= 0:
            break
        chosen.append(best)
        available[best] = False
        uncovered *= 1.0 - ranked[best]
    chosen += np.flatnonzero(available)[: size - len(chosen)].tolist()
    return order[np.asarray(chosen, dtype=int)]


def test_coverage_greedy_under_a_k_budget_is_the_papers_greedy():
    """Under a k budget every cost is 1: CoverageGreedy (hard at tau, soft) and its Blend are the written-out
    greedy of `reference_greedy`, item for item."""
    for pool, budget in random_cases(4, tied_relevance=True):
        k = budget.k if budget.k is not None else pool.size
        hard = reference_greedy((pool.covers >= 0.3).astype(float), pool.relevance, k)
        soft = reference_greedy(pool.covers, pool.relevance, k)
        assert CoverageGreedy(soft=False)(pool, Budget(k=k)).items.tolist() == hard.tolist()
        assert CoverageGreedy(soft=True)(pool, Budget(k=k)).items.tolist() == soft.tolist()
        for weight in (0.25, 0.5):
            blended = reference_greedy(pool.covers, pool.relevance, k, weight)
            assert Blend(CoverageGreedy(soft=True), weight)(pool, Budget(k=k)).items.tolist() == blended.tolist()


def test_coverage_greedy_gain_per_token_then_relevance_fill():
    # Item 0 covers {0, 1} for 10 tokens (0.2 per token), items 1 and 2 cover {0} and {1} for 2 tokens
    # (0.5 each; the tie goes to the more relevant item 2), item 3 covers nothing but is the most relevant.
    # B = 6: item 2, then item 1 (4 tokens); nothing adds coverage, so fill by relevance: item 3 (5 tokens);
    # item 0 does not fit. The fill has no score: its gain is NaN.
    covers = np.array([[1, 1], [1, 0], [0, 1], [0, 0]])
    pool = Pool(embeddings=np.eye(4), query=np.ones(4), tokens=np.array([10, 2, 2, 1]),
                relevance=np.array([0.1, 0.2, 0.3, 0.9]), covers=covers)
    for soft in (True, False):
        selection = CoverageGreedy(soft=soft)(pool, Budget(tokens=6))
        assert selection.items.tolist() == [2, 1, 3] and selection.tokens == 5
        np.testing.assert_array_equal(selection.gains, [0.5, 0.5, np.nan])
    # Expected coverage: 0.9 * 1 for item 0 (10 tokens: 0.09 per token) against 0.5 for item 1 (2 tokens:
    # 0.25 per token), so item 1, then item 0 (0.45 / 10), then the fill: 3, 2. Hard coverage at tau = 0.3
    # sees viewpoint 0 in both: item 1 (1 / 2 per token), after which nothing adds coverage: fill 3, 2, 0.
    probs = np.array([[0.9, 0.0], [0.5, 0.0], [0.0, 0.0], [0.0, 0.0]])
    pool = Pool(embeddings=np.eye(4), query=np.ones(4), tokens=np.array([10, 2, 2, 1]),
                relevance=np.array([0.1, 0.2, 0.3, 0.9]), covers=probs)
    soft = CoverageGreedy(soft=True)(pool, Budget(tokens=20))
    assert soft.items.tolist() == [1, 0, 3, 2]
    np.testing.assert_allclose(soft.gains, [0.25, 0.045, np.nan, np.nan], rtol=1e-12)
    hard = CoverageGreedy(soft=False)(pool, Budget(tokens=20))
    assert hard.items.tolist() == [1, 3, 2, 0]
    np.testing.assert_array_equal(hard.gains, [0.5, np.nan, np.nan, np.nan])


def test_gains_are_the_score_at_each_step_and_nan_only_for_fills():
    """Relevance order's gains are the items' relevance; a greedy selector's are finite at its greedy steps;
    coverage greedy's are positive there, non-increasing (a submodular gain can only shrink), and NaN exactly
    on the fill that follows."""
    for pool, budget in random_cases(5, tied_relevance=True):
        relevance = RelevanceOrder()(pool, budget)
        assert relevance.gains.tolist() == pool.relevance[relevance.items].tolist()
        for select in (MMR(0.5), FacilityLocation(), AdaGReS()):
            assert np.isfinite(select(pool, budget).gains).all(), select.name
        for select in (CoverageGreedy(soft=True), CoverageGreedy(soft=False)):
            gains = select(pool, budget).gains
            greedy_steps = int(np.isfinite(gains).sum())
            assert np.isnan(gains[greedy_steps:]).all(), select.name  # the fill comes after every greedy step
            assert (gains[:greedy_steps] > 0).all(), select.name
            # Each item's gain per unit only shrinks as coverage grows, and so does the set of items that fit:
            # the best gain never rises from one step to the next.
            assert (np.diff(gains[:greedy_steps]) <= 1e-12).all(), select.name


def test_blend_at_weight_zero_is_relevance_order_and_at_weight_one_the_selector_bit_for_bit():
    wrapped = (CoverageGreedy(soft=True), CoverageGreedy(soft=False), CoverageGreedy(soft=False, tau=0.7),
               MMR(0.5), MMR(0.3), AdaGReS())
    for pool, budget in random_cases(6, tied_relevance=True):
        relevance = RelevanceOrder()(pool, budget).items.tolist()
        for select in wrapped:
            assert Blend(select, 0.0)(pool, budget).items.tolist() == relevance, select.name
            alone, blended = select(pool, budget), Blend(select, 1.0)(pool, budget)
            np.testing.assert_array_equal(blended.items, alone.items)
            np.testing.assert_array_equal(blended.gains, alone.gains)  # exact, NaN where the fill is
            assert blended.tokens == alone.tokens


def test_blend_between_the_ends_trades_score_against_fallback_rank():
    # 2 viewpoints, relevance order d0, d1, d2 (fallback f = 1, 2/3, 1/3, times m = 2), k = 3.
    # Step 1 gains: d0 0.2, d1 1.0, d2 2.0. w = 0.5: 0.1 + 1 = 1.1, 0.5 + 0.667 = 1.167, 1 + 0.333 = 1.333
    # -> d2 (score 4/3); then every viewpoint is covered and the fallback decides: d0 (score 1), d1 (2/3).
    pool = Pool(relevance=np.array([3.0, 2.0, 1.0]), covers=np.array([[0.1, 0.1], [1.0, 0.0], [1.0, 1.0]]))
    blended = Blend(CoverageGreedy(soft=True), 0.5)(pool, Budget(k=3))
    assert blended.items.tolist() == [2, 0, 1]
    assert blended.gains.tolist() == pytest.approx([4 / 3, 1.0, 2 / 3])
    with pytest.raises(ValueError, match=r"blend weight must lie in \[0, 1\]"):
        Blend(CoverageGreedy(soft=True), 1.5)


def test_exact_oracles_are_the_oracles_of_models_oracles():
    rng = np.random.default_rng(7)
    checked = 0
    for pool, budget in random_cases(7):
        gold = (pool.covers > 0).astype(float)
        pool = Pool(embeddings=pool.embeddings, query=pool.query, tokens=pool.tokens, covers=gold,
                    source_units=pool.source_units)
        budget = Budget(tokens=int(rng.integers(0, int(pool.tokens.sum()) + 5)))
        one, two = ExactOracle("rvc1")(pool, budget), ExactOracle("rvc2")(pool, budget)
        if gold.shape[1] == 0:  # no viewpoints: no RVC, an empty selection
            assert len(one) == len(two) == 0
            continue
        assert one.items.tolist() == rvc1_oracle(gold, pool.tokens, budget.tokens).items.tolist()
        assert two.items.tolist() == rvc2_oracle(gold, pool.tokens, pool.source_units, budget.tokens).items.tolist()
        assert one.tokens <= budget.tokens and two.tokens <= budget.tokens
        assert np.isnan(one.gains).all() and np.isnan(two.gains).all()  # a set, no step scores
        checked += 1
    assert checked > 100


def test_exact_oracles_refuse_what_they_cannot_solve_exactly():
    wide = Pool(relevance=np.zeros(2), tokens=np.array([1, 1]), covers=np.ones((2, 21)),
                source_units=np.array([0, 1]))
    with pytest.raises(Refused, match="limited to"):
        ExactOracle("rvc1")(wide, Budget(tokens=2))
    with pytest.raises(Refused, match="RVC2_MAX_STATES"):
        ExactOracle("rvc2")(wide, Budget(tokens=2))
    assert issubclass(Refused, ValueError)
    with pytest.raises(ValueError, match="token budget"):
        ExactOracle("rvc1")(wide, Budget(k=1))
    with pytest.raises(ValueError, match="'rvc1' or 'rvc2'"):
        ExactOracle("rvc3")


def test_selectors_refuse_a_pool_without_what_they_need_naming_the_field():
    scores_only = Pool(relevance=np.array([0.9, 0.5]), tokens=np.array([1, 2]))
    for select in (MMR(), FacilityLocation(), AdaGReS(), Blend(MMR(), 0.5)):
        with pytest.raises(ValueError, match=r"needs the pool's embeddings; this pool has none"):
            select(scores_only, Budget(k=1))
    for select in (CoverageGreedy(soft=True), CoverageGreedy(soft=False), Blend(CoverageGreedy(soft=True), 0.5),
                   ExactOracle("rvc1")):
        named = getattr(select, "selector", select).name  # a Blend's inner selector is the one that reads covers
        with pytest.raises(ValueError, match=rf"{named} needs the pool's covers"):
            select(scores_only, Budget(tokens=2))
    no_units = Pool(relevance=np.zeros(2), tokens=np.array([1, 1]), covers=np.eye(2))
    with pytest.raises(ValueError, match="oracle_rvc2 needs the pool's source_units"):
        ExactOracle("rvc2")(no_units, Budget(tokens=2))
    no_tokens = Pool(relevance=np.zeros(2), covers=np.eye(2), source_units=np.array([0, 1]))
    with pytest.raises(ValueError, match="oracle_rvc1 needs the pool's tokens"):
        ExactOracle("rvc1")(no_tokens, Budget(tokens=2))
    embedded = Pool(embeddings=np.eye(2), query=np.ones(2), covers=np.eye(2))
    for select in LINEUP:  # a token budget needs token counts
        with pytest.raises(ValueError, match="needs the pool.s token"):  # counts (the budget), tokens (AdaGReS)
            select(embedded, Budget(tokens=2))
        assert len(select(embedded, Budget(k=1))) == 1  # a k budget does not
    with pytest.raises(ValueError, match="relevance scores, or embeddings"):
        Pool(tokens=np.array([1]))


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
    with pytest.raises(ValueError, match="tau"):
        CoverageGreedy(soft=False, tau=0.0)
    with pytest.raises(ValueError, match="one gain per item"):
        Selection(np.array([0, 1]), np.array([0.5]), None)


def test_select_batch_returns_exactly_the_per_pool_selections():
    """select_batch over batches of pools of different sizes (empty ones too), viewpoint counts, tied
    relevance, duplicated rows, items that do not fit, 0/1 coverage (one stacked product for the batch) and
    probabilities (a product per pool), under k and token budgets: what each pool gets alone, items and
    gains."""
    rng = np.random.default_rng(9)
    for round_ in range(150):
        pools = [random_pool(rng, int(rng.integers(0, 15)), tied_relevance=bool(rng.integers(2)))
                 for _ in range(int(rng.integers(1, 7)))]
        if round_ % 3 == 0:  # 0/1 coverage throughout
            pools = [Pool(embeddings=p.embeddings, query=p.query, tokens=p.tokens, relevance=p.relevance,
                          covers=(p.covers > 0.5).astype(float), source_units=p.source_units) for p in pools]
        budget = random_budget(rng, pools[int(rng.integers(len(pools)))])
        for select in VARIANTS:
            alone = [select(pool, budget) for pool in pools]
            batched = select_batch(select, pools, budget)
            assert [s.items.tolist() for s in batched] == [s.items.tolist() for s in alone], select.name
            for together, single in zip(batched, alone):
                np.testing.assert_array_equal(together.gains, single.gains)
                assert together.tokens == single.tokens
    assert select_batch(MMR(), [], Budget(k=3)) == []


def test_a_batch_row_goes_as_the_greedy_loop_goes_on_it_alone():
    """_greedy_lockstep (lockstep rows) against greedy (one pool): state-dependent scores with ties and
    non-positive values, integer and float costs, with and without stopping at a non-positive score; the
    chosen items, their step scores and the budget spent."""
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
            picked, step_gains, used = greedy(costs[row, :size], Budget(tokens=limit),
                                              lambda: base[row, :size] - interaction[row, :size, :size] @ taken,
                                              lambda best: taken.__setitem__(best, 1.0), stop_at_nonpositive=stop)
            expected.append((picked.tolist(), step_gains.tolist(), used))
        taken = np.zeros((n_pools, n_items))
        available = np.arange(n_items)[None, :] < sizes[:, None]

        def scores(rows):
            return base - np.einsum("bij,bj->bi", interaction, taken)

        def add(rows, best):
            taken[rows, best] = 1.0

        chosen, step_gains, used = _greedy_lockstep(costs, np.full(n_pools, limit), available, scores, add, stop)
        assert list(zip(chosen, step_gains, used.tolist())) == expected


def test_fill_is_the_walk_that_adds_every_item_that_still_fits():
    rng = np.random.default_rng(12)
    for _ in range(300):
        n_items = int(rng.integers(0, 15))
        costs = rng.integers(1, 10, n_items) * (0.25 if rng.integers(2) else 1)
        budget = Budget(tokens=int(rng.integers(0, 40)))
        walk = rng.permutation(n_items)[:int(rng.integers(0, n_items + 1))]
        used = costs[:2].sum() if budget.tokens >= costs[:2].sum() else 0
        expected, spent_so_far = [7], used
        for item in walk:  # the definition: Budget.fits item by item
            if budget.fits(spent_so_far, costs[item]):
                expected.append(int(item))
                spent_so_far += costs[item]
        assert fill(walk, costs, budget, used, [7]).tolist() == expected


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
        monkeypatch.setattr(selectors, "LOCKSTEP_BYTES", 1 << 20 if round_ % 4 < 2 else 3 * 2 * 60 * 60 * 8)
        alone = [FacilityLocation()(pool, budget) for pool in pools]
        batched = select_batch(FacilityLocation(), pools, budget)
        assert [s.items.tolist() for s in batched] == [s.items.tolist() for s in alone]
        for together, single in zip(batched, alone):
            np.testing.assert_array_equal(together.gains, single.gains)
        checked += len(pools)
    assert checked >= 200
