"""The coverage pipeline end to end on demo with a tiny encoder: selections, the report, the results
store, MLflow versions, champion promotion, the lineage audit and the nightly re-evaluation."""

import json
import re
from pathlib import Path

import pandas as pd
import pytest
from dagster import AssetCheckSeverity, AssetKey, Definitions

from covlab.orchestration.cli import materialize
from covlab.orchestration.definitions import ASSETS, default_resources
from covlab.resources.lineage import audit_materialization
from covlab.resources.lineage_text import render_text
from covlab.resources.report_lineage import audit_figures
from covlab.resources.evaluation import EvaluationResource
from conftest import write_covlab_layout
from tiny_bert import tiny_pipeline_config

pytestmark = pytest.mark.pipeline
PIPELINE = [a for a in ASSETS if not {k.to_user_string() for k in a.keys} & {"answers", "answer_report"}]


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dir):
    """One full materialization of the pipeline on demo, shared by the tests below (module scope)."""
    import os

    from dagster import DagsterInstance

    from covlab.orchestration.instance import dagster_home

    home = tmp_path_factory.mktemp("pipeline") / "home"
    saved = {k: os.environ.get(k) for k in ("COVLAB_HOME", "DAGSTER_HOME")}
    os.environ["COVLAB_HOME"], os.environ["DAGSTER_HOME"] = str(home), str(home / "dagster")
    dagster_home()
    instance = DagsterInstance.get()
    config = tiny_pipeline_config(str(tiny_model_dir))
    result = materialize("demo", None, config, instance)
    yield {"home": home, "instance": instance, "result": result, "config": config}
    instance.dispose()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _as_json(node) -> str:
    return json.dumps(node.to_dict(), indent=2, sort_keys=True, default=str)


def _stored(home, key: str) -> pd.DataFrame:
    return pd.read_parquet(home / "storage" / key / "demo.parquet")


