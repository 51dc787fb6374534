"""`covlab audit` on a pipeline in miniature (a multi-asset ingest step, a pool step in the gpu pool, two
selections, a report recording which selection produced which method): the default output is the figure's
branch, each node once, with its cost; --full is every input; --json is typed; --help lists what the
results store holds; the cost counts each step once and adds up."""

import json

import pandas as pd
import pytest
from dagster import (AssetKey, AssetOut, Config, DagsterInstance, DynamicPartitionsDefinition, MetadataValue,
                     Output, asset, materialize, multi_asset)

from covlab.orchestration.cli import main
from covlab.orchestration.definitions import default_resources
from covlab.orchestration.lineage import (COST, REPORT_ID, LineageNode, StepClock, audit_materialization,
                                          branch_nodes, lineage_cost, record_report_lineage, render_branch,
                                          report_branch, unique_nodes)
from covlab.orchestration.settings import dagster_home
from covlab.resources.io_manager import LocalTableIOManager
from covlab.resources.results_store import ReportRecord, ResultsStore

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
    return Output(pools.head(1), metadata={"history": MetadataValue.json([{"epoch": 1}, {"epoch": 2}]),
                                           "train_pairs": 40})


LLM_USAGE = {"cached": 2, "sent": 5, "prompt_tokens": 900, "completion_tokens": 80, "answers_without_usage": 0}


@asset(partitions_def=DATASETS)
def selection_second(pools: pd.DataFrame, queries: pd.DataFrame) -> Output[pd.DataFrame]:
    return Output(pools.tail(1), metadata={"llm": MetadataValue.json({"model": "fake-model"}),
                                           "llm_usage": MetadataValue.json(LLM_USAGE)})


@asset(partitions_def=DATASETS)
def toy_report(context, results: ResultsStore, selection_first: pd.DataFrame,
               selection_second: pd.DataFrame) -> Output[pd.DataFrame]:
    figures = pd.DataFrame({"dataset": context.partition_key, "method": ["first_method", "second_method"],
                            "budget": None, "k": 10, "split": "test", "metric": "toy_metric@10", "query_id": None,
                            "value": [FIRST, SECOND]})
    stored = results.write_report(ReportRecord(dataset=context.partition_key, report_asset="toy_report",
                                               partition=context.partition_key, run_id=context.run_id,
                                               code_version="1", data_version=None, config={}), figures)
    record_report_lineage(context, {"first_method": [AssetKey("selection_first")],
                                    "second_method": [AssetKey("selection_second")]})
    return Output(figures, metadata={REPORT_ID: MetadataValue.int(stored)})


TOY = [tables, pools, selection_first, selection_second, toy_report]


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
    cost = lineage_cost(instance, unique_nodes([report]), assets=TOY, clock=StepClock(instance))
    steps = {step.step_key: step for step in cost.steps}
    assert set(steps) == {"tables", "pools", "selection_first", "selection_second", "toy_report"}
    assert sorted(steps["tables"].assets) == ["corpus", "queries"]  # the multi-asset step, once
    assert all(step.seconds is not None and step.seconds >= 0 for step in cost.steps)
    assert cost.seconds == pytest.approx(sum(step.seconds for step in cost.steps), abs=1e-6)
    assert cost.gpu_seconds == pytest.approx(steps["pools"].seconds) and steps["pools"].pool == "gpu"
    assert cost.training == {"epochs": 2, "pairs": 40}
    assert cost.llm == {**LLM_USAGE, "llm_steps_without_usage": 0}
    assert "LLM: 5 requests sent, 2 answers from the cache, 900 prompt + 80 completion tokens" in cost.render()
    assert cost.to_dict()["seconds"] == cost.seconds and cost.to_dict()["runs"] == 1
    # The branch of first_method leaves selection_second and its step out.
    branch = report_branch(report, ["first_method"])
    on_branch = lineage_cost(instance, branch_nodes(branch, [report]), scope="branch", assets=TOY)
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
    line = render_branch(node, [node], assets=TOY).splitlines()[0]
    assert line.startswith("pools [demo] ") and " n=5" in line and "mode=" not in line  # mode kept its default


def test_a_report_without_method_inputs_has_no_branch():
    report = LineageNode("old_report", "demo", 1, inputs=[LineageNode("selection_first", "demo", 2)])
    assert report_branch(report, ["first_method"]) is None
    recorded = LineageNode("new_report", "demo", 3, method_inputs={"first_method": ["selection_first"]})
    assert report_branch(recorded, ["another_method"]) is None
