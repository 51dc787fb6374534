"""The code location's wiring: GPU tagging, code versions, schedules and sensors, config descriptions."""

import json
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, DagsterInvalidConfigError, validate_run_config

from covlab.orchestration.definitions import ASSETS, defs
from covlab.resources.device import GPU_POOL, gpu_step

HEAVY = {"coverage_estimator", "coverage_biencoder", "pool_scores", "estimated_coverage_matrix",
         "estimated_gold_coverage_matrix", "item_embeddings", "topic_metadata_bank", "mcompass_teacher",
         "mcompass_student", "mcompass_retrieval"}


def _node(key: str):
    return defs.resolve_asset_graph().get(AssetKey(key))


def test_every_heavy_asset_is_a_gpu_step_with_pool_device_tag_and_k8s_request():
    tagged = set()
    for assets_def in ASSETS:
        for key in assets_def.keys:
            op = assets_def.node_def
            if op.pool == GPU_POOL:
                tagged.add(key.to_user_string())
                assert op.tags["covlab/device"] == "gpu"
                k8s = op.tags["dagster-k8s/config"]  # dict-valued op tags are stored as JSON
                limits = json.loads(k8s)["container_config"]["resources"]["limits"]
                assert limits["nvidia.com/gpu"] == "1"
    assert tagged == HEAVY
    assert gpu_step()["pool"] == GPU_POOL


def test_every_asset_has_a_code_version_and_the_datasets_partitions():
    for key in defs.resolve_asset_graph().get_all_asset_keys():
        node = _node(key.to_user_string())
        assert node.code_version, key
        assert node.partitions_def is not None and node.partitions_def.name == "datasets", key


def test_nightly_schedule_and_candidate_sensor_are_defined():
    schedule = defs.resolve_schedule_def("nightly_reevaluation")
    assert schedule.cron_schedule == "0 2 * * *"
    assert defs.resolve_sensor_def("mlflow_candidate_sensor") is not None


def test_the_gpu_pool_is_limited_in_the_generated_dagster_yaml(covlab_home):
    from covlab.orchestration.settings import dagster_home

    config = yaml.safe_load((dagster_home() / "dagster.yaml").read_text())
    assert config["concurrency"]["pools"]["default_limit"] == 1
    assert config["telemetry"]["enabled"] is False


def test_shipped_run_configs_are_valid_for_the_asset_job():
    """The documented ArgKP configs name real assets and fields, with values of the right types."""
    job = defs.resolve_implicit_global_asset_job_def()
    configs = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
    assert [p.name for p in configs] == ["argkp_bm25.yaml", "argkp_budgeted.yaml", "argkp_given.yaml", "argkp_matcher.yaml",
                                      "argkp_mcompass.yaml", "longdoc.yaml", "perspectrum_budgeted.yaml",
                                      "perspectrum_mcompass.yaml"]
    assets = {key.to_python_identifier() for assets_def in ASSETS for key in assets_def.keys}
    for path in configs:
        config = yaml.safe_load(path.read_text())
        assert set(config["ops"]) <= assets, path.name  # Dagster ignores config of an unknown op
        assert validate_run_config(job, config)["ops"]["coverage_estimator"]["config"]["epochs"] >= 1
    with pytest.raises(DagsterInvalidConfigError, match="epochs"):
        validate_run_config(job, {"ops": {"coverage_estimator": {"config": {"epochs": "three"}}}})