@pytest.mark.slow
def test_reproduce_a_figure_then_name_a_tampered_table_as_the_first_divergence(built, tmp_path):
    """`covlab reproduce` rebuilds a figure's lineage in a scratch home and compares it asset by asset. One rebuild
    shows both outcomes: in a copy of the built home a stored selection is altered; re-materializing the report from
    it is refused (its bytes no longer have their writer's hash) unless the IO manager's accept_modified is set;
    then the rebuild reproduces every other asset of the lineage byte for byte (the trainings of the estimator, the
    bi-encoder and the LMVU ranker included) and names the altered selection as the first divergence, with what
    differs. A checkout with uncommitted changes is refused unless --allow-dirty, before anything is rebuilt. (On
    the tiny encoder: the same code path as `make demo`'s figures, at a fraction of its training time. First in
    this module, before the tests below materialize other versions into the home.)"""
    import os
    import shutil
    import subprocess
    import sys

    from covlab.resources.source import read_source_state

    home = built["home"]
    covlab = str(Path(sys.executable).parent / "covlab")
    figure = ["--dataset", "demo", "--method", "coverage_greedy", "--metric", "alpha_ndcg@10", "--split", "test",
              "--budget", "k=10", "--scratch", str(tmp_path)]
    import torch

    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "MAKEFLAGS", "MAKELEVEL")}
    # The rebuild trains on as many threads as the build did (a suite worker may have set torch to one): a
    # float sum's order, and so the trained weights, may depend on it.
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())

    def run(where: Path, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run([covlab, *command], env={**env, "COVLAB_HOME": str(where),
                                                       "DAGSTER_HOME": str(where / "dagster")},
                              capture_output=True, text=True, timeout=900)

    if read_source_state().dirty:  # the build recorded this checkout's uncommitted changes: no commit holds them
        refused = run(home, "reproduce", *figure)
        assert refused.returncode == 2 and "uncommitted changes" in refused.stderr, refused.stderr[-2000:]

    copy = tmp_path / "tampered"
    shutil.copytree(home, copy)
    stored = copy / "storage" / "selection_coverage_greedy" / "demo.parquet"
    selection = pd.read_parquet(stored)
    queries = pd.read_parquet(copy / "storage" / "queries" / "demo.parquet")
    tested = selection["query_id"].isin(queries.loc[queries["split"] == "test", "query_id"])
    selection.loc[tested, "rank"] = selection.loc[tested, "rank"].max() + 1 - selection.loc[tested, "rank"]
    selection.to_parquet(stored, index=False)
    refused = run(copy, "materialize", "--dataset", "demo", "--select", "coverage_report")
    assert refused.returncode != 0 and f"{stored} was changed after run" in refused.stdout + refused.stderr
    accepting = tmp_path / "accept_modified.yaml"  # the IO manager's documented override
    accepting.write_text(json.dumps({"resources": {"io_manager": {"config": {
        "base_dir": str(copy / "storage"), "accept_modified": True}}}}))
    assert run(copy, "materialize", "--dataset", "demo", "--select", "coverage_report",
               "--config", str(accepting)).returncode == 0
    # The report was re-materialized just now: its lineage records the checkout as it is at this moment, clean or
    # not, so the rebuild is allowed from this checkout either way (the refusal itself is tested above).
    diverged = run(copy, "reproduce", *figure, "--allow-dirty")
    assert diverged.returncode == 1, diverged.stdout[-3000:] + diverged.stderr[-3000:]
    verdict = next(line for line in diverged.stdout.splitlines() if line.startswith("DIVERGED"))
    assert verdict.startswith("DIVERGED at selection_coverage_greedy [demo]"), diverged.stdout
    # the altered selection and the report made from it differ; every other asset of the lineage reproduced
    rebuilt = int(re.search(r"rebuilt (\d+) assets", diverged.stdout).group(1))
    assert f"the 2 of {rebuilt} assets whose content differs" in verdict and rebuilt > 10, verdict
    assert "the stored value was altered after it was written" in diverged.stdout
    assert "rank: max |difference|" in diverged.stdout
    [kept] = tmp_path.glob("reproduce-*")  # kept for inspection, the trainings rebuilt in it
    assert all((kept / "storage" / trained).is_dir() for trained in ("coverage_estimator", "coverage_biencoder"))


@pytest.mark.slow
def test_every_selection_has_k_documents_from_the_pool(built):
    home = built["home"]
    pools = _stored(home, "bm25_pools")
    pool_pairs = set(map(tuple, pools[["query_id", "doc_id"]].values))
    queries = _stored(home, "queries")
    evaluated = set(queries.loc[queries["split"].isin(["dev", "test"]), "query_id"])
    for name in ("bm25", "relevance", "relevance_coverage_trained", "coverage_greedy", "coverage_greedy_soft",
                 "gold_nugget_bound", "gold_nugget_bound_soft", "oracle_greedy"):
        selection = _stored(home, f"selection_{name}")
        assert set(selection["query_id"]) == evaluated, name
        assert (selection.groupby("query_id").size() == 10).all(), name
        assert set(map(tuple, selection[["query_id", "doc_id"]].values)) <= pool_pairs, name
        assert not selection.duplicated(["query_id", "doc_id"]).any(), name


@pytest.mark.slow
def test_budgeted_comparison_on_demo_fits_every_budget_and_reports_every_method(built):
    """Every budgeted method at the demo's default budgets: selections within budget, the exact oracles
    never beaten, the report's tables in metadata, per-query figures in the results store with their budget,
    the LMVU ranker registered with its coefficients."""
    from covlab.models.comparison import SHORT_ITEM_BUDGETS
    from covlab.models.registry import Report, methods

    BUDGETED_METHODS = methods(Report.COMPARISON)

    home, result = built["home"], built["result"]
    tokens = _stored(home, "token_counts").set_index("doc_id")["tokens"]
    assert tokens.median() <= 64  # demo items are short: the short-item budgets apply
    for method in BUDGETED_METHODS:
        selection = _stored(home, f"budgeted_{method.name}")
        assert set(selection["budget"]) <= set(SHORT_ITEM_BUDGETS), method.name
        spent = selection.assign(tokens=selection["doc_id"].map(tokens)).groupby(["query_id", "budget"])["tokens"]
        assert (spent.sum() <= spent.sum().index.get_level_values("budget")).all(), method.name
    figures = _stored(home, "comparison_report")
    rvc1 = figures[figures["metric"] == "rvc1"].pivot_table(index=["budget", "query_id"], columns="method",
                                                            values="value")
    assert set(rvc1.columns) == {m.name for m in BUDGETED_METHODS}
    assert rvc1.drop(columns="oracle_rvc1").le(rvc1["oracle_rvc1"] + 1e-12, axis=0).all().all()
    event = result.asset_materializations_for_node("comparison_report")[0]
    assert "lmvu" in event.metadata["summary"].value and "rvc2_headroom" in event.metadata["headroom"].value
    assert re.search(r"\| lmvu +\| mmr +\| +\d+ \| ", event.metadata["paired"].value)  # flat labels, no tuple
    assert event.metadata["paired"].value.startswith("rvc1 only")  # the pairs shown are the headline metric's
    stored = default_resources(home)["results"].figures(dataset="demo", method="lmvu", metric="rvc1", budget=128)
    assert len(stored) and set(stored["budget"]) == {128}
    ranker = result.asset_materializations_for_node("lmvu_ranker")[0].metadata
    assert len(ranker["coefficients"].value) == 18 and 0 <= ranker["dev_pairwise_accuracy"].value <= 1
    assert default_resources(home)["tracking"].versions("covlab.demo.lmvu_ranker")


@pytest.mark.slow
def test_mcompass_bank_student_and_retrieval_report(built):
    """MCompassRAG on demo: one chunk per item, the capped bank, the estimator teacher, a registered student,
    every method ranking the whole corpus, and the report's figures in the results store."""
    import numpy as np

    from covlab.models.topics import TopicBank

    home, result = built["home"], built["result"]
    chunks, corpus = _stored(home, "chunks"), _stored(home, "corpus")
    assert (chunks["chunk_id"] == chunks["doc_id"]).all() and set(chunks["doc_id"]) == set(corpus["doc_id"])
    bank_value = json.loads((home / "storage" / "topic_metadata_bank" / "demo.json").read_text())
    bank = TopicBank.load(bank_value["path"])
    assert bank.centroids.shape[0] == len(chunks) // 10 and bank.content_hash() == bank_value["content_hash"]
    np.testing.assert_allclose(bank.theta.sum(axis=1), 1, atol=1e-5)
    teacher = _stored(home, "mcompass_teacher")
    taught = teacher["kind"].isin(["positive", "hard"])
    assert teacher.loc[taught, "teacher_logit"].notna().all() and teacher.loc[~taught, "teacher_logit"].isna().all()
    assert default_resources(home)["tracking"].versions("covlab.demo.mcompass_student")
    runs = _stored(home, "mcompass_retrieval")
    assert set(runs["method"]) == {"mcompass", "mcompass_no_selector", "mcompass_mean_pool", "dense", "bm25"}
    depth = runs.groupby(["method", "query_id"])["chunk_id"].nunique()
    assert depth.drop(index="bm25").eq(100).all() and depth["bm25"].le(100).all()  # BM25: only matching chunks
    figures = default_resources(home)["results"].figures(dataset="demo", method="mcompass", metric="IE")
    per_query = figures[figures["query_id"].notna()]
    assert len(per_query) == 11 and per_query["value"].between(0, 1).all()  # the 11 demo test queries
    report = _stored(home, "retrieval_report").pivot_table(index=["method", "query_id"], columns="metric",
                                                           values="value")
    np.testing.assert_allclose(report["IE"], report[["IE@1", "IE@3", "IE@5"]].mean(axis=1))
    np.testing.assert_allclose(report["IE@3"], report["P@3"] * report["R@3"])
    event = result.asset_materializations_for_node("retrieval_report")[0]
    assert "| mcompass_no_selector" in event.metadata["summary"].value


@pytest.mark.slow
def test_mcompass_pools_feed_the_coverage_family_and_the_pool_comparison(built):
    """The student's top documents as a candidate pool of bm25_pools' size (demo: one chunk per item, so its
    run in rank order), its estimated matrix over exactly those pairs, and the comparison of both pools under
    pool order and coverage greedy: every evaluated query, figures in the results store."""
    home, result = built["home"], built["result"]
    pools, runs = _stored(home, "mcompass_pools"), _stored(home, "mcompass_retrieval")
    queries = _stored(home, "queries")
    evaluated = set(queries.loc[queries["split"].isin(["dev", "test"]), "query_id"])
    assert set(pools["query_id"]) == evaluated and pools.groupby("query_id").size().eq(100).all()
    student = runs[runs["method"] == "mcompass"].sort_values(["query_id", "rank"])
    assert (pools.sort_values(["query_id", "rank"]).groupby("query_id")["doc_id"].apply(list).to_dict()
            == student.groupby("query_id")["chunk_id"].apply(list).to_dict())
    metadata = result.asset_materializations_for_node("mcompass_pools")[0].metadata
    for name in ("evidence_share_mcompass", "evidence_share_bm25", "mean_overlap_with_bm25"):
        assert 0 <= metadata[name].value <= 1, name
    assert metadata["mean_pool_size"].value == 100
    matrix = _stored(home, "mcompass_pool_coverage_matrix")
    assert (set(map(tuple, matrix[["query_id", "doc_id"]].drop_duplicates().values))
            == set(map(tuple, pools[["query_id", "doc_id"]].values)))
    assert matrix["probability"].between(0, 1).all()
    report = _stored(home, "pool_comparison")
    methods = {f"{source}:{selection}" for source in ("bm25", "mcompass")
               for selection in ("pool_order", "coverage_greedy")}
    assert set(report["method"]) == methods and set(report["metric"]) == {"alpha_ndcg@10", "strecall@10"}
    assert set(report["query_id"]) == evaluated and report["value"].between(0, 1).all()
    wide = report.pivot_table(index=["query_id", "metric"], columns="method", values="value")
    event = result.asset_materializations_for_node("pool_comparison")[0].metadata
    for source in ("bm25", "mcompass"):  # the near-chance tiny estimator: coverage greedy keeps the pool order
        assert event["decisions"].value[source]["fell_back"] is True
        assert wide[f"{source}:coverage_greedy"].equals(wide[f"{source}:pool_order"]), source
    assert re.search(r"\| coverage_greedy +\| strecall@10 +\| mcompass +\|", event["paired_vs_bm25_pool"].value)
    stored = default_resources(home)["results"].figures(dataset="demo", method="mcompass:pool_order",
                                                        metric="strecall@10")
    assert len(stored[stored["query_id"].notna()]) == len(evaluated)


@pytest.mark.slow
def test_oracle_greedy_strecall_is_never_beaten(built):
    report = _stored(built["home"], "coverage_report")
    strecall = report[report["metric"] == "strecall@10"].pivot_table(index="query_id", columns="method",
                                                                     values="value")
    for method in strecall.columns:
        assert (strecall["oracle_greedy"] >= strecall[method] - 1e-12).all(), method
    # on demo every nugget is reachable within 10 documents: the oracle covers everything
    assert (strecall["oracle_greedy"] == 1.0).all()


@pytest.mark.slow
def test_report_metadata_results_store_and_registered_models(built):
    instance, home = built["instance"], built["home"]
    event = instance.get_latest_materialization_event(AssetKey("coverage_report")).asset_materialization
    table1 = event.metadata["table1"].value
    for row in ("relevance", "+ coverage training", "+ estimator and greedy", "gold nuggets", "oracle greedy"):
        assert row in table1
    assert "dataset_tables" not in event.metadata["lineage"].value  # keys, not op names
    assert "corpus [demo]" in event.metadata["lineage"].value
    resources = default_resources(home)
    stored = resources["results"].figures(dataset="demo", metric="alpha_ndcg@10", split="test", aggregate_only=True)
    stored = stored[stored["report_asset"] == "coverage_report"]  # comparison_report stores its own oracle_greedy
    assert set(stored["method"]) >= {"relevance", "coverage_greedy", "oracle_greedy"}
    report = _stored(home, "coverage_report")
    mean = report[(report["method"] == "oracle_greedy") & (report["split"] == "test")
                  & (report["metric"] == "alpha_ndcg@10")]["value"].mean()
    assert stored.loc[stored["method"] == "oracle_greedy", "value"].iloc[0] == pytest.approx(mean)
    tracking = resources["tracking"]
    for selector in ("coverage_estimator", "coverage_biencoder"):
        versions = tracking.versions(f"covlab.demo.{selector}")
        assert len(versions) == 1
        tags = versions[0].tags
        assert tags["dagster.asset_key"] == selector and tags["dagster.partition"] == "demo"
        assert tags["dagster.run_id"] == built["result"].run_id
        assert "input_data_version.coverage_judgments" in tags
    from urllib.parse import urlparse

    from mlflow import MlflowClient
    from mlflow.models import Model

    client = MlflowClient(tracking_uri=tracking.tracking_uri)
    for selector, curve in (("coverage_estimator", "dev_auc"), ("coverage_biencoder", "train_loss"),
                            ("lmvu_ranker", "dev_pairwise_accuracy"), ("mcompass_student", "train_loss")):
        (version,) = tracking.versions(f"covlab.demo.{selector}")
        metadata = built["result"].asset_materializations_for_node(selector)[0].metadata
        assert metadata["mlflow_model_version"].value == tracking.version_url(version)
        assert metadata["training_curve"].value.startswith(f"![{selector} training curve](data:image/png;base64,")
        assert 1 in [m.step for m in client.get_metric_history(version.run_id, f"epoch/{curve}")]  # per epoch
        folder = urlparse(version.source).path  # the version page shows the MLmodel of this folder
        model = Model.load(folder)
        assert model.signature.inputs.input_names() and model.load_input_example(folder) is not None
    # first versions: the bi-encoder is promoted; the near-chance tiny estimator is gated (next test)
    assert set(tracking.versions("covlab.demo.coverage_biencoder")[0].aliases) == {"candidate", "champion"}
    assert set(tracking.versions("covlab.demo.coverage_estimator")[0].aliases) == {"candidate"}
    checks = {e.check_name: e.passed for e in built["result"].get_asset_check_evaluations()}
    assert checks["coverage_biencoder_champion"] and not checks["coverage_estimator_champion"]


@pytest.mark.slow
def test_the_reports_show_one_float_per_figure_an_inline_png_and_a_compact_lineage(built):
    """What the UI shows of a report: a float entry per (metric, method) aggregate of the reported split (the
    Plots tab charts them across materializations), inline PNG figures, and the lineage with each node once."""
    import base64
    import re

    from dagster import FloatMetadataValue, TextMetadataValue

    from covlab.models.plots import PNG_SIGNATURE

    event = built["instance"].get_latest_materialization_event(AssetKey("coverage_report"))
    meta = event.asset_materialization.metadata
    report = _stored(built["home"], "coverage_report")
    chosen = report[(report["split"] == "test") & (report["metric"] == "alpha_ndcg@10")
                    & (report["method"] == "coverage_greedy")]
    assert isinstance(meta["alpha_ndcg@10/coverage_greedy"], FloatMetadataValue)
    assert meta["alpha_ndcg@10/coverage_greedy"].value == pytest.approx(chosen["value"].mean())
    # the Plots tab charts each method's primary measure only, and no id
    assert not [key for key in meta if key.startswith(("strecall@10/", "p@10/", "ndcg@10/"))]
    assert isinstance(meta["results_store_report_id"], TextMetadataValue)
    image = re.fullmatch(r"!\[[^]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", meta["figure"].value)
    assert image and base64.b64decode(image.group(1)).startswith(PNG_SIGNATURE)
    assert "summary" not in meta  # it only repeated table1
    lineage = meta["lineage"].value
    assert "(shown above)" not in lineage and len(lineage) < 5_000  # the full tree was ~18,000 characters
    assert lineage.count("corpus [demo]") == 1 and "- coverage_greedy: selection_coverage_greedy (" in lineage
    comparison = built["result"].asset_materializations_for_node("comparison_report")[0].metadata
    assert isinstance(comparison["rvc1/budget_00128/lmvu"], FloatMetadataValue)
    assert comparison["figure"].value.startswith("![rvc1](data:image/png;base64,")
    assert "(shown above)" not in comparison["lineage"].value
    retrieval = built["result"].asset_materializations_for_node("retrieval_report")[0].metadata
    assert isinstance(retrieval["IE/mcompass"], FloatMetadataValue)
    assert not [key for key in retrieval if key.startswith(("P@", "R@", "IE@"))]


@pytest.mark.slow
def test_a_near_chance_estimator_warns_and_every_selection_on_it_keeps_the_fallback_order(built):
    """The tiny one-epoch estimator is near chance on demo: its check warns without stopping the run, the
    selections on its estimates equal the coverage bi-encoder order and say so, and it stays candidate."""
    home, result = built["home"], built["result"]
    dev_auc = json.loads((home / "storage" / "coverage_estimator" / "demo.json").read_text())["dev_auc"]
    assert dev_auc < EvaluationResource().min_estimator_dev_auc
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    gate = evaluations["coverage_estimator_dev_auc"]
    assert not gate.passed and gate.severity == AssetCheckSeverity.WARN
    assert gate.metadata["dev_auc"].value == dev_auc
    calibration = evaluations["estimated_gold_coverage_calibration"].metadata
    assert 0 <= calibration["brier"].value <= 1 and 0 <= calibration["ece"].value <= 1
    assert "is not promoted to champion" in evaluations["coverage_estimator_champion"].metadata["decision"].value
    fallback = _stored(home, "selection_relevance_coverage_trained")
    for name in ("coverage_greedy", "coverage_greedy_soft", "gold_nugget_bound", "gold_nugget_bound_soft"):
        assert _stored(home, f"selection_{name}").equals(fallback), name
        event = result.asset_materializations_for_node(f"selection_{name}")[0]
        assert event.metadata["fell_back"].value is True, name
        assert f"dev ROC-AUC {dev_auc:.4f} < 0.6500" in event.metadata["estimator_gate"].value, name


def _data_version(instance, key: str, partition: str = "demo") -> str:
    from dagster import AssetRecordsFilter

    record = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey(key),
                                                                asset_partitions=[partition]), limit=1).records[0]
    return record.asset_materialization.tags["dagster/data_version"]


