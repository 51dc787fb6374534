"""LMVU (models/lmvu.py, METHODS.md §2 "Ranker", "Allocation"): selections fit their budgets, the 18 features on
a pool computed by hand and against a from-scratch recomputation, blindness to gold labels at selection time,
a trained ranker beating chance and relevance order on held-out synthetic pools, the JSON round trip, and the
choice of C."""

import json

import numpy as np
import pytest

from covlab.models.selectors import Blend, Budget, Pool, RelevanceOrder, Selection, Selector
from covlab.models.lmvu import (FEATURE_GROUPS, FEATURE_NAMES, GAINS, LMVU, LabelledPool, LMVURanker,
                                SelectionState, heldout_top1_accuracy, train_lmvu, true_gain)
from covlab.models.viewpoints import rvc1

INSTANCES = 300
BUDGETS = (Budget(tokens=60), Budget(tokens=120))


def unit_rows(matrix) -> np.ndarray:
    matrix = np.asarray(matrix, dtype=float)
    return matrix / np.linalg.norm(matrix, axis=-1, keepdims=True)


def random_pool(rng: np.random.Generator, n_items: int, dim: int = 4) -> Pool:
    """Random unit vectors (the last item a copy of the first: a rank-deficient span), token costs 1..40, and
    in half the pools 1..3 random atoms per item listed in shuffled order."""
    embeddings = unit_rows(rng.normal(size=(max(n_items, 1), dim)))[:n_items]
    if n_items > 2:
        embeddings[-1] = embeddings[0]
    atoms = {}
    if rng.random() < 0.5 and n_items:
        owners = rng.permutation(np.repeat(np.arange(n_items), rng.integers(1, 4, n_items)))
        atoms = {"atoms": unit_rows(rng.normal(size=(len(owners), dim))), "atom_items": owners}
    return Pool(embeddings=embeddings, query=rng.normal(size=dim), tokens=rng.integers(1, 41, n_items), **atoms)


def random_budget(rng: np.random.Generator, pool: Pool) -> Budget:
    if rng.random() < 0.5:
        return Budget(k=int(rng.integers(0, pool.size + 2)))
    return Budget(tokens=int(rng.integers(0, int(pool.tokens.sum()) + 5)))


def random_ranker(rng: np.random.Generator) -> LMVURanker:
    width = len(FEATURE_NAMES)
    return LMVURanker(feature_names=FEATURE_NAMES, mean=rng.normal(size=width), scale=rng.random(width) + 0.5,
                      coef=rng.normal(size=width), C=1.0, gain="viewpoints")


def clustered_pool(rng: np.random.Generator, query_id: str, dim: int = 16) -> LabelledPool:
    """3..6 viewpoints, each a cluster direction leaning towards the query with 2..5 noisy copies covering it,
    and 4..9 distractors that sit near the query and cover nothing (the most relevant items, so relevance order
    spends its budget on them); items shuffled, token costs 1..40."""
    query = unit_rows(rng.normal(size=dim))
    n_viewpoints = int(rng.integers(3, 7))
    centres = unit_rows(0.6 * query + unit_rows(rng.normal(size=(n_viewpoints, dim))))
    members = rng.integers(2, 6, n_viewpoints)
    owners = np.repeat(np.arange(n_viewpoints), members)
    n_distractors = int(rng.integers(4, 10))
    directions = np.vstack([centres[owners], np.repeat(query[None], n_distractors, axis=0)])
    embeddings = unit_rows(directions + 0.25 * rng.normal(size=directions.shape))
    gold = np.vstack([np.eye(n_viewpoints, dtype=bool)[owners], np.zeros((n_distractors, n_viewpoints), bool)])
    order = rng.permutation(len(embeddings))
    pool = Pool(embeddings=embeddings[order], query=query, tokens=rng.integers(1, 41, len(order)))
    return LabelledPool(query_id=query_id, pool=pool, gold=gold[order])


