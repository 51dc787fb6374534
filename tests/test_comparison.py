"""The token-budgeted comparison (models/comparison.py, each method run by models/runs.run_method from the
registry) on generated pools: budgets are never exceeded, the exact oracles are never beaten, topic-grouped
folds never mix a topic between training and evaluation, and the report's tables agree with the figures they
summarise."""

import numpy as np
import pandas as pd
import pytest

from covlab.models.comparison import (LONG_ITEM_BUDGETS, SHORT_ITEM_BUDGETS, compare, default_token_budgets,
                                      embed_items, method_protocols, method_rvc1, pool_token_counts, resolve_budgets,
                                      train_lmvu_ranker)
from covlab.models.lmvu import LMVU, LMVUSettings, fold_rankers
from covlab.models.protocol import EvaluationProtocol
from covlab.models.registry import Report, SelectorSettings, method, methods
from covlab.models.report import report_figures
from covlab.models.runs import ByQuery, run_method
from covlab.models.schemas import FULL_SUPPORT, QUERIES
from covlab.models.selection import embedded_pools
from covlab.models.selectors import Budget
from covlab.models.trust import EstimateTrust
from covlab.models.viewpoints import rvc1

DIM = 16
BUDGETS = (40, 80, 160)
TOKEN_BUDGETS = [Budget(tokens=b) for b in BUDGETS]
SETTINGS = SelectorSettings(tau=0.3, mmr_lambda=0.5)
BUDGETED_METHODS = methods(Report.COMPARISON)


def gate(dev_auc: float) -> EstimateTrust:
    """The estimator gate alone (no blend, as the token comparison selects): trusted at a dev ROC-AUC of 0.65."""
    return EstimateTrust(dev_auc=dev_auc, min_dev_auc=0.65, tune_split="dev", nugget_links=None, weights=None,
                         alpha=0.5)


def generated(n_topics: int = 5, seed: int = 0):
    """Tables of a small dataset: per topic two queries (stances); each query's pool holds 20 documents, some
    covering one of its 3-5 viewpoints (noisy copies of the viewpoint's direction), some restating the query
    and covering nothing. Embeddings and token counts are given directly (ITEM_EMBEDDINGS, TOKEN_COUNTS)."""
    rng = np.random.default_rng(seed)
    queries, pools, corpus, nuggets, links, embeddings, tokens = [], [], [], [], [], [], []

    def unit(v):
        return (v / np.linalg.norm(v)).astype(np.float32)

    for t in range(n_topics):
        for stance in ("pro", "con"):
            q = f"t{t}-{stance}"
            split = "train" if t < n_topics - 2 else ("dev" if t == n_topics - 2 else "test")
            queries.append({"query_id": q, "text": f"query {q}", "split": split, "topic": f"t{t}"})
            q_vec = rng.normal(size=DIM)
            embeddings.append(("query", q, 0, unit(q_vec)))
            views = [rng.normal(size=DIM) for _ in range(int(rng.integers(3, 6)))]
            for v in range(len(views)):
                nuggets.append({"query_id": q, "nugget_id": f"{q}/v{v}", "text": f"viewpoint {v}"})
            for i in range(20):
                d = f"{q}/d{i}"
                covered = int(rng.integers(len(views))) if i % 3 else None
                vec = (views[covered] if covered is not None else q_vec) + 0.4 * rng.normal(size=DIM)
                embeddings.append(("document", d, 0, unit(vec)))
                tokens.append({"doc_id": d, "tokens": int(rng.integers(8, 40))})
                corpus.append({"doc_id": d, "title": "", "text": f"document {d}", "source_unit": f"{q}/u{i // 2}"})
                pools.append({"query_id": q, "doc_id": d, "rank": i + 1, "score": 1.0 / (i + 1)})
                if covered is not None:
                    links.append({"query_id": q, "doc_id": d, "nugget_id": f"{q}/v{covered}", "grade": 1})
    return {"queries": QUERIES.conform(pd.DataFrame(queries)), "bm25_pools": pd.DataFrame(pools),
            "corpus": pd.DataFrame(corpus), "nuggets": pd.DataFrame(nuggets), "nugget_links": pd.DataFrame(links),
            "item_embeddings": pd.DataFrame(embeddings, columns=["kind", "item_id", "atom", "vector"]),
            "token_counts": pd.DataFrame(tokens)}