def _defs(built, assets=ASSETS) -> Definitions:
    return Definitions(assets=assets, resources=default_resources(built["home"]))


@pytest.mark.slow
def test_nightly_runs_nothing_when_nothing_changed_then_only_a_changed_selector_and_its_report(built, nightly):
    from covlab.assets.selections import selection_asset
    from covlab.models.registry import method
    from covlab.orchestration.automation import with_nightly_condition

    ticks, defs = nightly(built["instance"]), _defs(built)
    assert ticks.night(defs) == {}  # nothing missing after the build
    changed = [a for a in ASSETS if AssetKey("selection_oracle_greedy") not in a.keys]
    changed.append(selection_asset(method("oracle_greedy"), code_version="2"))
    assert ticks.night(_defs(built, with_nightly_condition(changed))) == {
        "coverage_report": {"demo"}, "selection_oracle_greedy": {"demo"}, "transfer_report": {"demo"}}


@pytest.mark.slow
def test_data_versions_are_content_hashes_a_same_content_rerun_leaves_the_nightly_nothing_to_run(built, nightly):
    """Same inputs and seeds: the same data version, nothing requested downstream. A config change that alters
    the output: a new data version, and what reads it (up to the reports) is requested."""
    from covlab.models.versions import content_version

    instance, home = built["instance"], built["home"]
    ticks, defs = nightly(instance), _defs(built)
    assert ticks.night(defs) == {}
    before = _data_version(instance, "subquestions")
    assert before == content_version(_stored(home, "subquestions"))
    asked = built["config"]["ops"]["subquestions"]
    materialize("demo", ["subquestions"], {"ops": {"subquestions": asked}}, instance)
    assert _data_version(instance, "subquestions") == before
    assert ticks.night(defs) == {}

    fewer = {"config": {**asked["config"], "n": 2}}
    materialize("demo", ["subquestions"], {"ops": {"subquestions": fewer}}, instance)
    assert _data_version(instance, "subquestions") != before
    requested = ticks.night(defs)
    assert {"coverage_judgments", "coverage_report"} <= set(requested)
    assert "subquestions" not in requested and "bm25_pools" not in requested
    assert all(partitions == {"demo"} for partitions in requested.values())
    materialize("demo", ["subquestions"], {"ops": {"subquestions": asked}}, instance)  # as built, for what follows
    assert _data_version(instance, "subquestions") == before


