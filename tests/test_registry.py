"""The method registry (models/registry.py): every method's selector is built from its entry and selects within
budget from a pool carrying what the entry says it reads (and refuses one without it); the reports' methods
are exactly the selection assets that feed them, wired to the coverage, ranking and trained model their entries
name; lookups by an unknown name list the valid ones; Table 1's rows are the registry's labels in its order."""

import numpy as np
import pandas as pd
import pytest

from covlab.models.lmvu import FEATURE_NAMES, LMVU, LMVURanker
from covlab.models.registry import (METHODS, TRAINED_SELECTORS, Coverage, Report, SelectorSettings, method,
                                    methods, untrained_left_out)
from covlab.models.report import table1
from covlab.models.selectors import MMR, Budget, CoverageGreedy, ExactOracle, Pool, Selection, Selector

# The selector each selecting method builds under the default settings (tau 0.3, MMR lambda 0.5), by its name.
SELECTOR_NAMES = {
    "relevance": "relevance", "relevance_coverage_trained": "relevance", "mmr": "mmr_0.5", "facloc": "facloc",
    "adagres": "adagres", "lmvu": "lmvu", "coverage_greedy": "coverage_hard_tau0.3",
    "coverage_greedy_soft": "coverage_soft", "gold_nugget_bound": "coverage_hard_tau0.3",
    "gold_nugget_bound_soft": "coverage_soft", "oracle_greedy": "coverage_hard_tau1", "oracle_rvc1": "oracle_rvc1",
    "oracle_rvc2": "oracle_rvc2", "bm25": "relevance", "pool_order": "relevance",
}
RETRIEVERS = {"dense", "mcompass", "mcompass_no_selector", "mcompass_mean_pool"}
# Table 1's rows (label, method) in the order the coverage report prints them.
TABLE1_ROWS = [("relevance", "relevance"), ("+ coverage training", "relevance_coverage_trained"),
               ("+ estimator and greedy", "coverage_greedy"), ("+ estimator and soft greedy [chosen]",
                                                               "coverage_greedy_soft"),
               ("gold nuggets", "gold_nugget_bound"), ("gold nuggets, soft greedy [chosen]", "gold_nugget_bound_soft"),
               ("oracle greedy (bounds nugget coverage)", "oracle_greedy"), ("BM25 pool order", "bm25")]


def dummy_ranker(rng: np.random.Generator) -> LMVURanker:
    width = len(FEATURE_NAMES)
    return LMVURanker(feature_names=FEATURE_NAMES, mean=np.zeros(width), scale=np.ones(width),
                      coef=rng.normal(size=width), C=1.0, gain="viewpoints")