def pools_of(tables, ids=None):
    ids = ids if ids is not None else sorted(set(tables["bm25_pools"]["query_id"]))
    return embedded_pools(tables["bm25_pools"], tables["queries"], tables["item_embeddings"], tables["token_counts"],
                          tables["corpus"], ids, tables["nuggets"], tables["nugget_links"])


@pytest.fixture(scope="module")
def tables():
    return generated()


@pytest.fixture(scope="module")
def all_selections(tables):
    """Every method's selections over every generated pool; the estimated matrices are the gold matrix
    blurred, the LMVU ranker is fit on the train queries with C chosen on the dev queries (train_lmvu_ranker
    under the split protocol)."""
    pools = pools_of(tables)
    rng = np.random.default_rng(1)
    links = tables["nugget_links"]
    estimated = (tables["bm25_pools"].merge(tables["nuggets"][["query_id", "nugget_id"]], on="query_id")
                 .rename(columns={"nugget_id": "subq_id"})[["query_id", "doc_id", "subq_id"]])
    linked = set(zip(links["doc_id"], links["nugget_id"]))
    estimated["probability"] = np.clip([0.7 * ((d, s) in linked) + 0.3 * rng.random()
                                        for d, s in zip(estimated["doc_id"], estimated["subq_id"])], 0, 1)
    training = train_lmvu_ranker(pools, EvaluationProtocol("split"), BUDGETS, LMVUSettings(states_per_query=4, seed=0),
                                 SETTINGS, links, tables["queries"], alpha=0.5)
    out = {}
    for entry in BUDGETED_METHODS:
        estimated_coverage = estimated if entry.coverage.estimated else None
        out[entry.name] = run_method(entry, pools, TOKEN_BUDGETS, SETTINGS, model=training.trained.ranker,
                                     coverage=estimated_coverage,
                                     trust=gate(0.9) if entry.coverage.estimated else None).table
    return pools, out, training


@pytest.fixture(scope="module")
def comparison(tables, all_selections):
    pools, selections, _ = all_selections
    return compare(selections, pools, tables["nugget_links"], alpha=0.5, baseline="relevance", seed=0)


def test_every_budgeted_selection_fits_its_budget_and_names_pool_documents(tables, all_selections):
    pools, selections, _ = all_selections
    assert set(selections) == {"relevance", "mmr", "facloc", "adagres", "lmvu", "coverage_greedy",
                               "coverage_greedy_soft", "gold_nugget_bound", "gold_nugget_bound_soft", "oracle_greedy",
                               "oracle_rvc1", "oracle_rvc2"}
    cost = dict(zip(tables["token_counts"]["doc_id"], tables["token_counts"]["tokens"]))
    for name, table in selections.items():
        assert set(table["budget"]) == set(BUDGETS), name
        for (query_id, budget), rows in table.groupby(["query_id", "budget"]):
            assert sum(cost[d] for d in rows["doc_id"]) <= budget, (name, query_id, budget)
            assert set(rows["doc_id"]) <= set(pools[query_id].doc_ids)
            assert rows["doc_id"].is_unique and list(rows["rank"]) == list(range(1, len(rows) + 1))


def test_the_exact_oracles_are_never_beaten_and_headroom_is_their_difference(comparison):
    result = comparison
    figures = result.figures
    for metric, oracle in (("rvc1", "oracle_rvc1"), ("rvc2", "oracle_rvc2")):
        rows = figures[figures["metric"] == metric].pivot_table(index=["budget", "query_id"], columns="method",
                                                                 values="value")
        assert (rows.drop(columns=[oracle]).le(rows[oracle] + 1e-12, axis=0)).all().all(), metric
        # oracle - method averaged over queries is the headroom column
        for name in ("relevance", "lmvu", "oracle_greedy"):
            for budget in BUDGETS:
                expected = (rows.loc[budget, oracle] - rows.loc[budget, name]).mean()
                assert result.headroom.loc[(name, budget), f"{metric}_headroom"] == pytest.approx(expected)
    # oracle value never falls as the budget grows
    oracle_means = result.summary.loc["oracle_rvc1", "rvc1"]
    assert list(oracle_means) == sorted(oracle_means)