@pytest.mark.slow
def test_candidate_sensor_requests_an_evaluation_once_per_new_candidate(built):
    from dagster import SkipReason, build_sensor_context

    from covlab.orchestration.automation import mlflow_candidate_sensor

    defs = Definitions(assets=ASSETS, sensors=[mlflow_candidate_sensor], resources=default_resources(built["home"]))
    sensor = defs.resolve_sensor_def("mlflow_candidate_sensor")
    context = build_sensor_context(instance=built["instance"], definitions=defs,
                                   resources={"tracking": default_resources(built["home"])["tracking"]})
    requests = sensor(context)
    assert [r.partition_key for r in requests] == ["demo"]  # every reader of a candidate ran after it was trained
    assert requests[0].asset_selection == [AssetKey("comparison_report"), AssetKey("coverage_report"),
                                           AssetKey("model_promotions"), AssetKey("pool_comparison"),
                                           AssetKey("retrieval_report")]
    assert "covlab.demo.coverage_estimator v1" in requests[0].tags["covlab/candidates"]
    again = build_sensor_context(instance=built["instance"], definitions=defs, cursor=context.cursor,
                                 resources={"tracking": default_resources(built["home"])["tracking"]})
    assert isinstance(sensor(again), SkipReason)  # nothing new in MLflow: no run