@pytest.fixture(scope="module")
def synthetic():
    rng = np.random.default_rng(7)
    pools = [clustered_pool(rng, f"q{i}") for i in range(60)]
    train, dev, test = pools[:30], pools[30:40], pools[40:]
    return train, dev, test, train_lmvu(train, dev, BUDGETS, seed=0)


def test_feature_names_and_groups():
    assert len(FEATURE_NAMES) == 18 == len(set(FEATURE_NAMES))
    assert list(FEATURE_GROUPS) == ["candidate", "evidence_state", "atomic_state", "shared_state"]
    assert [len(names) for names in FEATURE_GROUPS.values()] == [6, 5, 4, 3]
    assert FEATURE_NAMES == sum(FEATURE_GROUPS.values(), ())


def test_every_selection_fits_its_budget_and_stops_only_when_nothing_fits():
    rng = np.random.default_rng(0)
    for _ in range(INSTANCES):
        pool = random_pool(rng, int(rng.integers(0, 13)))
        budget = random_budget(rng, pool)
        select = LMVU(random_ranker(rng))
        selection = select(pool, budget)
        chosen = selection.items
        assert isinstance(selection, Selection) and selection.gains.shape == chosen.shape
        assert chosen.ndim == 1 and np.issubdtype(chosen.dtype, np.integer)
        assert len(np.unique(chosen)) == len(chosen) and ((chosen >= 0) & (chosen < pool.size)).all()
        costs = budget.costs(pool.tokens)
        spent = int(costs[chosen].sum())
        assert spent <= budget.limit, (budget, chosen)
        rest = np.setdiff1d(np.arange(pool.size), chosen)
        assert not budget.fits(spent, costs[rest]).any(), (budget, chosen)


def test_lmvu_is_a_frozen_selector(synthetic):
    select = LMVU(synthetic[3].ranker)
    assert isinstance(select, Selector) and select.name == "lmvu"
    with pytest.raises(AttributeError):
        select.ranker = None


def test_gains_are_the_ranker_scores_at_each_step(synthetic):
    """An LMVU selection's gains are the ranker's score of the chosen item at the state it was chosen in
    (recomputed here step by step on a fresh state), and a Blend at weight 1 is LMVU itself, bit for bit."""
    _, _, test, trained = synthetic
    select = LMVU(trained.ranker)
    for labelled in test[:5]:
        for budget in BUDGETS + (Budget(k=4),):
            selection = select(labelled.pool, budget)
            state = SelectionState(labelled.pool, budget)
            expected = []
            for item in selection.items.tolist():
                expected.append(trained.ranker.scores(state.features())[item])
                state.add(item)
            np.testing.assert_allclose(selection.gains, expected, rtol=1e-12, atol=1e-12)
            blended = Blend(select, 1.0)(labelled.pool, budget)
            np.testing.assert_array_equal(blended.items, selection.items)
            np.testing.assert_array_equal(blended.gains, selection.gains)


def test_lmvu_refuses_a_pool_without_embeddings(synthetic):
    scores_only = Pool(relevance=np.array([0.9, 0.5]), tokens=np.array([1, 2]))
    with pytest.raises(ValueError, match="needs the pool's embeddings; this pool has none"):
        LMVU(synthetic[3].ranker)(scores_only, Budget(k=1))
    no_tokens = Pool(embeddings=np.eye(2), query=np.ones(2))
    with pytest.raises(ValueError, match="needs the pool's tokens"):
        LMVU(synthetic[3].ranker)(no_tokens, Budget(tokens=1))