def test_summary_and_paired_tables(all_selections, comparison):
    pools, result = all_selections[0], comparison
    assert list(dict.fromkeys(result.summary.index.get_level_values("method"))) == [m.name for m in BUDGETED_METHODS]
    assert (result.summary["queries"] == len(pools)).all()
    figures = result.figures
    mean = figures[(figures["method"] == "mmr") & (figures["budget"] == 80) & (figures["metric"] == "rvc1")]["value"]
    assert result.summary.loc[("mmr", 80), "rvc1"] == pytest.approx(mean.mean())
    # exact oracles are sets: no rank measures
    assert np.isnan(result.summary.loc[("oracle_rvc1", 80), "alpha_ndcg@10"])
    pairs = set(result.paired.index.droplevel(["budget", "metric"]))
    assert ("lmvu", "mmr") in pairs and ("facloc", "relevance") in pairs and ("relevance", "relevance") not in pairs
    row = result.paired.loc[("lmvu", "mmr", 80, "rvc1")]
    assert row["n"] == len(pools) and row["ci_low"] <= row["mean_difference"] <= row["ci_high"]
    assert row["wins"] + row["ties"] + row["losses"] == len(pools)


def test_stored_report_rows_are_the_figures_and_their_means_per_method_budget_split_metric(comparison):
    figures = comparison.figures
    stored = report_figures(figures, "generated", None)
    pd.testing.assert_frame_equal(stored.iloc[:len(figures)][list(figures.columns)], figures, check_dtype=False)
    aggregates = stored.iloc[len(figures):]
    assert aggregates["query_id"].isna().all() and stored["k"].isna().all()
    expected = figures.groupby(["method", "budget", "split", "metric"], as_index=False)["value"].mean()
    pd.testing.assert_frame_equal(aggregates[list(expected.columns)].reset_index(drop=True), expected)
    mmr = (aggregates["method"] == "mmr") & (aggregates["budget"] == 80) & (aggregates["metric"] == "rvc1")
    by_split = aggregates[mmr].set_index("split")["value"]
    assert set(by_split.index) == {"train", "dev", "test"}
    for split, value in by_split.items():
        rows = figures[(figures["method"] == "mmr") & (figures["budget"] == 80) & (figures["metric"] == "rvc1")
                       & (figures["split"] == split)]
        assert len(rows) == 2 * (3 if split == "train" else 1) and value == pytest.approx(rows["value"].mean())


def test_method_rvc1_is_the_mean_rvc1_of_the_selections_per_budget(tables, all_selections):
    pools, selections, _ = all_selections
    dev = {q: p for q, p in pools.items() if p.split == "dev"}
    mean, by_budget = method_rvc1("mmr", dev, BUDGETS, tables["nugget_links"], SETTINGS, alpha=0.5)
    table = selections["mmr"]
    for budget in BUDGETS:  # by hand: RVC1 of the chosen rows of each dev query's gold matrix
        values = []
        for q, p in dev.items():
            chosen = table[(table["query_id"] == q) & (table["budget"] == budget)]["doc_id"]
            index = {d: i for i, d in enumerate(p.doc_ids)}
            values.append(rvc1(p.gold, np.array([index[d] for d in chosen], dtype=np.int64)))
        assert by_budget[budget] == pytest.approx(np.mean(values))
    assert mean == pytest.approx(np.mean([by_budget[b] for b in BUDGETS]))
    assert 0 < mean < 1
    with pytest.raises(ValueError, match="one split"):
        method_rvc1("mmr", pools, BUDGETS, tables["nugget_links"], SETTINGS, alpha=0.5)


def test_estimated_methods_keep_relevance_order_below_the_estimator_gate(tables):
    pools = pools_of(tables)
    coverage = pd.DataFrame({"query_id": [next(iter(pools))], "doc_id": [pools[next(iter(pools))].doc_ids[0]],
                             "subq_id": ["s"], "probability": [0.9]})
    gated = run_method(method("coverage_greedy"), pools, TOKEN_BUDGETS, SETTINGS, coverage=coverage, trust=gate(0.5))
    relevance = run_method(method("relevance"), {q: pools[q] for q in coverage["query_id"]}, TOKEN_BUDGETS, SETTINGS)
    details = gated.details()
    assert details["fell_back"] and details["queries"] == 1
    assert details["estimator_gate"] == "dev ROC-AUC 0.5000 < 0.6500: the estimate is too close to chance to select by"
    pd.testing.assert_frame_equal(gated.table, relevance.table)
    with pytest.raises(ValueError, match="coverage_greedy reads an estimated coverage matrix: give the estimator's "
                                         "trust"):
        run_method(method("coverage_greedy"), pools, TOKEN_BUDGETS, SETTINGS, coverage=coverage)