@pytest.mark.slow
def test_audit_walks_exact_pointers_and_flags_staleness_after_a_config_change(built):
    instance, home = built["instance"], built["home"]
    report = audit_materialization(instance, AssetKey("coverage_report"), "demo")
    text = render_text([report])
    for key in ("coverage_report", "selection_coverage_greedy", "estimated_coverage_matrix", "coverage_estimator",
                "coverage_judgments", "bm25_pools", "bm25_index", "corpus", "nugget_links"):
        assert f"{key} [demo]" in text, key
    assert "source_files" in text and "model_uri" in text and "STALE" not in text and "GAP" not in text
    first_json = _as_json(report)
    assert _as_json(audit_materialization(instance, AssetKey("coverage_report"), "demo")) == first_json

    def find(node, key):
        if node["asset_key"] == key:
            return node
        for child in node["inputs"]:
            hit = find(child, key)
            if hit:
                return hit

    # the subquestions the report read (a later same-content re-run is newer, and not stale)
    old_subquestions = find(json.loads(first_json), "subquestions")["storage_id"]
    config = built["config"]
    config["ops"]["subquestions"]["config"]["n"] = 4
    materialize("demo", ["subquestions"], {"ops": {"subquestions": config["ops"]["subquestions"]}}, instance)
    again = audit_materialization(instance, AssetKey("coverage_report"), "demo")
    tree = json.loads(_as_json(again))
    node = find(tree, "subquestions")
    assert node["storage_id"] == old_subquestions  # the version the report read, not the latest
    assert node["shaped_by"]["config"]["n"] == 10
    assert node["stale"] and "rematerialized since" in node["stale"]
    # --value finds the stored figure and audits the report that produced it
    figure = default_resources(home)["results"].figures(dataset="demo", method="oracle_greedy",
                                                        metric="alpha_ndcg@10", split="test", aggregate_only=True)
    figure = figure[figure["report_asset"] == "coverage_report"]
    audits = audit_figures(instance, default_resources(home)["results"].find_value(float(figure["value"].iloc[0]),
                                                                                   1e-9))
    assert any(a["lineage"].asset_key == "coverage_report" and a["lineage"].gap is None
               and a["lineage"].inputs for a in audits)