def full_pool(rng: np.random.Generator, n_items: int) -> Pool:
    """A pool with everything any selector reads: unit embeddings and a query, token costs 1..20, 0/1 gold-like
    coverage of 0..4 viewpoints and source units."""
    embeddings = rng.normal(size=(n_items, 4))
    embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    covers = (rng.random((n_items, int(rng.integers(0, 5)))) < 0.4).astype(float)
    return Pool(embeddings=embeddings, query=rng.normal(size=4), tokens=rng.integers(1, 21, n_items), covers=covers,
                source_units=rng.integers(0, max(n_items // 2, 1), n_items))


def build(entry, rng) -> Selector:
    """`entry`'s selector under the default settings, with a dummy ranker for LMVU."""
    return entry.selector(SelectorSettings(), dummy_ranker(rng) if entry.trained == "lmvu_ranker" else None)


def asset_inputs(assets_def) -> dict[str, str]:
    """An asset's inputs: argument name -> the asset key it reads."""
    return {name: key.to_user_string() for name, key in assets_def.keys_by_input_name.items()}


def test_registry_names_are_unique_and_in_report_order():
    assert [m.name for m in METHODS] == [
        "relevance", "relevance_coverage_trained", "mmr", "facloc", "adagres", "lmvu", "coverage_greedy",
        "coverage_greedy_soft", "gold_nugget_bound", "gold_nugget_bound_soft", "oracle_greedy", "oracle_rvc1",
        "oracle_rvc2", "bm25", "pool_order", "dense", "mcompass", "mcompass_no_selector", "mcompass_mean_pool"]
    assert len({m.name for m in METHODS}) == len(METHODS) and all(m.label and m.description for m in METHODS)


def test_every_selecting_method_builds_its_selector_and_selects_within_budget():
    rng = np.random.default_rng(0)
    selecting = [m for m in METHODS if m.build is not None]
    assert {m.name for m in selecting} == set(SELECTOR_NAMES) and {m.name for m in METHODS} - set(SELECTOR_NAMES) \
        == RETRIEVERS
    for entry in selecting:
        select = build(entry, rng)
        assert isinstance(select, Selector) and select.name == SELECTOR_NAMES[entry.name], entry.name
        for _ in range(20):
            pool = full_pool(rng, int(rng.integers(1, 10)))
            budgets = [Budget(tokens=int(rng.integers(0, int(pool.tokens.sum()) + 3)))]
            if entry.ordered:  # the exact oracles are defined under a token budget only
                budgets.append(Budget(k=int(rng.integers(0, pool.size + 2))))
            for budget in budgets:
                chosen = select(pool, budget)
                assert isinstance(chosen, Selection), entry.name
                spent = len(chosen) if budget.k is not None else chosen.tokens
                assert spent <= budget.limit and len(set(chosen.items.tolist())) == len(chosen), (entry.name, budget)


def test_a_method_refuses_a_pool_without_the_coverage_its_entry_reads():
    rng = np.random.default_rng(1)
    pool = full_pool(rng, 6)
    uncovered = Pool(embeddings=pool.embeddings, query=pool.query, tokens=pool.tokens, source_units=pool.source_units)
    for entry in (m for m in METHODS if m.build is not None):
        select = build(entry, rng)
        if entry.coverage is Coverage.NONE:
            assert len(select(uncovered, Budget(tokens=30))) > 0, entry.name
        else:
            with pytest.raises(ValueError, match="needs the pool's covers"):
                select(uncovered, Budget(tokens=30))


def test_settings_reach_the_selectors_and_trained_methods_need_their_model():
    settings = SelectorSettings(tau=0.5, mmr_lambda=0.25)
    assert method("mmr").selector(settings) == MMR(0.25)
    for name in ("coverage_greedy", "gold_nugget_bound"):
        assert method(name).selector(settings) == CoverageGreedy(soft=False, tau=0.5)
    assert method("oracle_greedy").selector(settings) == CoverageGreedy(soft=False, tau=1.0)  # gold 0/1: tau 1
    assert method("oracle_rvc2").selector(settings) == ExactOracle("rvc2")
    ranker = dummy_ranker(np.random.default_rng(2))
    assert method("lmvu").selector(settings, ranker) == LMVU(ranker)
    with pytest.raises(ValueError, match="lmvu needs its trained model .*lmvu_ranker"):
        method("lmvu").selector(settings)
    for name in RETRIEVERS:
        with pytest.raises(ValueError, match=f"{name} is a retriever, not a selector over a pool"):
            method(name).selector(settings)


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown method 'greedy'; expected one of") as refused:
        method("greedy")
    assert all(repr(m.name) in str(refused.value) for m in METHODS)


def test_the_coverage_report_methods_are_exactly_the_selection_assets():
    from covlab.assets.selections import SELECTION_ASSETS

    by_key = {a.key.to_user_string(): a for a in SELECTION_ASSETS}
    assert list(by_key) == [f"selection_{m.name}" for m in methods(Report.COVERAGE)]
    assert [m.name for m in methods(Report.COVERAGE)] == [name for _, name in TABLE1_ROWS]
    # what ranks each k pool: as the selection assets ranked them before the registry
    assert {m.name: m.order.column for m in methods(Report.COVERAGE)} == {
        "relevance": "relevance", "relevance_coverage_trained": "coverage_trained",
        "coverage_greedy": "coverage_trained", "coverage_greedy_soft": "coverage_trained",
        "gold_nugget_bound": "coverage_trained", "gold_nugget_bound_soft": "coverage_trained",
        "oracle_greedy": "coverage_trained", "bm25": None}
    for entry in methods(Report.COVERAGE):
        inputs = asset_inputs(by_key[f"selection_{entry.name}"])
        assert inputs.get("scores") == entry.order.asset, entry.name  # relevance_scores, pool_scores or none
        assert inputs.get("coverage") == entry.coverage.asset, entry.name
        assert (inputs.get("estimator") == "coverage_estimator") == entry.coverage.estimated, entry.name


def test_the_k_methods_a_run_without_training_keeps_read_nothing_trained():
    """untrained_left_out (the untrained profile) keeps exactly the k methods whose selection asset reads no
    trained model, directly or through the scores that rank its pool: relevance order's scores are the untrained
    relevance bi-encoder's (relevance_scores), the coverage-trained order's read the coverage bi-encoder."""
    from covlab.assets.coverage import pool_scores, relevance_scores
    from covlab.assets.selections import SELECTION_ASSETS

    trained = {t.asset for t in TRAINED_SELECTORS}
    assert not set(asset_inputs(relevance_scores).values()) & trained
    assert "coverage_biencoder" in asset_inputs(pool_scores).values()
    reads_trained = trained | {"pool_scores", "estimated_coverage_matrix", "estimated_gold_coverage_matrix"}
    left_out = untrained_left_out(Report.COVERAGE)
    for entry in methods(Report.COVERAGE):
        reads = set(asset_inputs(next(a for a in SELECTION_ASSETS if a.key.path == [f"selection_{entry.name}"]))
                    .values())
        assert bool(reads & reads_trained) == (entry.name in left_out), entry.name
    assert [m.name for m in methods(Report.COVERAGE) if m.name not in left_out] == ["relevance", "bm25"]
    assert left_out["oracle_greedy"] == "needs the trained coverage_biencoder"  # its ties and fill


def test_the_comparison_methods_are_exactly_the_budgeted_assets():
    from covlab.assets.budgeted import BUDGETED_SELECTION_ASSETS

    by_key = {a.key.to_user_string(): a for a in BUDGETED_SELECTION_ASSETS}
    assert list(by_key) == [f"budgeted_{m.name}" for m in methods(Report.COMPARISON)]
    assert [m.name for m in methods(Report.COMPARISON)] == [
        "relevance", "mmr", "facloc", "adagres", "lmvu", "coverage_greedy", "coverage_greedy_soft",
        "gold_nugget_bound", "gold_nugget_bound_soft", "oracle_greedy", "oracle_rvc1", "oracle_rvc2"]
    for entry in methods(Report.COMPARISON):
        inputs = asset_inputs(by_key[f"budgeted_{entry.name}"])
        assert inputs.get("model") == entry.trained, entry.name
        assert inputs.get("coverage") == (entry.coverage.asset if entry.coverage.estimated else None), entry.name
        # gold-label methods read the gold; methods on estimates tune their blend weight on it per budget
        assert ("nugget_links" in inputs) == (entry.coverage is Coverage.GOLD or entry.coverage.estimated), \
            entry.name


def test_every_asset_an_entry_names_is_in_the_code_location():
    from covlab.models.mcompass import StudentSettings, student_variants
    from covlab.orchestration.definitions import ASSETS

    keys = {key.to_user_string() for assets_def in ASSETS for key in assets_def.keys}
    for entry in METHODS:
        assert entry.trained is None or entry.trained in keys, entry.name
        assert entry.coverage.asset is None or entry.coverage.asset in keys, entry.name
    for report in Report:
        assert report.value in keys, report
    for trained in TRAINED_SELECTORS:
        assert trained.asset in keys
        assert trained.promotion is None or method(trained.promotion.method).trained in (None, trained.asset)
    assert set(student_variants(StudentSettings())) == {m.name for m in methods(Report.RETRIEVAL)
                                                         if m.trained == "mcompass_student"}


def test_table1_labels_rows_with_the_registry_labels_in_registry_order():
    rng = np.random.default_rng(3)
    names = [name for _, name in TABLE1_ROWS] + ["mmr"]  # mmr is no coverage-report method: left out
    shuffled = [names[i] for i in rng.permutation(len(names))]
    per_query = pd.DataFrame([{"method": m, "query_id": q, "split": split, "metric": metric,
                               "value": float(rng.random())}
                              for m in shuffled for q, split in (("q1", "test"), ("q2", "test"), ("q3", "dev"))
                              for metric in ("strecall@10", "alpha_ndcg@10")])
    table = table1(per_query[per_query["method"] != "gold_nugget_bound"], "test")  # an absent method: no row
    expected = [(label, name) for label, name in TABLE1_ROWS if name != "gold_nugget_bound"]
    assert list(table.index) == [label for label, _ in expected]
    assert [method(name).label for _, name in expected] == list(table.index)
    assert table.index.name == "test (n=2)" and list(table.columns) == ["alpha_ndcg@10", "strecall@10"]
    values = per_query[(per_query["split"] == "test") & (per_query["metric"] == "alpha_ndcg@10")]
    assert table.loc["+ estimator and greedy", "alpha_ndcg@10"] == pytest.approx(
        values.loc[values["method"] == "coverage_greedy", "value"].mean())
