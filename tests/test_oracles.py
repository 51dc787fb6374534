"""Exact RVC1/RVC2 oracles (models/oracles.py, METHODS.md §2) against brute force over every subset, their
items reaching their value within budget, no selector beating them, their refusals; and the viewpoint
measures (models/viewpoints.py) on answers computed by hand."""

import numpy as np
import pytest

from covlab.models.registry import Report, SelectorSettings, methods
from covlab.models.selectors import Budget, Pool
from covlab.models.oracles import (RVC2_MAX_STATES, _bitmasks, _options, _undominated, _useful_options, rvc1_oracle,
                                   rvc2_oracle)
from covlab.models.viewpoints import iou, redundancy, rvc1, rvc2, tokens_used, unit_codes

INSTANCES = 300
# Every ranked selector of the token comparison that needs no trained model, as the registry builds it.
SELECTORS = [m.selector(SelectorSettings()) for m in methods(Report.COMPARISON) if m.trained is None and m.ordered]


def random_instance(rng: np.random.Generator):
    """n <= 10 items, 1 <= |V| <= 5 viewpoints, token costs 1..12, source units shared by about two items,
    coverage probabilities (covered iff p >= 0.3) and a budget from nothing to everything."""
    n_items, n_viewpoints = int(rng.integers(1, 11)), int(rng.integers(1, 6))
    probs = rng.random((n_items, n_viewpoints)) * (rng.random((n_items, n_viewpoints)) < 0.5)
    tokens = rng.integers(1, 13, n_items)
    units = rng.integers(0, max(n_items // 2, 1), n_items)
    budget = int(rng.integers(0, tokens.sum() + 2))
    return probs, tokens, units, budget


def brute_force(covers: np.ndarray, tokens: np.ndarray, units: np.ndarray, budget: int) -> tuple[float, float]:
    """The best RVC1 and RVC2 over every subset of the items within `budget` tokens."""
    n_items = len(tokens)
    subsets = ((np.arange(2 ** n_items)[:, None] >> np.arange(n_items)) & 1).astype(int)  # row = one subset
    feasible = subsets @ tokens <= budget
    covers = covers.astype(int)
    best_rvc1 = ((subsets @ covers) > 0).mean(axis=1)[feasible].max()
    supporting_units = sum((subsets[:, units == u] @ covers[units == u]) > 0 for u in np.unique(units))
    best_rvc2 = (np.minimum(supporting_units, 2) / 2).mean(axis=1)[feasible].max()
    return float(best_rvc1), float(best_rvc2)


def test_oracles_equal_brute_force_and_their_items_reach_their_value():
    rng = np.random.default_rng(0)
    for _ in range(INSTANCES):
        probs, tokens, units, budget = random_instance(rng)
        covers = probs >= 0.3
        best_rvc1, best_rvc2 = brute_force(covers, tokens, units, budget)
        first = rvc1_oracle(covers, tokens, budget, query_id="q")
        second = rvc2_oracle(covers, tokens, units, budget, query_id="q")
        assert first.value == pytest.approx(best_rvc1) and second.value == pytest.approx(best_rvc2)
        for result, achieved in ((first, rvc1(covers, first.items)), (second, rvc2(covers, units, second.items))):
            assert achieved == pytest.approx(result.value)
            assert result.tokens == tokens_used(tokens, result.items) <= budget
            assert len(np.unique(result.items)) == len(result.items)


def test_no_selector_beats_the_oracles():
    assert {"relevance", "mmr_0.5", "facloc", "adagres", "coverage_soft", "coverage_hard_tau0.3",
            "coverage_hard_tau1"} <= {s.name for s in SELECTORS}
    rng = np.random.default_rng(1)
    for _ in range(INSTANCES):
        probs, tokens, units, budget = random_instance(rng)
        covers = probs >= 0.3
        embeddings = rng.normal(size=(len(tokens), 4))
        pool = Pool(embeddings=embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True),
                    query=rng.normal(size=4), tokens=tokens, covers=probs, source_units=units)
        best_rvc1 = rvc1_oracle(covers, tokens, budget).value
        best_rvc2 = rvc2_oracle(covers, tokens, units, budget).value
        for select in SELECTORS:
            chosen = select(pool, Budget(tokens=budget)).items
            assert tokens_used(tokens, chosen) <= budget
            assert rvc1(covers, chosen) <= best_rvc1 + 1e-12, select.name
            assert rvc2(covers, units, chosen) <= best_rvc2 + 1e-12, select.name


def test_rvc1_oracle_by_hand():
    # Viewpoints {0, 1, 2}: item 0 covers {0, 1} (5 tokens), item 1 {2} (4), item 2 all three (10), item 3 {1} (1).
    covers = np.array([[1, 1, 0], [0, 0, 1], [1, 1, 1], [0, 1, 0]])
    tokens = np.array([5, 4, 10, 1])
    # B = 9: items 0 and 1 cover everything for exactly 9 tokens.
    result = rvc1_oracle(covers, tokens, 9, query_id="q1")
    assert (result.value, result.items.tolist(), result.tokens) == (1.0, [0, 1], 9)
    # B = 8: item 2 does not fit and {0, 1} costs 9; two viewpoints at best, for 5 tokens at least
    # ({0} covers {0, 1}; {1, 3} covers {1, 2}).
    result = rvc1_oracle(covers, tokens, 8, query_id="q1")
    assert (result.value, result.tokens) == (pytest.approx(2 / 3), 5)
    assert rvc1_oracle(covers, tokens, 0, query_id="q1").items.tolist() == []


def test_rvc2_oracle_counts_a_source_unit_once_per_viewpoint():
    # Items 0 and 1 come from unit "a" and both cover {0, 1} (2 tokens each); item 2 from unit "b" covers {0}
    # (3 tokens). B = 4: {0, 1} costs 4 but is one unit, so each viewpoint scores 1/2: (0.5 + 0.5) / 2 = 0.5,
    # which item 0 alone already reaches for 2 tokens. B = 5: {0, 2}, two units on viewpoint 0 and one on
    # viewpoint 1: (1 + 0.5) / 2 = 0.75.
    covers = np.array([[1, 1], [1, 1], [1, 0]])
    tokens = np.array([2, 2, 3])
    units = np.array(["a", "a", "b"])
    result = rvc2_oracle(covers, tokens, units, 4, query_id="q2")
    assert (result.value, result.tokens) == (0.5, 2)
    result = rvc2_oracle(covers, tokens, units, 5, query_id="q2")
    assert (result.value, result.items.tolist(), result.tokens) == (0.75, [0, 2], 5)
    assert rvc2(covers, units, [0, 1]) == 0.5
    assert rvc2(covers, np.array(["a", "c", "b"]), [0, 1]) == 1.0


def test_oracles_refuse_too_many_viewpoints_naming_the_query_and_its_size():
    tokens = np.ones(3, dtype=int)
    with pytest.raises(ValueError, match=r"query 'q42' has 21 viewpoints \(3 items\).*\|V\| <= 20"):
        rvc1_oracle(np.zeros((3, 21), dtype=bool), tokens, 10, query_id="q42")
    with pytest.raises(ValueError, match=r"query 'q43' has 13 viewpoints \(3 items\).*1,594,323.*531,441"):
        rvc2_oracle(np.zeros((3, 13), dtype=bool), tokens, np.arange(3), 10, query_id="q43")
    assert RVC2_MAX_STATES == 3 ** 12
    # 20 and 12 viewpoints are accepted.
    assert rvc1_oracle(np.eye(3, 20, dtype=bool), tokens, 2, query_id="q44").value == pytest.approx(2 / 20)
    assert rvc2_oracle(np.eye(3, 12, dtype=bool), tokens, np.arange(3), 2, query_id="q45").value == \
        pytest.approx(1 / 12)


def test_oracles_and_measures_refuse_queries_without_viewpoints():
    for oracle in (lambda c: rvc1_oracle(c, np.ones(2, dtype=int), 5, query_id="q7"),
                   lambda c: rvc2_oracle(c, np.ones(2, dtype=int), np.arange(2), 5, query_id="q7")):
        with pytest.raises(ValueError, match="query 'q7': no viewpoints"):
            oracle(np.zeros((2, 0), dtype=bool))
    with pytest.raises(ValueError, match="no viewpoints"):
        rvc1(np.zeros((2, 0), dtype=bool), [0])


def test_viewpoint_measures_by_hand():
    covers = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 0]])
    assert rvc1(covers, [0, 1]) == pytest.approx(2 / 3)
    assert rvc1(covers, []) == 0.0
    # Viewpoint 0 has two units (1), viewpoint 1 one (1/2), viewpoint 2 none: 1.5 / 3.
    assert rvc2(covers, np.array([7, 8, 9]), [0, 1, 2]) == pytest.approx(0.5)
    assert iou(["d1", "d2", "d3"], ["d2", "d3", "d4", "d5"]) == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="undefined"):
        iou([], [])
    # Cosines: (e1, e1+e2) = 1/sqrt(2), (e1, e2) = 0, (e1+e2, e2) = 1/sqrt(2); mean = sqrt(2) / 3.
    embeddings = np.array([[1.0, 0], [1, 1], [0, 1]])
    assert redundancy(embeddings, [0, 1, 2]) == pytest.approx(np.sqrt(2) / 3)
    assert redundancy(embeddings, [1]) == 0.0
    assert tokens_used(np.array([3, 4, 5]), [0, 2]) == 8
    with pytest.raises(ValueError, match="distinct"):
        rvc1(covers, [0, 0])


