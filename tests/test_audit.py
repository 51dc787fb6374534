"""`covlab audit` on a pipeline in miniature (a multi-asset ingest step, a pool step in the gpu pool, two
selections, a report recording which selection produced which method): the default output is the figure's
branch, each node once, with its cost; --full is every input; --json is typed; --help lists what the
results store holds; the cost counts each step once and adds up."""

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from dagster import (AssetKey, AssetOut, Config, DagsterInstance, DynamicPartitionsDefinition, MetadataValue,
                     Output, asset, materialize, multi_asset)

from safetensors.numpy import save_file

from covlab.assets.outputs import content_output
from covlab.models.versions import directory_hash
from covlab.orchestration.cli import main
from covlab.orchestration.definitions import default_resources
from covlab.orchestration.instance import dagster_home
from covlab.resources.lineage import (DETAILS, LineageNode, audit_materialization, branch_nodes, report_branch,
                                      unique_nodes)
from covlab.resources.lineage_cost import StepClock, lineage_cost
from covlab.resources.lineage_text import render_branch
from covlab.resources.materializations import TRAINING, TrainingSummary
from covlab.resources.report_lineage import COST, REPORT_ID, record_report_lineage
from covlab.resources.io_manager import LocalTableIOManager
from covlab.resources.results_store import ReportRecord, ResultsStore
from covlab.resources.model_store import WEIGHTS_HASH, WEIGHTS_METADATA

DATASETS = DynamicPartitionsDefinition(name="datasets")
FIRST, SECOND = 0.612345, 0.587654  # the report's figures of first_method and second_method


@multi_asset(outs={"corpus": AssetOut(), "queries": AssetOut()}, partitions_def=DATASETS)
def tables():
    yield Output(pd.DataFrame({"doc_id": ["d1", "d2"]}), output_name="corpus")
    yield Output(pd.DataFrame({"query_id": ["q1"]}), output_name="queries")


class PoolConfig(Config):
    n: int = 100
    mode: str = "bm25"


@asset(partitions_def=DATASETS, pool="gpu")
def pools(config: PoolConfig, corpus: pd.DataFrame, queries: pd.DataFrame) -> Output[pd.DataFrame]:
    return Output(corpus.merge(queries, how="cross"), metadata={"config": MetadataValue.json(config.model_dump())})


@asset(partitions_def=DATASETS)
def selection_first(pools: pd.DataFrame) -> Output[pd.DataFrame]:
    return Output(pools.head(1), metadata={TRAINING: MetadataValue.json(TrainingSummary(epochs=2, pairs=40).to_dict())})


# What a selection on estimated coverage records of its gate and blend (models/trust.py Decision.metadata).
SECOND_DECISIONS = {"fell_back": False, "estimator_gate": "dev ROC-AUC 0.9000 >= 0.6500", "blend_weight": 0.5,
                    "blend": MetadataValue.json({"weight": 0.5, "split": "dev", "metric": "alpha_ndcg@10", "queries": 8,
                                                 "fallback_score": 0.6, "chosen_score": 0.7,
                                                 "scores": {"0.0": 0.6, "0.5": 0.7, "1.0": 0.65}})}
SECOND_PER_QUERY = {"q1": 0.5, "q2": 0.6, "q3": 0.662962}  # their mean is SECOND
LLM_USAGE = {"cached": 2, "sent": 5, "prompt_tokens": 900, "completion_tokens": 80, "answers_without_usage": 0}


@asset(partitions_def=DATASETS)
def selection_second(pools: pd.DataFrame, queries: pd.DataFrame) -> Output[pd.DataFrame]:
    return Output(pools.tail(1), metadata={"llm": MetadataValue.json({"model": "fake-model"}),
                                           "llm_usage": MetadataValue.json(LLM_USAGE), **SECOND_DECISIONS})