def test_lmvu_training_under_the_split_protocol(tables, all_selections):
    """The ranker is fit on train (C chosen on dev); its dev RVC1 is method_rvc1 of its selections on the dev
    pools; no fold rankers without cross-validation."""
    pools, _, training = all_selections
    dev = {q: p for q, p in pools.items() if p.split == "dev"}
    assert training.folds == []
    assert training.dev_rvc1_by_budget == method_rvc1("lmvu", dev, BUDGETS, tables["nugget_links"], SETTINGS,
                                                      alpha=0.5, model=training.trained.ranker)[1]
    assert 0 <= training.chance < training.top1 <= 1
    with pytest.raises(ValueError, match="lmvu needs its trained model"):
        run_method(method("lmvu"), pools, TOKEN_BUDGETS, SETTINGS)


def test_cross_validated_lmvu_never_trains_on_the_topics_it_selects_for(tables):
    pools = pools_of(tables)
    plan = EvaluationProtocol("grouped_cv", folds=3, seed=0).fold_plan(tables["queries"])
    rankers = fold_rankers(pools, plan, TOKEN_BUDGETS, LMVUSettings(states_per_query=3, seed=0))
    topic = {q: p.topic for q, p in pools.items()}
    for ranker in rankers:
        evaluated = {topic[q] for q in ranker.fold.evaluated}
        assert evaluated.isdisjoint({topic[q] for q in ranker.fold.train + ranker.fold.tune})
        assert set(ranker.fold.train).isdisjoint(ranker.fold.tune)
    by_query = ByQuery({q: ranker.trained.ranker for ranker in rankers for q in ranker.fold.evaluated})
    selections = run_method(method("lmvu"), pools, TOKEN_BUDGETS, SETTINGS, model=by_query)
    assert set(selections.table["query_id"]) == set(pools)  # every query selected once, by its fold's ranker
    assert not selections.table.duplicated(["query_id", "budget", "rank"]).any()
    for ranker in rankers:
        for q in ranker.fold.evaluated:
            for budget in TOKEN_BUDGETS:
                expected = LMVU(ranker.trained.ranker)(pools[q].pool, budget).items
                np.testing.assert_array_equal(selections.selections[(q, budget.limit)].items, expected)
    with pytest.raises(ValueError, match="query 't0-pro' has no fold model"):
        ByQuery({}).of("t0-pro")


def test_default_budgets_follow_the_item_length_and_configured_ones_win():
    short = pd.DataFrame({"doc_id": ["a", "b", "c"], "tokens": [18, 22, 70]})
    long = pd.DataFrame({"doc_id": ["a", "b"], "tokens": [120, 128]})
    assert default_token_budgets(short) == SHORT_ITEM_BUDGETS and default_token_budgets(long) == LONG_ITEM_BUDGETS
    assert resolve_budgets([256, 32, 32], short) == (32, 256)
    with pytest.raises(ValueError, match="positive"):
        resolve_budgets([0], short)


def test_evaluated_queries_by_protocol(tables):
    pools, queries = tables["bm25_pools"], tables["queries"]
    assert EvaluationProtocol("split", splits=["test"]).evaluated(queries, pools["query_id"]) == ["t4-con", "t4-pro"]
    assert (EvaluationProtocol("grouped_cv", splits=["test"]).evaluated(queries, pools["query_id"])
            == sorted(set(pools["query_id"])))


def test_the_report_says_how_each_method_met_its_training_data():
    split = method_protocols(EvaluationProtocol("split", splits=["dev", "test"]))
    assert list(split) == [m.name for m in BUDGETED_METHODS]
    assert split["lmvu"] == "fit on train, settings chosen on dev" and split["mmr"] == "no training"
    assert split["coverage_greedy"] == ("standard split: the estimator trained on train, selections for dev/test "
                                        "queries only")
    assert {split[name] for name in ("oracle_greedy", "oracle_rvc1", "oracle_rvc2")} == {"gold labels (bound)"}
    grouped = method_protocols(EvaluationProtocol("grouped_cv"))
    assert grouped["lmvu"].startswith("refit per topic-grouped fold") and grouped["relevance"] == "no training"


