"""The MLflow candidate sensor (orchestration/automation.py) on a small graph with covlab's asset names: a
trained selector that registers a candidate version when it is materialized, one selection that reads it, the
reports and promotions; a scratch MLflow registry. Ticks are evaluated as the daemon evaluates them
(`evaluate_tick`, with the instance's dynamic partitions at hand: each run request's partition is checked)."""

import pandas as pd
import pytest
from dagster import (AssetKey, AssetSelection, DagsterInstance, Definitions, SensorDefinition, asset,
                     build_sensor_context, materialize, partition_loading_context)

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.orchestration.automation import mlflow_candidate_sensor
from covlab.resources.tracking import TrackingResource

REPORTS_AND_PROMOTIONS = ["comparison_report", "coverage_report", "model_promotions", "pool_comparison",
                          "retrieval_report"]


@pytest.fixture
def tracking(tmp_path):
    return TrackingResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))


def graph(weights) -> list:
    @asset(partitions_def=DATASETS, code_version="1")
    def coverage_estimator(context, tracking: TrackingResource):
        with tracking.training_run(f"covlab.{context.partition_key}.coverage_estimator", {}, {}) as run:
            ref = run.register(weights, {})
        return content_output({"name": ref.name, "trained": ref.version})

    @asset(partitions_def=DATASETS, code_version="1")
    def selection_coverage_greedy(coverage_estimator: dict):
        return content_output(pd.DataFrame({"model": [coverage_estimator["trained"]]}))

    @asset(partitions_def=DATASETS, code_version="1")
    def coverage_report(selection_coverage_greedy: pd.DataFrame):
        return content_output(selection_coverage_greedy)

    @asset(partitions_def=DATASETS, code_version="1")
    def model_promotions(coverage_report: pd.DataFrame):
        return content_output(coverage_report)

    def report(name: str):
        @asset(name=name, partitions_def=DATASETS, code_version="1")
        def other_report():
            return content_output(pd.DataFrame({"rows": [0]}))
        return other_report

    @asset(partitions_def=DATASETS, code_version="1")
    def transfer_report(coverage_report: pd.DataFrame, comparison_report: pd.DataFrame):
        return content_output(coverage_report)

    return [coverage_estimator, selection_coverage_greedy, coverage_report, model_promotions, transfer_report,
            *(report(name) for name in ("comparison_report", "pool_comparison", "retrieval_report"))]


@pytest.mark.slow
def test_a_new_candidate_runs_what_has_not_read_it_then_the_reports_and_promotions(tmp_path, tracking):
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    assets = graph(weights)
    defs = Definitions(assets=assets, sensors=[mlflow_candidate_sensor], resources={"tracking": tracking})
    sensor: SensorDefinition = defs.resolve_sensor_def("mlflow_candidate_sensor")
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions(DATASETS.name, ["demo"])

        def tick(cursor=None):  # the daemon evaluates with the instance's dynamic partitions at hand
            context = build_sensor_context(instance=instance, definitions=defs, cursor=cursor,
                                           resources={"tracking": tracking})
            with partition_loading_context(dynamic_partitions_store=instance):
                return sensor.evaluate_tick(context)

        def run(selection) -> None:
            assert materialize(assets, instance=instance, partition_key="demo", resources={"tracking": tracking},
                               selection=AssetSelection.assets(*selection)).success

        run(key for a in assets for key in a.keys)  # trains v1, then everything reads it
        first = tick()
        [request] = first.run_requests
        assert request.partition_key == "demo"
        assert request.tags["covlab/candidates"] == "covlab.demo.coverage_estimator v1"
        assert [k.to_user_string() for k in request.asset_selection] == REPORTS_AND_PROMOTIONS

        run([AssetKey("coverage_estimator")])  # v2, read by nothing yet
        second = tick(first.cursor)
        [request] = second.run_requests
        assert request.tags["covlab/candidates"] == "covlab.demo.coverage_estimator v2"
        assert [k.to_user_string() for k in request.asset_selection] == sorted(
            [*REPORTS_AND_PROMOTIONS, "selection_coverage_greedy", "transfer_report"])  # what reads v2, on to them

        run(request.asset_selection)
        third = tick(second.cursor)
        assert not third.run_requests and third.skip_message == "no new candidate model versions"