@asset(partitions_def=DATASETS)
def toy_report(context, results: ResultsStore, selection_first: pd.DataFrame,
               selection_second: pd.DataFrame) -> Output[pd.DataFrame]:
    figures = pd.DataFrame({"dataset": context.partition_key, "method": ["first_method", "second_method"],
                            "budget": None, "k": 10, "split": "test", "metric": "toy_metric@10", "query_id": None,
                            "value": [FIRST, SECOND]})
    per_query = pd.DataFrame({"dataset": context.partition_key, "method": "second_method", "budget": None, "k": 10,
                              "split": "test", "metric": "toy_metric@10", "query_id": list(SECOND_PER_QUERY),
                              "value": list(SECOND_PER_QUERY.values())})
    figures = pd.concat([figures, per_query], ignore_index=True)
    stored = results.write_report(ReportRecord(dataset=context.partition_key, report_asset="toy_report",
                                               partition=context.partition_key, run_id=context.run_id,
                                               code_version="1", data_version=None, config={}), figures)
    record_report_lineage(context, {"first_method": [AssetKey("selection_first")],
                                    "second_method": [AssetKey("selection_second")]})
    return Output(figures, metadata={REPORT_ID: MetadataValue.int(stored)})


# A budgeted selection on estimated coverage records its gate and one blend per token budget in its DETAILS entry
# (models/runs.py MethodRun.details); a second report puts second_method's figures at two token budgets next to
# toy_report's k = 10 one.
BUDGETED_DETAILS = {"queries": 3, "fell_back": False, "estimator_gate": "dev ROC-AUC 0.9000 >= 0.6500", "blend": {
    str(budget): {"weight": weight, "split": "dev", "metric": "alpha_ndcg@10", "queries": 8, "fallback_score": 0.6,
                  "chosen_score": chosen, "scores": {"0.0": 0.6, str(weight): chosen}}
    for budget, weight, chosen in ((256, 0.25, 0.66), (512, 1.0, 0.71))}}
AT_256, AT_512 = 0.701234, 0.723456  # toy_budget_report's figures of second_method


@asset(partitions_def=DATASETS)
def budgeted_second(pools: pd.DataFrame) -> Output[pd.DataFrame]:
    return Output(pools.tail(1), metadata={DETAILS: MetadataValue.json(BUDGETED_DETAILS)})


@asset(partitions_def=DATASETS)
def toy_budget_report(context, results: ResultsStore, budgeted_second: pd.DataFrame) -> Output[pd.DataFrame]:
    figures = pd.DataFrame({"dataset": context.partition_key, "method": "second_method", "budget": [256, 512],
                            "k": None, "split": "test", "metric": "toy_metric@10", "query_id": None,
                            "value": [AT_256, AT_512]})
    stored = results.write_report(ReportRecord(dataset=context.partition_key, report_asset="toy_budget_report",
                                               partition=context.partition_key, run_id=context.run_id,
                                               code_version="1", data_version=None, config={}), figures)
    record_report_lineage(context, {"second_method": [AssetKey("budgeted_second")]})
    return Output(figures, metadata={REPORT_ID: MetadataValue.int(stored)})