def test_embedded_items_and_token_counts_cover_every_pooled_text():
    pools = pd.DataFrame({"query_id": ["q1", "q1"], "doc_id": ["a", "b"], "rank": [1, 2], "score": [1.0, 0.5]})
    queries = QUERIES.conform(pd.DataFrame({"query_id": ["q1"], "text": ["Which?"], "split": ["test"]}))
    texts = {"a": "One short sentence here. And a second one follows.", "b": "Only one sentence here."}
    seen = []

    def embed(batch):
        seen.extend(batch)
        return np.eye(len(batch), 4, dtype=np.float32)

    table = embed_items(pools, queries, texts, embed)
    assert list(zip(table["kind"], table["item_id"], table["atom"])) == [
        ("query", "q1", 0), ("document", "a", 0), ("atom", "a", 0), ("atom", "a", 1), ("document", "b", 0)]
    assert seen[2:4] == ["One short sentence here.", "And a second one follows."]
    counts = pool_token_counts(pools, texts, lambda batch: np.array([len(t.split()) for t in batch]))
    assert dict(zip(counts["doc_id"], counts["tokens"])) == {"a": 9, "b": 4}
    assert queries["topic"].tolist() == ["q1"]  # a query without a topic is its own


def test_markdown_tables_have_flat_labels_never_tuples():
    from covlab.models.comparison import markdown

    paired = pd.DataFrame({"a": ["lmvu"], "b": ["mmr"], "budget": [32], "difference": [0.12345]}).set_index(
        ["a", "b", "budget"])
    assert markdown(paired, 3).splitlines() == ["| a    | b   |   budget |   difference |",
                                                "|:-----|:----|---------:|-------------:|",
                                                "| lmvu | mmr |       32 |        0.123 |"]
    wide = pd.DataFrame([[0.5, 0.25]], index=pd.Index(["coverage_greedy"], name="selection"),
                        columns=pd.MultiIndex.from_tuples([("alpha_ndcg@10", "bm25"), ("alpha_ndcg@10", "mcompass")]))
    header = markdown(wide).splitlines()[0]
    assert "alpha_ndcg@10 / bm25" in header and "alpha_ndcg@10 / mcompass" in header and "(" not in header
    assert markdown(pd.DataFrame()) == "n/a"


def test_graded_nuggets_add_vital_strecall_which_is_strecall_over_the_full_support_of_vital_nuggets(
        tables, all_selections, comparison):
    """A dataset whose nuggets are graded vital or okay (TREC RAG 2024) is also measured by vital_strecall@10 at
    every budget: StRecall@10 over the links of full support (grade 2) of its vital nuggets alone, TREC RAG's strict
    vital score; with every nugget vital and every link full support it is StRecall@10 itself. Ungraded datasets
    (the others, the demo) never get it."""
    pools, selections, _ = all_selections
    nuggets = tables["nuggets"]
    links = tables["nugget_links"].assign(grade=FULL_SUPPORT)
    assert "vital_strecall@10" not in set(comparison.figures["metric"])
    every = set(zip(nuggets["query_id"], nuggets["nugget_id"]))
    graded = compare(selections, pools, links, alpha=0.5, baseline="relevance", seed=0, vital=every)
    figures = graded.figures.set_index(["method", "budget", "query_id", "metric"])["value"].unstack("metric")
    assert figures["vital_strecall@10"].notna().sum() > 50
    assert np.allclose(figures["vital_strecall@10"].dropna(), figures.loc[figures["vital_strecall@10"].notna(),
                                                                         "strecall@10"])
    half = {pair for i, pair in enumerate(sorted(every)) if i % 2 == 0}
    partial = links.assign(grade=[1 if i % 3 == 0 else FULL_SUPPORT for i in range(len(links))])
    some = compare(selections, pools, partial, alpha=0.5, baseline="relevance", seed=0, vital=half)
    strict = partial[[(q, n) in half and g == FULL_SUPPORT
                      for q, n, g in zip(partial["query_id"], partial["nugget_id"], partial["grade"])]]
    alone = compare(selections, pools, strict, alpha=0.5, baseline="relevance", seed=0)
    vital = some.figures[some.figures["metric"] == "vital_strecall@10"].set_index(["method", "budget", "query_id"])
    strecall = alone.figures[alone.figures["metric"] == "strecall@10"].set_index(["method", "budget", "query_id"])
    both = vital["value"].to_frame("vital").join(strecall["value"].rename("alone"), how="inner")
    assert len(both) > 50 and np.allclose(both["vital"], both["alone"])
    assert "vital_strecall@10" in some.summary.columns
