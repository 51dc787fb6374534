"""What is served is what was evaluated: for every servable method of the demo and every budget its reports evaluated (k
for the coverage report's selections, every token budget for the comparison's), the champion loaded through
`load_selector`, through the MLflow pyfunc of the version that serves it, and through `covlab serve`'s POST
/v1/select chooses exactly the documents, in the same order, that the pipeline's selection asset chose (the library
call on every evaluated query, the pyfunc and HTTP on the reported split's). The requests carry only what a caller
has: the query, the pool's passages in pool order with their ids, and the budget; the service encodes, decomposes and
estimates as the pipeline did, and replays the decisions the evaluation took (the estimator gate and the blend weight
per budget). A budget the evaluation never tuned says which rule it applied."""

from pathlib import Path

import pandas as pd
import pytest

from covlab.models.registry import METHOD, Report, pyfunc_selector
from covlab.models.selectors import Budget
from covlab.resources.io_manager import read_stored

# The module's tests run on one worker, in order, as one serving process would: the library call first, on every
# evaluated query; then the pyfunc and HTTP, which wrap the same ContextSelector in another transport, on the
# reported split's queries at every method and budget. The selectors the library call loaded stay loaded
# (`library_selectors`), so the other two transports share their models and what those computed
# (serving/shared.py: one copy per version content hash, wherever its files were verified); a transport run alone
# computes its own.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("demo:served_is_evaluated")]
REPORTED = "test"


def _stored(home: Path, asset: str) -> pd.DataFrame:
    return read_stored(home / "storage", asset, "demo")


def _evaluated(home: Path) -> list[tuple[str, Budget, pd.DataFrame]]:
    """(method, budget, the pipeline's selections at it) for every servable method and evaluated budget."""
    from covlab.serving.selector import SERVABLE

    grid = []
    for name in SERVABLE:
        entry = METHOD[name]
        if Report.COVERAGE in entry.reports:
            table = _stored(home, f"selection_{name}")
            k = int(table.groupby("query_id").size().max())
            grid.append((name, Budget(k=k), table))
        if Report.COMPARISON in entry.reports:
            table = _stored(home, f"budgeted_{name}")
            grid += [(name, Budget(tokens=int(b)), table[table["budget"] == b]) for b in sorted(set(table["budget"]))]
    return grid


def _requests(home: Path, table: pd.DataFrame, split: str | None = None):
    """(query_id, query text, candidates in pool order, the pipeline's ids) for every query of `table` (of `split`
    only, when given)."""
    queries = _stored(home, "queries").set_index("query_id")
    pools = _stored(home, "bm25_pools")
    corpus = _stored(home, "corpus").set_index("doc_id")["text"]
    for query_id, chosen in table.groupby("query_id"):
        if split is not None and queries.at[query_id, "split"] != split:
            continue
        docs = pools[pools["query_id"] == query_id].sort_values("rank")["doc_id"].tolist()
        yield (query_id, queries.at[query_id, "text"], [{"id": d, "text": corpus[d]} for d in docs],
               chosen.sort_values("rank")["doc_id"].tolist())


@pytest.fixture(scope="module")
def served(demo_home, tmp_path_factory):
    home, _ = demo_home
    return home, tmp_path_factory.mktemp("serving-cache"), _evaluated(home)


def _compare(home: Path, grid, select, split: str | None = None) -> int:
    """Every query of `grid` (of `split` only, when given) through `select(name, budget, query, candidates) ->
    (ids, decision)`; the number compared. Fails listing the first mismatches, or a method on estimated coverage
    that did not replay the evaluation's own decision at its budget."""
    compared, mismatches = 0, []
    for name, budget, table in grid:
        for query_id, query, candidates, expected in _requests(home, table, split):
            ids, decision = select(name, budget, query, candidates)
            if ids != expected:
                mismatches.append((name, str(budget), query_id, ids, expected))
            if METHOD[name].coverage.estimated:
                assert decision["rule"] == "evaluated", (name, budget, decision)
            compared += 1
    assert not mismatches, mismatches[:5]
    return compared