def _fake_llm(body: dict):
    """Scripted answers by prompt kind: 3 subquestions, ratings, answers, covered nuggets."""
    from fake_llm_server import Reply

    prompt = body["messages"][-1]["content"]
    if prompt.startswith("Break the question"):
        return Reply.answer(json.dumps(["Where do visitors stay?", "How do visitors get there?", "What to eat?"]))
    if prompt.rstrip().endswith("Rating:"):
        context = prompt.split("Context:")[1]
        return Reply.answer("5" if len(context) % 2 else "1")  # a deterministic mix of ratings
    if "Facts:" in prompt:  # answer coverage: claim the first fact
        ids = [json.loads(line.split("id ", 1)[1].split(":", 1)[0]) for line in prompt.splitlines()
               if line.startswith("- id ")]
        return Reply.answer(json.dumps(ids[:1]))
    return Reply.answer("Visitors stay in the quarter. They take the tram. They eat stew.")


@pytest.mark.slow
def test_llm_products_against_a_local_openai_compatible_server(built, monkeypatch):
    """subquestions (llm), coverage_judgments (llm), answers and answer_report through the real HTTP path;
    a second run is served from the cache. Runs last: it rematerializes upstream assets."""
    from fake_llm_server import FakeLLMServer

    instance = built["instance"]
    with FakeLLMServer(_fake_llm) as server:
        monkeypatch.setenv("COVLAB_LLM_BACKEND", "openai")
        monkeypatch.setenv("COVLAB_LLM_BASE_URL", server.url)
        monkeypatch.setenv("COVLAB_LLM_MODEL", "fake-model")
        config = {"ops": {"subquestions": {"config": {"mode": "llm", "n": 3}},
                          "coverage_judgments": {"config": {"judge": "llm", "pool_depth": 3}}}}
        result = materialize("demo", ["subquestions", "coverage_judgments", "answers", "answer_report"], config,
                             instance)
        assert result.success
        asked = len(server.requests)
        queries = _stored(built["home"], "queries")
        judged_queries = int(queries["split"].isin(["train", "dev"]).sum())
        assert asked >= len(queries) + judged_queries * 3 * 3
        subquestions = _stored(built["home"], "subquestions")
        assert (subquestions.groupby("query_id").size() == 3).all()
        judgments = _stored(built["home"], "coverage_judgments")
        assert judgments["covered"].equals(judgments["rating"] >= 4)
        assert judgments["covered"].any() and not judgments["covered"].all()
        answers = _stored(built["home"], "answers")
        assert set(answers.columns) == {"query_id", "answer", "feedback_answer"}
        event = instance.get_latest_materialization_event(AssetKey("subquestions")).asset_materialization
        assert event.metadata["llm"].value["model"] == "fake-model"
        assert event.metadata["prompt_version"].value == "decompose-1"
        materialize("demo", ["subquestions", "coverage_judgments", "answers", "answer_report"], config, instance)
        assert len(server.requests) == asked  # every answer came from the cache


@pytest.mark.slow
def test_a_bi_encoder_matcher_can_stand_in_for_the_cross_encoder(built):
    """architecture: bi_encoder trains the matcher, registers it, and the matrix asset scores with it."""
    estimator = {**built["config"]["ops"]["coverage_estimator"]["config"], "architecture": "bi_encoder"}
    result = materialize("demo", ["coverage_estimator", "estimated_coverage_matrix"],
                         {"ops": {"coverage_estimator": {"config": estimator}}}, built["instance"])
    assert result.success
    event = result.asset_materializations_for_node("coverage_estimator")[0]
    stored = json.loads((built["home"] / "storage" / "coverage_estimator" / "demo.json").read_text())
    assert event.metadata["dev_auc"].value == stored["dev_auc"] and 0 <= stored["dev_auc"] <= 1  # what gates it
    assert stored["uri"] == event.metadata["model_uri"].value and stored["version"] == 2  # a new version
    assert json.loads((Path(stored["path"]) / "covlab.json").read_text())["kind"] == "biencoder_matcher"
    matrix = _stored(built["home"], "estimated_coverage_matrix")
    assert matrix["probability"].between(0, 1, inclusive="neither").all() and matrix["probability"].nunique() > 1