TOY = [tables, pools, selection_first, selection_second, toy_report, budgeted_second, toy_budget_report]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One run of the toy pipeline on partition demo, in a COVLAB_HOME of its own."""
    home = tmp_path_factory.mktemp("audit") / "home"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COVLAB_HOME", str(home))
        patch.setenv("DAGSTER_HOME", str(home / "dagster"))
        dagster_home()
        with DagsterInstance.get() as instance:
            instance.add_dynamic_partitions("datasets", ["demo"])
            result = materialize(TOY, partition_key="demo", instance=instance,
                                 resources={"results": default_resources(home)["results"],
                                            "io_manager": LocalTableIOManager(base_dir=str(home / "storage"))})
            assert result.success
            yield {"home": home, "instance": instance, "run_id": result.run_id}


def _audit(capsys, *args) -> str:
    assert main(["audit", *args]) == 0
    return capsys.readouterr().out


def test_default_prints_the_figures_branch_each_node_once_with_its_cost(built, capsys):
    out = _audit(capsys, "--value", str(FIRST), "--tolerance", "1e-9")
    assert f"{FIRST:.6f}  dataset=demo, method=first_method, split=test, metric=toy_metric@10, k=10" in out
    assert "selection_first [demo]" in out and "selection_second" not in out
    for key in ("toy_report", "selection_first", "pools", "corpus", "queries"):
        assert sum(line.lstrip("│├└─ ").startswith(f"{key} [demo]") for line in out.splitlines()) == 1, key
    assert "(shown above)" not in out
    assert "(+ 1 more node of the report's lineage, not on this branch; --full shows the whole lineage)" in out
    assert "cost of this branch:" in out
    assert "<NA>" not in out and "None" not in out and "nan" not in out.lower()


def test_a_mean_is_printed_with_its_n_and_ci_and_a_selection_with_its_decisions(built, capsys):
    from covlab.models.statistics import mean_ci

    out = _audit(capsys, "--value", str(SECOND), "--tolerance", "1e-9")
    interval = mean_ci(pd.Series(list(SECOND_PER_QUERY.values())))
    assert (f"  the mean over n=3 queries, 95% CI [{interval['ci_low']:.4f}, {interval['ci_high']:.4f}] "
            "(bootstrap over queries)") in out
    assert ("  selected by: estimator gate: dev ROC-AUC 0.9000 >= 0.6500; blend weight 0.5 with relevance order, "
            "chosen on dev (n=8) by alpha_ndcg@10: 0.700 vs 0.600 for the fallback order") in out
    first = _audit(capsys, "--value", str(FIRST), "--tolerance", "1e-9")  # no per-query rows, no decisions stored
    assert "the mean over" not in first and "selected by" not in first


def test_a_question_matching_several_budgets_lists_them_and_asks_for_one(built, capsys):
    question = ["audit", "--dataset", "demo", "--method", "second_method", "--metric", "toy_metric@10",
                "--split", "test"]
    assert main(question) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "covlab: audit: second_method toy_metric@10 of demo on test is reported at several budgets: k=10 (toy_report), "
        "tokens=256 (toy_budget_report), tokens=512 (toy_budget_report); name one with --budget, e.g. --budget k=10\n")
    at_k = _audit(capsys, *question[1:], "--budget", "k=10")
    assert at_k.startswith(f"{SECOND:.6f}  dataset=demo, method=second_method, split=test, metric=toy_metric@10, k=10")
    assert "blend weight 0.5 with relevance order" in at_k
    at_512 = _audit(capsys, *question[1:], "--budget", "tokens=512")
    assert at_512.startswith(f"{AT_512:.6f}  dataset=demo, method=second_method, split=test, metric=toy_metric@10, "
                             "budget=512")
    assert "toy_budget_report [demo]" in at_512 and "toy_report" not in at_512


def test_a_token_budget_figure_says_what_selected_it_at_its_budget(built, capsys):
    out = _audit(capsys, "--value", str(AT_256), "--tolerance", "1e-9")
    assert f"{AT_256:.6f}  dataset=demo, method=second_method, split=test, metric=toy_metric@10, budget=256" in out
    assert ("  selected by: estimator gate: dev ROC-AUC 0.9000 >= 0.6500; blend weight 0.25 with relevance order, "
            "chosen on dev (n=8) by alpha_ndcg@10: 0.660 vs 0.600 for the fallback order") in out
    assert "blend weight 1 with relevance order" in _audit(capsys, "--value", str(AT_512), "--tolerance", "1e-9")


def test_full_prints_every_input(built, capsys):
    out = _audit(capsys, "--value", str(SECOND), "--tolerance", "1e-9", "--full")
    assert "selection_first [demo]" in out and "selection_second [demo]" in out
    assert "cost of the whole lineage:" in out
    assert "<NA>" not in out and "None" not in out


def _no_nan(constant: str):
    raise AssertionError(f"not JSON: {constant}")


def test_json_is_typed_with_null_for_missing(built, capsys):
    audits = json.loads(_audit(capsys, "--value", str(FIRST), "--tolerance", "1e-9", "--json"),
                        parse_constant=_no_nan)
    (figure,) = audits[0]["figures"]
    assert figure["k"] == 10 and isinstance(figure["k"], int) and isinstance(figure["materialization_id"], int)
    assert figure["budget"] is None and figure["query_id"] is None and figure["value"] == FIRST
    assert audits[0]["lineage"]["method_inputs"] == {"first_method": ["selection_first"],
                                                     "second_method": ["selection_second"]}
    assert audits[0]["cost"]["scope"] == "branch"
    text = json.dumps(audits)
    assert "<NA>" not in text and '"None"' not in text


def test_help_documents_the_options_and_lists_the_store(built, capsys):
    with pytest.raises(SystemExit) as done:
        main(["audit", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--full" in out and "the whole lineage of the report" in out
    assert "first_method" in out and "second_method" in out and "toy_metric@10" in out and "demo" in out


def test_help_says_when_the_store_is_empty(covlab_home, capsys):
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    assert "holds no figures yet" in capsys.readouterr().out
    assert not (covlab_home / "results").exists()  # asking for help created no database


def test_cost_counts_each_step_once_and_adds_up(built):
    instance = built["instance"]
    report = audit_materialization(instance, AssetKey("toy_report"), "demo", built["run_id"])
    cost = lineage_cost(instance, unique_nodes([report]), clock=StepClock(instance))
    steps = {step.step_key: step for step in cost.steps}
    assert set(steps) == {"tables", "pools", "selection_first", "selection_second", "toy_report"}
    assert sorted(steps["tables"].assets) == ["corpus", "queries"]  # the multi-asset step, once
    assert all(step.seconds is not None and step.seconds >= 0 for step in cost.steps)
    assert cost.seconds == pytest.approx(sum(step.seconds for step in cost.steps), abs=1e-6)
    assert cost.gpu_seconds == pytest.approx(steps["pools"].seconds) and steps["pools"].pool == "gpu"
    assert cost.training == {"models": 1, "epochs": 2, "pairs": 40}
    assert cost.llm == {**LLM_USAGE, "llm_steps_without_usage": 0}
    assert "LLM: 5 requests sent, 2 answers from the cache, 900 prompt + 80 completion tokens" in cost.render()
    assert cost.to_dict()["seconds"] == cost.seconds and cost.to_dict()["runs"] == 1
    # The branch of first_method leaves selection_second and its step out.
    branch = report_branch(report, ["first_method"])
    on_branch = lineage_cost(instance, branch_nodes(branch, [report]), scope="branch")
    assert {step.step_key for step in on_branch.steps} == set(steps) - {"selection_second"}
    assert on_branch.llm["sent"] == 0 and "LLM: no calls" in on_branch.render()
    # The report recorded the cost of its inputs: every step but its own, which was still running.
    recorded = report.to_dict()
    stored = instance.fetch_materializations(AssetKey("toy_report"), limit=1).records[0]
    inputs_cost = stored.asset_materialization.metadata[COST].value
    assert recorded["method_inputs"] and inputs_cost["scope"] == "inputs"
    assert {step["step_key"] for step in inputs_cost["steps"]} == set(steps) - {"toy_report"}


def test_config_that_differs_from_the_default_is_shown(instance, covlab_home):
    instance.add_dynamic_partitions("datasets", ["demo"])
    assert materialize([tables, pools], partition_key="demo", instance=instance,
                       run_config={"ops": {"pools": {"config": {"n": 5}}}},
                       resources={"io_manager": LocalTableIOManager(base_dir=str(covlab_home / "storage"))}).success
    node = audit_materialization(instance, AssetKey("pools"), "demo")
    line = render_branch(node, [node]).splitlines()[0]
    assert line.startswith("pools [demo] ") and " n=5" in line and "mode=" not in line  # mode kept its default


def test_a_report_without_method_inputs_has_no_branch():
    report = LineageNode("old_report", "demo", 1, inputs=[LineageNode("selection_first", "demo", 2)])
    assert report_branch(report, ["first_method"]) is None
    recorded = LineageNode("new_report", "demo", 3, method_inputs={"first_method": ["selection_first"]})
    assert report_branch(recorded, ["another_method"]) is None


@asset(partitions_def=DATASETS)
def estimator() -> Output[pd.DataFrame]:
    return Output(pd.DataFrame({"p": [0.5]}))


@asset(partitions_def=DATASETS, deps=[AssetKey("estimator")])
def gold_teacher(queries: pd.DataFrame) -> Output[pd.DataFrame]:
    """Like mcompass_teacher with the gold teacher: a dependency without data (the estimator), never built."""
    return Output(queries.assign(logit=0.0))


def test_a_dependency_without_data_that_was_never_built_audits(instance, covlab_home):
    instance.add_dynamic_partitions("datasets", ["demo"])
    assert materialize([tables, estimator, gold_teacher], selection=[AssetKey("corpus"), AssetKey("queries"),
                                                                    AssetKey("gold_teacher")],
                       partition_key="demo", instance=instance,
                       resources={"io_manager": LocalTableIOManager(base_dir=str(covlab_home / "storage"))}).success
    node = audit_materialization(instance, AssetKey("gold_teacher"), "demo")
    assert [(n.asset_key, n.gap) for n in node.inputs] == [("queries", None)]  # nothing of the estimator was read
    assert render_branch(node, [node]).splitlines()[1].startswith(
        "└─ queries [demo] ")


# Files on disk that a lineage recorded: a dataset's source files (the real ingest step records their SHA-256)
# and a trained model's weights folder (recorded as Training.metadata() does); `covlab audit` marks the node
# whose files changed since.
SCORE = 0.734521


@asset(partitions_def=DATASETS)
def weighted_model(context, corpus: pd.DataFrame) -> Output[dict]:
    folder = Path(os.environ["COVLAB_HOME"]) / "artifacts" / "weighted_model" / context.partition_key / "v1"
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.full((2, 2), len(corpus), dtype=np.float32)}, folder / "student.safetensors")
    weights = {"path": str(folder), WEIGHTS_HASH: directory_hash(folder)}
    return content_output({"name": "toy", **weights}, metadata={WEIGHTS_METADATA: MetadataValue.json(weights)})


@asset(partitions_def=DATASETS)
def weighted_report(context, results: ResultsStore, weighted_model: dict, queries: pd.DataFrame) -> Output:
    figures = pd.DataFrame({"dataset": [context.partition_key], "method": ["toy_student"], "budget": None, "k": 5,
                            "split": "test", "metric": "p@5", "query_id": None, "value": [SCORE]})
    stored = results.write_report(ReportRecord(dataset=context.partition_key, report_asset="weighted_report",
                                               partition=context.partition_key, run_id=context.run_id,
                                               code_version="1", data_version=None, config={}), figures)
    record_report_lineage(context, {"toy_student": [AssetKey("weighted_model"), AssetKey("queries")]})
    return content_output(figures, metadata={REPORT_ID: MetadataValue.int(stored)})


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory, demo_dataset):
    """A dataset registered from files, ingested by the real ingest step, a model with weights on disk and a
    report on both, in a COVLAB_HOME of this module. Each test puts back what it changed."""
    from conftest import write_covlab_layout

    from covlab.assets.ingest import dataset_tables

    root = tmp_path_factory.mktemp("on-disk")
    folder, home = write_covlab_layout(demo_dataset, root / "mine"), root / "home"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COVLAB_HOME", str(home))
        patch.setenv("DAGSTER_HOME", str(home / "dagster"))
        assert main(["dataset", "add", "mine", "--format", "covlab", "--path", str(folder)]) == 0
        resources = default_resources(home)
        with DagsterInstance.get() as instance:
            assert materialize([dataset_tables, weighted_model, weighted_report], partition_key="mine",
                               instance=instance, resources={name: resources[name]
                                                             for name in ("datasets", "results", "io_manager")}).success
        resources["results"].dispose()
        yield folder, home / "artifacts" / "weighted_model" / "mine" / "v1"


@pytest.mark.slow
def test_a_dataset_file_edited_after_ingest_is_marked_changed(on_disk, capsys):
    folder, _ = on_disk
    assert "CHANGED" not in _audit(capsys, "--value", str(SCORE), "--tolerance", "1e-9")
    original = (folder / "queries.jsonl").read_bytes()
    try:
        with open(folder / "queries.jsonl", "a", encoding="utf-8") as handle:
            handle.write('{"query_id": "extra", "text": "added later", "split": "test"}\n')
        out = _audit(capsys, "--value", str(SCORE), "--tolerance", "1e-9")
        audits = json.loads(_audit(capsys, "--value", str(SCORE), "--tolerance", "1e-9", "--json"))
    finally:
        (folder / "queries.jsonl").write_bytes(original)
    (queries,) = [line for line in out.splitlines() if line.lstrip("│├└─ ").startswith("queries [mine]")]
    assert f"CHANGED ({folder / 'queries.jsonl'}: SHA-256 " in queries and "recorded at ingest" in queries
    (model,) = [line for line in out.splitlines() if line.lstrip("│├└─ ").startswith("weighted_model [mine]")]
    assert "CHANGED" not in model
    nodes = list(_walk(audits[0]["lineage"]))
    assert {node["asset_key"] for node in nodes if node["changed"]} == {"corpus", "queries"}  # ingest's tables read
    assert all("queries.jsonl" in node["changed"] for node in nodes if node["changed"])


@pytest.mark.slow
def test_rewritten_weights_are_marked_changed_naming_both_hashes(on_disk, capsys):
    _, weights = on_disk
    recorded, original = directory_hash(weights), (weights / "student.safetensors").read_bytes()
    try:
        save_file({"w": np.zeros((2, 2), dtype=np.float32)}, weights / "student.safetensors")
        out = _audit(capsys, "--value", str(SCORE), "--tolerance", "1e-9", "--full")
        found = directory_hash(weights)
    finally:
        (weights / "student.safetensors").write_bytes(original)
    (model,) = [line for line in out.splitlines() if line.lstrip("│├└─ ").startswith("weighted_model [mine]")]
    assert f"CHANGED (the weights at {weights} have content hash {found}, not the {recorded} recorded at " \
           "registration)" in model


@pytest.mark.slow
def test_reproduce_names_weights_rewritten_since_registration(on_disk, monkeypatch):
    """The plan of `covlab reproduce` notes the model whose weights changed on disk: a figure that diverges below
    it may have been computed from those bytes."""
    from covlab.assets.ingest import dataset_tables
    from covlab.orchestration import definitions
    from covlab.orchestration.reproduce import plan

    _, weights = on_disk
    monkeypatch.setattr(definitions, "ASSETS", [dataset_tables, weighted_model, weighted_report])
    results = default_resources()["results"]
    (figure,) = results.find_value(SCORE, 1e-9).to_dict("records")
    results.dispose()
    original = (weights / "student.safetensors").read_bytes()
    with DagsterInstance.get() as instance:
        assert plan(instance, figure, allow_dirty=True).notes == []
        try:
            save_file({"w": np.zeros((2, 2), dtype=np.float32)}, weights / "student.safetensors")
            notes = plan(instance, figure, allow_dirty=True).notes
        finally:
            (weights / "student.safetensors").write_bytes(original)
    assert notes and all(note.startswith(f"weighted_model [mine]: the weights at {weights} have content hash ")
                         for note in notes)


def _walk(tree: dict):
    """Every node of a --json lineage tree."""
    yield tree
    for child in tree["inputs"]:
        yield from _walk(child)