def test_features_computed_by_hand():
    """Three items in 3-D; item 1 has two atoms, item 2 two atoms (one opposed to item 0's: novelty clipped to 1);
    budget 70 tokens. After item 0, then after items 0 and 1, the features of the remaining items."""
    root2 = np.sqrt(2)
    embeddings = [[1, 0, 0], [0.6, 0.8, 0], [0, 0.6, 0.8]]
    atoms = [[0, 0.6, 0.8], [1, 0, 0], [1, 0, 0], [-0.6, 0, 0.8], [0, 1, 0]]
    pool = Pool(embeddings=embeddings, query=[1, 1, 0], tokens=np.array([10, 20, 30]), atoms=atoms,
                atom_items=np.array([2, 0, 1, 2, 1]))
    state = SelectionState(pool, Budget(tokens=70))
    state.add(0)
    features = dict(zip(FEATURE_NAMES, state.features()[1]))
    assert features == pytest.approx({
        "relevance_cosine": 1.4 / root2, "relevance_percentile": 1.0, "log_cost": np.log(21),
        "cost_per_remaining": 20 / 60, "cost_per_budget": 20 / 70, "relevance_above_mean": 0.4 / root2,
        "max_cosine_selected": 0.6, "mean_cosine_selected": 0.6, "cosine_selected_centroid": 0.6,
        "residual_norm": 0.8, "near_duplicate_share": 0.0,
        "atom_novelty_mean": 0.5, "atom_novelty_max": 1.0, "novel_atom_share": 0.5, "log_atoms": np.log(3),
        "selected_count": 1, "budget_used": 10 / 70, "log_remaining": np.log(61)})
    state.add(1)
    features = dict(zip(FEATURE_NAMES, state.features()[2]))
    assert features == pytest.approx({
        "relevance_cosine": 0.6 / root2, "relevance_percentile": 0.0, "log_cost": np.log(31),
        "cost_per_remaining": 30 / 40, "cost_per_budget": 30 / 70, "relevance_above_mean": -0.4 / root2,
        "max_cosine_selected": 0.48, "mean_cosine_selected": 0.24, "cosine_selected_centroid": 0.48 / np.sqrt(3.2),
        "residual_norm": 0.8, "near_duplicate_share": 0.0,
        "atom_novelty_mean": 0.7, "atom_novelty_max": 1.0, "novel_atom_share": 0.5, "log_atoms": np.log(3),
        "selected_count": 2, "budget_used": 30 / 70, "log_remaining": np.log(41)})
    assert state.features()[0, FEATURE_NAMES.index("relevance_percentile")] == pytest.approx(0.5)
    np.testing.assert_array_equal(state.candidates(), [2])


def test_empty_selection_features():
    pool = Pool(embeddings=np.eye(3), query=[1, 2, 3], tokens=np.array([1, 2, 3]))
    features = SelectionState(pool, Budget(k=2)).features()
    for name, value in {"max_cosine_selected": 0, "mean_cosine_selected": 0, "cosine_selected_centroid": 0,
                        "residual_norm": 1, "near_duplicate_share": 0, "atom_novelty_mean": 1, "atom_novelty_max": 1,
                        "novel_atom_share": 1, "selected_count": 0, "budget_used": 0, "log_cost": np.log(2)}.items():
        np.testing.assert_allclose(features[:, FEATURE_NAMES.index(name)], value, err_msg=name)


def features_from_scratch(pool: Pool, budget: Budget, selected: list[int]) -> np.ndarray:
    """The 18 features recomputed from the whole similarity matrices, the residual by least squares."""
    embeddings, n = pool.embeddings, pool.size
    costs = budget.costs(pool.tokens)
    used = int(costs[selected].sum())
    remaining = budget.limit - used
    cosine = embeddings @ (pool.query / np.linalg.norm(pool.query))
    similarity = embeddings @ embeddings[selected].T
    centroid = embeddings[selected].sum(axis=0)
    coefficients = np.linalg.lstsq(embeddings[selected].T, embeddings.T, rcond=None)[0]
    residual = np.linalg.norm(embeddings.T - embeddings[selected].T @ coefficients, axis=0)
    selected_atoms = pool.atoms[np.isin(pool.atom_items, selected)]
    novelty = 1 - np.maximum((pool.atoms @ selected_atoms.T).max(axis=1), 0)
    rows = []
    for item in range(n):
        mine = novelty[pool.atom_items == item]
        sims = similarity[item]
        rows.append([
            cosine[item], (pool.relevance < pool.relevance[item]).sum() / (n - 1) if n > 1 else 1.0,
            np.log1p(costs[item]), costs[item] / max(remaining, 1), costs[item] / max(budget.limit, 1),
            cosine[item] - cosine.mean(),
            sims.max(), sims.mean(), embeddings[item] @ centroid / np.linalg.norm(centroid), residual[item],
            (sims > 0.7).mean(),
            mine.mean(), mine.max(), (mine > 0.5).mean(), np.log1p(len(mine)),
            len(selected), used / max(budget.limit, 1), np.log1p(remaining)])
    return np.array(rows)