def _write_test_split_of_demo(folder: Path) -> None:
    """The demo's test queries alone, in the covlab layout (README "Dataset layout"): a dataset with no train
    or dev split, as a benchmark released for evaluation only is."""
    from covlab.models.dataset import Dataset
    from covlab.resources.datasets import read_dataset

    demo = read_dataset("demo", "demo", None)
    kept = set(demo.queries.loc[demo.queries["split"] == "test", "query_id"])
    tables = {name: getattr(demo, name) for name in ("queries", "nuggets", "nugget_links", "qrels", "candidates")}
    write_covlab_layout(Dataset("demo-test", demo.corpus, **{name: table[table["query_id"].isin(kept)]
                                                             for name, table in tables.items()}), folder)


@pytest.fixture(scope="module")
def adopted(built, tmp_path_factory):
    """`demo-test`: the demo's test queries alone, registered with the models demo trained (version 1 of each, what
    the build's selections used), every asset materialized as the build's were."""
    from covlab.resources.home import dataset_registry

    folder = tmp_path_factory.mktemp("adopting") / "demo-test"
    _write_test_split_of_demo(folder)
    dataset_registry().register("demo-test", "covlab", str(folder), models_from="demo@v1")
    built["instance"].add_dynamic_partitions("datasets", ["demo-test"])
    result = materialize("demo-test", None, built["config"], built["instance"])
    return {"result": result, "partition": "demo-test"}