def cheapest_best(covers: np.ndarray, tokens: np.ndarray, units: np.ndarray, budget: int):
    """By brute force over every subset within `budget`: (best RVC1, its fewest tokens), (best RVC2, ...)."""
    n_items = len(tokens)
    subsets = ((np.arange(2 ** n_items)[:, None] >> np.arange(n_items)) & 1).astype(int)
    spent = subsets @ tokens
    feasible = spent <= budget
    covers = covers.astype(int)
    first = ((subsets @ covers) > 0).sum(axis=1)  # covered viewpoints
    supporting = sum((subsets[:, units == u] @ covers[units == u]) > 0 for u in np.unique(units))
    second = np.minimum(supporting, 2).sum(axis=1)  # halves
    answers = []
    for score, scale in ((first, covers.shape[1]), (second, 2 * covers.shape[1])):
        best = score[feasible].max()
        answers.append((best / scale, int(spent[feasible & (score == best)].min())))
    return answers


def dominated_instance(rng: np.random.Generator):
    """n <= 12 items drawn from a few base coverage rows (duplicates, subsets of a row, items covering
    nothing), few distinct token costs (ties), source units of one to three items."""
    n_items, n_viewpoints = int(rng.integers(1, 13)), int(rng.integers(1, 6))
    base = rng.random((int(rng.integers(1, 4)), n_viewpoints)) < 0.6
    covers = base[rng.integers(0, len(base), n_items)] & (rng.random((n_items, n_viewpoints)) < 0.8)
    tokens = rng.choice([1, 2, 2, 3, 5], n_items)
    units = rng.integers(0, max(1, n_items // int(rng.integers(1, 4))), n_items)
    return covers, tokens, units, int(rng.integers(0, tokens.sum() + 2))


def test_pruned_dps_equal_brute_force_on_duplicated_and_dominated_items():
    """The DPs drop dominated items (RVC1) and options two other source units make redundant (RVC2); on
    instances made mostly of such items the value and its fewest tokens stay those of brute force, and the
    items returned reach that value within budget."""
    rng = np.random.default_rng(7)
    for _ in range(600):
        covers, tokens, units, budget = dominated_instance(rng)
        (best_rvc1, tokens_rvc1), (best_rvc2, tokens_rvc2) = cheapest_best(covers, tokens, units, budget)
        first = rvc1_oracle(covers, tokens, budget)
        second = rvc2_oracle(covers, tokens, units, budget)
        assert (first.value, first.tokens) == (pytest.approx(best_rvc1), tokens_rvc1)
        assert (second.value, second.tokens) == (pytest.approx(best_rvc2), tokens_rvc2)
        for result, achieved in ((first, rvc1(covers, first.items)), (second, rvc2(covers, units, second.items))):
            assert achieved == pytest.approx(result.value)
            assert result.tokens == tokens_used(tokens, result.items) <= budget
            assert len(np.unique(result.items)) == len(result.items)
            assert result.items.tolist() == sorted(result.items.tolist())


def test_dominated_items_by_hand_both_ways():
    # Viewpoints {0, 1, 2}, B = 10. Item 1 covers {0, 1} for 5 tokens: it dominates item 0 ({0}, 5 tokens) and
    # its duplicate item 2 (higher index). Item 4 ({2}, 2 tokens) dominates item 3 ({2}, 3 tokens). Item 5
    # covers nothing; item 6 covers everything but costs 20 > B. Item 7 ({1}, 4 tokens) is cheaper than
    # anything containing {1}, so it stays.
    covers = np.array([[1, 0, 0], [1, 1, 0], [1, 1, 0], [0, 0, 1], [0, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0]])
    tokens = np.array([5, 5, 5, 3, 2, 1, 20, 4])
    masks = _bitmasks(covers.astype(bool))
    assert _undominated(masks, tokens, 10, 3).tolist() == [1, 4, 7]
    # The superset-minimum path (taken above 8 viewpoints) agrees with the pairwise one.
    assert _undominated(masks, tokens, 10, 9).tolist() == [1, 4, 7]
    result = rvc1_oracle(covers, tokens, 10)
    assert (result.value, result.items.tolist(), result.tokens) == (1.0, [1, 4], 7)


def test_redundant_source_units_by_hand():
    # Four single-item units cover viewpoint 0 for 1, 2, 2 and 3 tokens: the last two are dropped (two other
    # units cover it no later in (tokens, index) order), the first two stay. Unit "e" has two items, {0} and
    # {1}: its options ({0}, {1}, {0, 1}) do not all cover {0}, so it never makes another unit redundant,
    # and none of its options is dropped, the single-item units covering {1} not existing.
    covers = np.array([[1, 0], [1, 0], [1, 0], [1, 0], [1, 0], [0, 1]], dtype=bool)
    tokens = np.array([1, 2, 2, 3, 1, 1])
    units = np.array(["a", "b", "c", "d", "e", "e"])
    masks, costs, option_units, items = _options(_bitmasks(covers), tokens, unit_codes(units, 6), 10, 2)
    kept = _useful_options(masks, costs, option_units)
    assert [(units[items(o)[0]], int(masks[o])) for o in kept] == [("a", 1), ("b", 1), ("e", 1), ("e", 2), ("e", 3)]
    # B = 3: unit a (1) + unit e's {0, 1} (2 tokens): viewpoint 0 gets two units, viewpoint 1 one: 3/4.
    result = rvc2_oracle(covers, tokens, units, 3)
    assert (result.value, result.tokens) == (0.75, 3)


def reference_dps(covers: np.ndarray, tokens: np.ndarray, units: np.ndarray, budget: int):
    """METHODS.md §2's DPs as written, in plain Python, without pruning: (RVC1 value, tokens), (RVC2 ...)."""
    n_viewpoints = covers.shape[1]
    masks = [sum(1 << v for v in range(n_viewpoints) if row[v]) for row in covers]
    cost = {0: 0}
    for mask, spend in zip(masks, tokens.tolist()):
        for state, c in list(cost.items()):
            if c + spend <= budget and c + spend < cost.get(state | mask, budget + 1):
                cost[state | mask] = c + spend
    first = min((-bin(s).count("1"), c) for s, c in cost.items())
    count = {(0,) * n_viewpoints: 0}
    for unit in np.unique(units):
        options = {0: 0}
        for item in np.flatnonzero(units == unit):
            for covered, spent in list(options.items()):
                total = spent + int(tokens[item])
                if total <= budget and total < options.get(covered | masks[item], budget + 1):
                    options[covered | masks[item]] = total
        improved = dict(count)
        for state, c in count.items():
            for mask, spend in options.items():
                if mask and c + spend <= budget:
                    target = tuple(min(d + (mask >> v & 1), 2) for v, d in enumerate(state))
                    if c + spend < improved.get(target, budget + 1):
                        improved[target] = c + spend
        count = improved
    second = min((-sum(s), c) for s, c in count.items())
    return (-first[0] / n_viewpoints, first[1]), (-second[0] / (2 * n_viewpoints), second[1])


def test_pruned_dps_equal_the_unpruned_dps_on_larger_inventories():
    """Beyond brute force: up to 80 items, up to 11 viewpoints for RVC1 (the superset-minimum pruning path
    above 8) and 6 for RVC2, units of up to three items, against the unpruned DPs."""
    rng = np.random.default_rng(8)
    for _ in range(40):
        n_items, n_viewpoints = int(rng.integers(20, 81)), int(rng.integers(2, 12))
        base = rng.random((int(rng.integers(2, 12)), n_viewpoints)) < 0.4
        covers = base[rng.integers(0, len(base), n_items)] & (rng.random((n_items, n_viewpoints)) < 0.85)
        tokens = rng.integers(1, 30, n_items)
        units = rng.integers(0, n_items // int(rng.integers(1, 4)), n_items)
        budget = int(rng.integers(0, 150))
        expected_first, expected_second = reference_dps(covers, tokens, units, budget)
        first = rvc1_oracle(covers, tokens, budget)
        assert (first.value, first.tokens) == expected_first
        assert rvc1(covers, first.items) == first.value and tokens_used(tokens, first.items) == first.tokens
        if n_viewpoints <= 6:
            second = rvc2_oracle(covers, tokens, units, budget)
            assert (second.value, second.tokens) == expected_second
            assert rvc2(covers, units, second.items) == second.value
            assert tokens_used(tokens, second.items) == second.tokens