def test_incremental_state_equals_recomputation():
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(100):
        pool = random_pool(rng, int(rng.integers(2, 13)))
        budget = Budget(k=pool.size) if rng.random() < 0.3 else Budget(tokens=int(pool.tokens.sum()))
        state = SelectionState(pool, budget)
        for item in rng.permutation(pool.size)[:int(rng.integers(1, pool.size + 1))]:
            state.add(int(item))
            np.testing.assert_allclose(state.features(), features_from_scratch(pool, budget, state.selected),
                                       atol=1e-6, rtol=0)
            checked += 1
    assert checked > 300


def test_state_refuses_an_item_that_does_not_fit_or_is_taken():
    pool = Pool(embeddings=np.eye(2), query=[1, 1], tokens=np.array([3, 5]))
    state = SelectionState(pool, Budget(tokens=6))
    state.add(1)
    with pytest.raises(ValueError, match="does not fit"):
        state.add(0)
    with pytest.raises(ValueError, match="already selected"):
        state.add(1)


class Tripwire:
    """Stands in for gold labels: any use fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"LMVU read gold labels ({name})")

    def __getitem__(self, key):
        raise AssertionError("LMVU read gold labels")

    def __array__(self, *args, **kwargs):
        raise AssertionError("LMVU read gold labels")


def test_selection_is_blind_to_gold_labels(synthetic):
    _, _, test, trained = synthetic
    select = LMVU(trained.ranker)
    rng = np.random.default_rng(2)
    for labelled in test:
        pool = labelled.pool
        for budget in BUDGETS + (Budget(k=4),):
            expected = select(Pool(embeddings=pool.embeddings, query=pool.query, tokens=pool.tokens,
                                   covers=labelled.gold, source_units=np.arange(pool.size)), budget)
            shuffled = labelled.gold[:, rng.permutation(labelled.gold.shape[1])]
            other = Pool(embeddings=pool.embeddings, query=pool.query, tokens=pool.tokens,
                         covers=shuffled[rng.permutation(pool.size)], source_units=rng.integers(0, 2, pool.size))
            blind = Pool(embeddings=pool.embeddings, query=pool.query, tokens=pool.tokens)
            object.__setattr__(blind, "covers", Tripwire())
            object.__setattr__(blind, "source_units", Tripwire())
            for variant in (pool, other, blind):
                chosen = select(variant, budget)
                np.testing.assert_array_equal(chosen.items, expected.items)
                np.testing.assert_array_equal(chosen.gains, expected.gains)


def test_trained_lmvu_beats_chance_and_relevance_on_held_out_pools(synthetic):
    _, _, test, trained = synthetic
    accuracy, chance = heldout_top1_accuracy(trained.ranker, test, BUDGETS, states_per_query=10, seed=3)
    assert 0 < chance < 0.3 and accuracy > chance + 0.25, (accuracy, chance)
    select, relevance = LMVU(trained.ranker), RelevanceOrder()
    for budget in BUDGETS:
        ours = np.mean([rvc1(p.gold, select(p.pool, budget).items) for p in test])
        baseline = np.mean([rvc1(p.gold, relevance(p.pool, budget).items) for p in test])
        assert ours > baseline + 0.2, (budget, ours, baseline)


def test_true_gain_counts_new_gold_viewpoints():
    gold = np.array([[1, 1, 0], [1, 0, 0], [0, 1, 1]], dtype=bool)
    pool = Pool(embeddings=np.eye(3), query=[1, 1, 1], tokens=np.array([2, 4, 5]))
    state = SelectionState(pool, Budget(tokens=20))
    state.add(1)
    np.testing.assert_allclose(true_gain(gold, state, np.array([0, 2]), "viewpoints"), [1, 2])
    np.testing.assert_allclose(true_gain(gold, state, np.array([0, 2]), "viewpoints_per_token"), [0.5, 0.4])
    with pytest.raises(ValueError, match="gain must be one of"):
        true_gain(gold, state, np.array([0]), "tokens")


def test_round_trip_gives_identical_selections(synthetic):
    _, _, test, trained = synthetic
    restored = LMVURanker.from_dict(json.loads(json.dumps(trained.ranker.to_dict())))
    for field in ("mean", "scale", "coef"):
        np.testing.assert_array_equal(getattr(restored, field), getattr(trained.ranker, field))
    assert (restored.C, restored.gain, restored.feature_names) == (trained.C, trained.ranker.gain, FEATURE_NAMES)
    for labelled in test:
        for budget in BUDGETS + (Budget(k=3),):
            np.testing.assert_array_equal(LMVU(restored)(labelled.pool, budget).items,
                                          LMVU(trained.ranker)(labelled.pool, budget).items)


@pytest.mark.parametrize("names", [FEATURE_NAMES[::-1], FEATURE_NAMES[:-1] + ("tokens",), FEATURE_NAMES[:-1]])
def test_from_dict_refuses_other_features(synthetic, names):
    data = synthetic[3].ranker.to_dict() | {"feature_names": list(names)}
    with pytest.raises(ValueError, match="trained on other features .* retrain"):
        LMVURanker.from_dict(data)


def test_c_is_chosen_by_dev_pairwise_accuracy(synthetic):
    trained = synthetic[3]
    accuracy = trained.dev_accuracy
    assert set(accuracy) == {0.1, 1.0, 10.0} and all(0 <= value <= 1 for value in accuracy.values())
    assert trained.C == min(c for c, value in accuracy.items() if value == max(accuracy.values()))
    assert trained.ranker.C == trained.C and trained.train_pairs > 1000 and trained.dev_pairs > 300
    assert trained.ranker.gain in GAINS and set(trained.coefficients()) == set(FEATURE_NAMES)
    # shared-state features are equal across candidates: their differences are 0 and so are their weights
    for name in FEATURE_GROUPS["shared_state"]:
        assert trained.coefficients()[name] == 0


def test_c_ties_go_to_the_smaller_c(synthetic):
    """Two weak regularisations give the same dev predictions: the smaller C wins, whatever the order of Cs."""
    train, dev, _, _ = synthetic
    trained = train_lmvu(train[:8], dev[:4], BUDGETS, Cs=(1e4, 1e3), seed=5)
    assert trained.dev_accuracy[1e3] == trained.dev_accuracy[1e4]
    assert trained.C == 1e3


def test_training_is_seeded_and_gains_agree_under_a_k_budget(synthetic):
    train, dev, _, _ = synthetic
    runs = [train_lmvu(train[:8], dev[:4], [Budget(k=3)], gain=gain, seed=5) for gain in GAINS]
    again = train_lmvu(train[:8], dev[:4], [Budget(k=3)], gain=GAINS[0], seed=5)
    np.testing.assert_array_equal(runs[0].ranker.coef, again.ranker.coef)
    np.testing.assert_array_equal(runs[0].ranker.coef, runs[1].ranker.coef)  # per item = per budget unit
    assert runs[0].train_pairs == again.train_pairs


def test_training_refusals(synthetic):
    train, dev, _, _ = synthetic
    with pytest.raises(ValueError, match="gain must be one of"):
        train_lmvu(train[:2], dev[:2], BUDGETS, gain="tokens")
    with pytest.raises(ValueError, match="roll_in"):
        train_lmvu(train[:2], dev[:2], BUDGETS, roll_in=("oracle",))
    with pytest.raises(ValueError, match="no candidate pairs"):
        train_lmvu(train[:2], dev[:2], [Budget(tokens=0)])
    with pytest.raises(ValueError, match="gold has"):
        LabelledPool("q", train[0].pool, train[0].gold[1:])