@pytest.mark.slow
def test_a_test_only_dataset_gets_every_report_through_demos_models_and_demos_own_figures(built, adopted):
    """A dataset with a test split only trains nothing: each adoptable trained asset takes demo's version (a new
    version of its own model on the same files, tagged with where it was trained), the gate's figures and the
    blend weights are replayed from demo's record (it has no dev split to measure them on), the MCompass student
    (never adopted) and what reads it are skipped with the reason, and every other report is built. On the same
    queries with the same models its coverage figures are demo's own, to the last bit."""
    from covlab.orchestration.definitions import default_resources

    home, result = built["home"], adopted["result"]
    assert result.success
    tracking = default_resources(home)["tracking"]
    for selector in ("coverage_estimator", "coverage_biencoder", "lmvu_ranker"):
        value = json.loads((home / "storage" / selector / "demo-test.json").read_text())
        assert value["adoption"]["trained_on"] == "demo"
        assert value["adoption"]["source_uri"] == f"models:/covlab.demo.{selector}/1"
        assert value["adoption"]["training_data_versions"]["corpus"] == _data_version(built["instance"], "corpus")
        own = tracking.version(f"covlab.demo-test.{selector}", value["version"])
        source = tracking.version(f"covlab.demo.{selector}", 1)
        assert own.source == source.source and own.run_id == source.run_id  # the same files, no training run
        assert own.tags["covlab.trained_on"] == "demo" and own.tags["covlab.adopted_from"] == source.uri
    estimator = json.loads((home / "storage" / "coverage_estimator" / "demo-test.json").read_text())
    demo_estimator = json.loads(tracking.version("covlab.demo.coverage_estimator", 1).tags["covlab.trained_value"])
    assert estimator["dev_auc"] == demo_estimator["dev_auc"]
    assert estimator["adoption"]["figures_from"].startswith("replayed from demo's record")
    steps = {e.step_key for e in result.all_events if e.event_type_value == "STEP_SKIPPED"}
    assert {"mcompass_retrieval", "retrieval_report", "pool_comparison"} <= steps
    assert not (home / "storage" / "mcompass_student" / "demo-test.json").exists()
    built_keys = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert {"coverage_report", "comparison_report", "model_promotions"} <= built_keys
    reason = next(e.user_message for e in built["instance"].all_logs(result.run_id)
                  if e.step_key == "mcompass_student" and "skipped" in e.user_message)
    assert "no train queries" in reason and "topic" in reason

    demo = _stored(home, "coverage_report")
    demo = demo[demo["split"] == "test"].sort_values(["method", "query_id", "metric"]).reset_index(drop=True)
    test_only = pd.read_parquet(home / "storage" / "coverage_report" / "demo-test.parquet")
    test_only = test_only.sort_values(["method", "query_id", "metric"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(test_only, demo, check_exact=True)

    blended = result.asset_materializations_for_node("budgeted_coverage_greedy_soft")[0].metadata["details"].value
    for evidence in (blended.get("blend") or {}).values():
        assert evidence["metric"] == "replayed" and "replayed from demo's selections" in evidence["split"]
    comparison = result.asset_materializations_for_node("comparison_report")[0].metadata
    results = default_resources(home)["results"]
    stored = results.latest_report("demo-test", "comparison_report")
    assert stored.record.config["trained_on"]["lmvu"] == "demo"
    assert "answer" in comparison

    # the transfer report: demo's own figures on these queries are the in-domain reference; at k = 10 the same
    # models on the same queries keep all of their gain (no change), whatever that gain is
    transfer = pd.read_parquet(home / "storage" / "transfer_report" / "demo-test.parquet")
    event = result.asset_materializations_for_node("transfer_report")[0]
    assert event.metadata["reference"].value == "demo" and event.metadata["source"].value == "demo@v1"
    at_k = transfer[transfer["budget"] == "k=10"]
    assert set(at_k["method"]) >= {"coverage_greedy", "relevance_coverage_trained"}
    assert (at_k["n"] == 11).all() and (at_k["change"] == 0).all()


@pytest.mark.slow
def test_a_served_adopted_model_names_the_dataset_it_was_trained_on(built, adopted):
    from covlab.serving.selector import load_selector

    selector = load_selector("lmvu", "demo-test", alias="candidate")
    [provenance] = selector.provenance
    assert provenance.name == "covlab.demo-test.lmvu_ranker"
    assert provenance.trained_on == "demo" and provenance.adopted_from == "models:/covlab.demo.lmvu_ranker/1"


@pytest.mark.slow
def test_the_audit_of_a_transferred_figure_crosses_to_the_dataset_that_trained_its_model(built, adopted):
    """The lineage of demo-test's report reaches demo-test's data and, through the adopted estimator, the
    materialization in demo that trained it and demo's own data hashes: the cross-dataset edge named."""
    from covlab.resources.lineage_text import render_text

    report = audit_materialization(built["instance"], AssetKey("coverage_report"), "demo-test")
    nodes, stack = [], [report]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.inputs)
    adopting = [n for n in nodes if n.asset_key == "coverage_estimator" and n.partition == "demo-test"]
    assert adopting and {n.adopted_from for n in adopting} == {
        "models:/covlab.demo.coverage_estimator/1, trained on demo"}
    [trained] = [n for a in adopting for n in a.inputs if n.partition == "demo"]  # expanded once
    assert trained.asset_key == "coverage_estimator" and trained.gap is None
    reached = {(n.asset_key, n.partition): n.data_version for n in nodes}
    assert reached[("queries", "demo")] == _data_version(built["instance"], "queries")  # demo's data, hashed
    assert reached[("queries", "demo-test")] == _data_version(built["instance"], "queries", "demo-test")
    assert reached[("queries", "demo-test")] != reached[("queries", "demo")]
    assert "ADOPTED (covlab.demo.coverage_estimator/1, trained on demo" in render_text([report])


@pytest.mark.slow
def test_reproduce_rebuilds_a_transferred_figure_adopting_the_same_model_not_retraining_it(built, adopted, tmp_path):
    import os
    import subprocess
    import sys

    import torch

    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "MAKEFLAGS", "MAKELEVEL")}
    env.update(COVLAB_HOME=str(built["home"]), DAGSTER_HOME=str(built["home"] / "dagster"),
               OMP_NUM_THREADS=str(torch.get_num_threads()))
    done = subprocess.run([str(Path(sys.executable).parent / "covlab"), "reproduce", "--dataset", "demo-test",
                           "--method", "coverage_greedy", "--metric", "alpha_ndcg@10", "--split", "test", "--budget",
                           "k=10", "--allow-dirty", "--scratch", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "REPRODUCED" in done.stdout
    assert "models:/covlab.demo.coverage_estimator/1 (trained on demo) is adopted, not retrained" in done.stdout


@pytest.mark.slow
def test_moving_the_sources_champion_makes_the_adopting_datasets_models_and_reports_stale(built, adopted, nightly):
    """demo-test adopts demo's champions. adopted_model_sensor observes what they are; when demo's estimator
    champion moves to another version, the next observation has a new data version, and the nightly requests
    demo-test's adopted models and the reports on them, and nothing of demo's for it."""
    from dagster import build_sensor_context

    from covlab.orchestration.automation import adopted_model_sensor
    from covlab.orchestration.definitions import OBSERVED_ASSETS, default_resources
    from covlab.resources.home import dataset_registry

    instance, home = built["instance"], built["home"]
    resources = default_resources(home)
    tracking = resources["tracking"]
    entry = dataset_registry().entries()["demo-test"]
    dataset_registry().register("demo-test", entry["format"], entry["path"], replace=True,
                                models_from="demo@champion")
    for selector in ("coverage_estimator", "coverage_biencoder", "lmvu_ranker"):
        tracking.set_alias(f"covlab.demo.{selector}", "champion", 1)
    defs = Definitions(assets=[*ASSETS, *OBSERVED_ASSETS], sensors=[adopted_model_sensor], resources=resources)
    sensor = defs.resolve_sensor_def("adopted_model_sensor")
    cursor = None

    def observe() -> list:
        nonlocal cursor
        context = build_sensor_context(instance=instance, definitions=defs, cursor=cursor, resources={
            "tracking": tracking, "datasets": resources["datasets"]})
        outcome = sensor(context)
        cursor = context.cursor
        events = list(getattr(outcome, "asset_events", None) or [])
        for event in events:  # what the daemon does with a sensor's observations
            instance.report_runless_asset_event(event)
        return events

    assert [e.partition for e in observe()] == ["demo-test"]
    assert observe() == []  # nothing moved: nothing observed
    trained = ["coverage_estimator", "coverage_biencoder", "lmvu_ranker"]
    ops = built["config"]["ops"]
    assert materialize("demo-test", trained, {"ops": {k: ops[k] for k in trained if k in ops}}, instance).success
    ticks = nightly(instance)
    # nothing but what is missing because it skips (the MCompass student trains on train queries demo-test lacks)
    assert {key for key, partitions in ticks.night(defs).items() if "demo-test" in partitions} <= {
        "mcompass_student", "mcompass_retrieval", "retrieval_report", "mcompass_pools",
        "mcompass_pool_coverage_matrix", "pool_comparison"}

    assert materialize("demo", ["coverage_estimator"], {"ops": {"coverage_estimator": ops["coverage_estimator"]}},
                       instance).success  # a newer version of demo's estimator
    newer = max(v.version for v in tracking.versions("covlab.demo.coverage_estimator"))
    tracking.set_alias("covlab.demo.coverage_estimator", "champion", newer)
    assert [e.partition for e in observe()] == ["demo-test"]
    requested = {key for key, partitions in ticks.night(defs).items() if "demo-test" in partitions}
    assert set(trained) <= requested and {"coverage_report", "comparison_report"} <= requested