def test_the_grid_holds_every_servable_method_at_k_and_at_every_token_budget(served):
    home, _, grid = served
    methods = {name for name, _, _ in grid}
    assert {"relevance", "relevance_coverage_trained", "mmr", "facloc", "adagres", "lmvu", "coverage_greedy",
            "coverage_greedy_soft", "bm25"} <= methods
    budgets = {(name, budget.unit) for name, budget, _ in grid}
    assert ("coverage_greedy", "k") in budgets and ("coverage_greedy", "tokens") in budgets
    assert len({b.limit for n, b, _ in grid if n == "mmr"}) >= 3


@pytest.fixture(scope="module")
def library_selectors() -> dict:
    """The selectors load_selector gave, by method, kept for the module (see above)."""
    return {}


def test_load_selector_chooses_what_the_selection_assets_chose(served, library_selectors, monkeypatch):
    from covlab.serving import load_selector

    home, cache, grid = served
    monkeypatch.setenv("COVLAB_HOME", str(home))

    def select(name, budget, query, candidates):
        if name not in library_selectors:
            library_selectors[name] = load_selector(name, "demo", cache=cache)
        answer = library_selectors[name].select(query, candidates, budget)
        return answer.ids, answer.decision

    assert _compare(home, grid, select) >= 150


def test_the_pyfunc_of_each_serving_version_chooses_what_the_selection_assets_chose(served, monkeypatch):
    import json

    import mlflow.pyfunc

    from covlab.serving import pyfunc_model_config

    home, cache, grid = served
    monkeypatch.setenv("COVLAB_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home}/mlflow/mlflow.db")
    versioned = [(name, budget, table) for name, budget, table in grid if _has_pyfunc(name)]
    models = {}

    def select(name, budget, query, candidates):
        if name not in models:
            models[name] = mlflow.pyfunc.load_model(f"models:/covlab.demo.{pyfunc_selector(name).asset}@champion",
                                                    model_config=pyfunc_model_config(name, "demo", cache=cache))
        row = {"query": query, "candidates": [c["text"] for c in candidates],
               **({"k": budget.limit} if budget.k is not None else {"budget_tokens": budget.limit})}
        (answer,) = models[name].predict(pd.DataFrame([row])).to_dict("records")
        return [candidates[int(i)]["id"] for i in answer["ids"]], json.loads(answer["selection"])["decision"]

    assert _compare(home, versioned, select, REPORTED) >= 20
    assert {"lmvu", "coverage_greedy", "relevance_coverage_trained"} <= set(models)


def _has_pyfunc(name: str) -> bool:
    """Whether a registered version serves `name` as a pyfunc (the methods whose score decides a champion)."""
    try:
        pyfunc_selector(name)
    except ValueError:
        return False
    return True


def test_v1_select_chooses_what_the_selection_assets_chose(served, monkeypatch):
    from fastapi.testclient import TestClient

    from covlab.serving.http import create_app, registry_methods
    from covlab.serving.selector import SERVABLE

    home, cache, grid = served
    monkeypatch.setenv("COVLAB_HOME", str(home))
    with TestClient(create_app(registry_methods(list(SERVABLE), "demo"))) as client:
        def select(name, budget, query, candidates):
            answer = client.post("/v1/select", json={"method": name, "query": query, "candidates": candidates,
                                                     "budget": {budget.unit: budget.limit}})
            assert answer.status_code == 200, answer.text
            return [item["id"] for item in answer.json()["chosen"]], answer.json()["decision"]

        assert _compare(home, grid, select, REPORTED) >= 75


def test_a_budget_never_evaluated_says_which_rule_it_applied(served, monkeypatch):
    from covlab.serving import load_selector

    home, cache, grid = served
    monkeypatch.setenv("COVLAB_HOME", str(home))
    selector = load_selector("coverage_greedy", "demo", cache=cache)
    name, budget, table = next((n, b, t) for n, b, t in grid if n == "coverage_greedy" and b.tokens is not None)
    _, query, candidates, _ = next(_requests(home, table))
    untuned = selector.select(query, candidates, Budget(tokens=budget.limit + 1))
    assert untuned.decision["rule"] == "nearest"
    assert untuned.decision["blend_chosen_for"] == f"tokens={budget.limit}"
    assert f"tokens={budget.limit + 1} was never evaluated" in untuned.decision["reason"]
