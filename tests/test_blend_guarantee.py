"""The fallback guarantee at every budget, as a property: on random pools (random relevance, token costs,
estimated coverage probabilities and gold viewpoints), every method on estimated coverage, run as its
selection assets run it (models/runs.run_method with the estimator's trust), scores on the tune split at
least what relevance order scores there, at every k and token budget, by each budget's tune measure
computed here independently of the blend's own tuning (RVC1 by models/viewpoints, alpha-nDCG@k by ndeval)."""

import numpy as np
import pandas as pd
import pytest

from covlab.models.metrics import evaluate_run
from covlab.models.registry import METHODS, SelectorSettings
from covlab.models.runs import run_method
from covlab.models.schemas import SELECTIONS
from covlab.models.selection import QueryPool, select_queries
from covlab.models.selectors import Budget, Pool, RelevanceOrder
from covlab.models.trust import BLEND_WEIGHTS, EstimateTrust, blend_table, tune_measure
from covlab.models.viewpoints import rvc1

ESTIMATED = [m for m in METHODS if m.coverage.estimated]
BUDGETS = [Budget(k=3), Budget(k=10), Budget(tokens=300), Budget(tokens=900)]
NO_DOCUMENT_JUDGMENTS = pd.DataFrame({"query_id": [], "doc_id": [], "relevance": []})


def random_pools(seed: int, queries: int = 12) -> tuple[dict[str, QueryPool], pd.DataFrame]:
    """Pools of 8-30 items, costs 20-400 tokens, 1-6 gold viewpoints linked to ~20% of the items, and an
    estimate that is the gold plus noise or pure noise (the cases the blend must guard against), half the
    queries in the tune split; with the nugget links of the gold."""
    rng = np.random.default_rng(seed)
    pools, links = {}, []
    for i in range(queries):
        n, m = int(rng.integers(8, 31)), int(rng.integers(1, 7))
        query_id = f"q{i}"
        gold = rng.random((n, m)) < 0.2
        noise = rng.random((n, m))
        covers = noise if rng.random() < 0.5 else np.clip(0.6 * gold + 0.5 * noise, 0, 1)
        pool = Pool(relevance=np.sort(rng.random(n))[::-1].copy(), tokens=rng.integers(20, 401, n),
                    covers=covers)
        doc_ids = np.array([f"{query_id}/d{j}" for j in range(n)])
        pools[query_id] = QueryPool(query_id, "dev" if i % 2 else "test", query_id, doc_ids, pool, gold)
        links += [(query_id, doc_ids[d], f"{query_id}/n{v}", 1) for d, v in zip(*np.nonzero(gold))]
    return pools, pd.DataFrame(links, columns=["query_id", "doc_id", "nugget_id", "grade"])


def tune_score(table: pd.DataFrame, selections: dict, pools: dict[str, QueryPool], budget: Budget,
               links: pd.DataFrame) -> float:
    """The budget's tune measure over the dev pools, computed from the selections themselves."""
    tune = sorted(q for q, p in pools.items() if p.split == "dev")
    if budget.k is None:
        return float(np.mean([rvc1(pools[q].gold, selections[(q, budget.limit)].items) for q in tune]))
    run = table[(table["budget"] == budget.limit) & table["query_id"].isin(tune)]
    measured = evaluate_run(SELECTIONS.conform(run, source="test"), links, NO_DOCUMENT_JUDGMENTS, k=budget.k)
    return float(measured.loc[measured["metric"] == str(tune_measure(budget)), "value"].mean())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("entry", ESTIMATED, ids=lambda m: m.name)
def test_every_estimated_method_is_never_below_relevance_order_on_the_tune_split(seed, entry):
    pools, links = random_pools(seed)
    trust = EstimateTrust(dev_auc=0.9, min_dev_auc=0.65, tune_split="dev", nugget_links=links,
                          weights=list(BLEND_WEIGHTS), alpha=0.5)
    run = run_method(entry, pools, BUDGETS, SelectorSettings(), trust=trust)
    fallback = select_queries(pools, RelevanceOrder(), BUDGETS)
    for budget in BUDGETS:
        chosen = tune_score(run.table, run.selections, pools, budget, links)
        relevance = tune_score(fallback.table, fallback.selections, pools, budget, links)
        assert chosen >= relevance - 1e-12, (entry.name, budget, run.decisions[budget.limit].metadata())
        # the weight-0 score the blend recorded is relevance order's own
        assert run.decisions[budget.limit].blend.fallback_score == pytest.approx(relevance, abs=1e-12)
        assert run.table[run.table["budget"] == budget.limit].groupby("query_id")["doc_id"].size().max() <= (
            budget.k or len(pools["q0"].doc_ids))
    spent = {key: s.tokens for key, s in run.selections.items() if key[1] in (300, 900)}
    assert all(tokens <= budget for (_, budget), tokens in spent.items())


def test_the_blend_weights_table_has_a_row_per_method_and_budget_and_marks_the_gate():
    pools, links = random_pools(0)
    trusted = EstimateTrust(0.9, 0.65, "dev", links, list(BLEND_WEIGHTS), 0.5)
    gated = EstimateTrust(0.5, 0.65, "dev", links, list(BLEND_WEIGHTS), 0.5)
    hard, soft = (m for m in ESTIMATED if m.name in ("coverage_greedy_soft", "coverage_greedy"))
    budgets = [Budget(tokens=300), Budget(tokens=900)]
    details = {soft.name: run_method(soft, pools, budgets, SelectorSettings(), trust=trusted).details(),
               hard.name: run_method(hard, pools, budgets, SelectorSettings(), trust=gated).details(),
               "never_materialized": None}
    table = blend_table(details, [300, 900])
    assert list(zip(table["method"], table["budget"])) == [(hard.name, 300), (hard.name, 900),
                                                           (soft.name, 300), (soft.name, 900)]
    assert (table.loc[table["method"] == hard.name, "metric"] == "estimator gate").all()
    assert (table.loc[table["method"] == hard.name, "weight"] == 0.0).all()
    followed = table[table["method"] == soft.name]
    assert (followed["metric"] == "rvc1").all() and (followed["queries"] == 6).all()
    assert (followed["chosen_score"] >= followed["fallback_score"]).all()
