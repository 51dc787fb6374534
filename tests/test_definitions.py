"""The code location's wiring: what the UI shows of every asset (a written-out snapshot), GPU tagging, code
versions, schedules and sensors, config descriptions."""

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from dagster import (AssetKey, AutomationConditionSensorDefinition, DagsterInvalidConfigError, DefaultSensorStatus,
                     validate_run_config)

from covlab.assets.presentation import OWNERS
from covlab.orchestration.definitions import ASSETS, defs
from covlab.resources.device import DEVICE_TAG, GPU_POOL, gpu_step

# What the UI shows, written out: a change of any asset, group, kind, GPU tag or column schema is a diff here.
# asset: (group, kinds, `covlab/device` asset tag, has a `dagster/column_schema`)
GPU = "gpu"
TABLE = {"python", "parquet"}
EXPECTED_ASSETS = {
    "corpus": ("ingest", TABLE, None, True),
    "queries": ("ingest", TABLE, None, True),
    "nuggets": ("ingest", TABLE, None, True),
    "nugget_links": ("ingest", TABLE, None, True),
    "qrels": ("ingest", TABLE, None, True),
    "candidates": ("ingest", TABLE, None, True),
    "bm25_index": ("retrieval", {"lucene"}, None, False),
    "bm25_pools": ("retrieval", {"lucene", "parquet"}, None, True),
    "subquestions": ("coverage", TABLE, None, False),
    "coverage_judgments": ("coverage", TABLE, None, True),
    "coverage_estimator": ("coverage", {"pytorch", "mlflow"}, GPU, False),
    "coverage_biencoder": ("coverage", {"pytorch", "mlflow"}, GPU, False),
    "relevance_scores": ("coverage", {"pytorch", "parquet"}, GPU, True),
    "pool_scores": ("coverage", {"pytorch", "parquet"}, GPU, True),
    "estimated_coverage_matrix": ("coverage", {"pytorch", "parquet"}, GPU, True),
    "estimated_gold_coverage_matrix": ("coverage", {"pytorch", "parquet"}, GPU, True),
    "selection_bm25": ("selections", TABLE, None, True),
    "selection_relevance": ("selections", TABLE, None, True),
    "selection_relevance_coverage_trained": ("selections", TABLE, None, True),
    "selection_coverage_greedy": ("selections", TABLE, None, True),
    "selection_coverage_greedy_soft": ("selections", TABLE, None, True),
    "selection_oracle_greedy": ("selections", TABLE, None, True),
    "selection_gold_nugget_bound": ("selections", TABLE, None, True),
    "selection_gold_nugget_bound_soft": ("selections", TABLE, None, True),
    "item_embeddings": ("budgeted", {"pytorch", "parquet"}, GPU, True),
    "token_counts": ("budgeted", TABLE, None, True),
    "lmvu_ranker": ("budgeted", {"sklearn", "mlflow"}, None, False),
    "budgeted_relevance": ("budgeted", TABLE, None, True),
    "budgeted_mmr": ("budgeted", TABLE, None, True),
    "budgeted_facloc": ("budgeted", TABLE, None, True),
    "budgeted_adagres": ("budgeted", TABLE, None, True),
    "budgeted_coverage_greedy": ("budgeted", TABLE, None, True),
    "budgeted_coverage_greedy_soft": ("budgeted", TABLE, None, True),
    "budgeted_oracle_greedy": ("budgeted", TABLE, None, True),
    "budgeted_gold_nugget_bound": ("budgeted", TABLE, None, True),
    "budgeted_gold_nugget_bound_soft": ("budgeted", TABLE, None, True),
    "budgeted_oracle_rvc1": ("budgeted", TABLE, None, True),
    "budgeted_oracle_rvc2": ("budgeted", TABLE, None, True),
    "budgeted_lmvu": ("budgeted", TABLE, None, True),
    "chunks": ("mcompass", TABLE, None, True),
    "chunk_links": ("mcompass", TABLE, None, True),
    "chunk_qrels": ("mcompass", TABLE, None, True),
    "chunk_index": ("mcompass", {"lucene"}, None, False),
    "topic_metadata_bank": ("mcompass", {"pytorch", "sklearn"}, GPU, False),
    "mcompass_teacher": ("mcompass", {"pytorch", "parquet"}, GPU, False),
    "mcompass_student": ("mcompass", {"pytorch", "mlflow"}, GPU, False),
    "mcompass_retrieval": ("mcompass", {"pytorch", "lucene", "parquet"}, GPU, True),
    "mcompass_pools": ("mcompass", TABLE, None, True),
    "mcompass_pool_coverage_matrix": ("mcompass", {"pytorch", "parquet"}, GPU, True),
    "coverage_report": ("reports", TABLE, None, False),
    "model_promotions": ("reports", {"mlflow", "parquet"}, None, True),
    "comparison_report": ("reports", TABLE, None, True),
    "retrieval_report": ("reports", TABLE, None, False),
    "pool_comparison": ("reports", TABLE, None, False),
    "answers": ("answers", TABLE, None, False),
    "answer_report": ("answers", TABLE, None, False),
    "transfer_report": ("reports", TABLE, None, True),
}
# Assets covlab observes and never materializes (orchestration/definitions.py OBSERVED_ASSETS): in no job.
EXPECTED_OBSERVED = {"adopted_models": ("coverage", {"mlflow"}, None, False)}
EXPECTED_CHECKS = {  # (asset, check)
    *((table, f"{table}_integrity")
      for table in ("corpus", "queries", "nuggets", "nugget_links", "qrels", "candidates")),
    ("coverage_estimator", "coverage_estimator_dev_auc"),
    ("estimated_gold_coverage_matrix", "estimated_gold_coverage_calibration"),
    ("model_promotions", "coverage_estimator_champion"),
    ("model_promotions", "coverage_biencoder_champion"),
    ("model_promotions", "lmvu_ranker_champion"),
    ("chunks", "chunks_tile_documents"),
    ("topic_metadata_bank", "topic_metadata_bank_is_valid"),
    ("mcompass_retrieval", "retrieval_runs_are_rankings"),
}
REPORTS = {"coverage_report", "comparison_report", "retrieval_report", "pool_comparison"}
EXPECTED_JOBS = {"build_all": set(EXPECTED_ASSETS), "demo": set(EXPECTED_ASSETS)}  # named jobs -> their assets
if importlib.util.find_spec("dagster_celery"):  # orchestration/distributed.py: only with dagster-celery installed
    EXPECTED_JOBS["build_all_celery"] = set(EXPECTED_ASSETS)
if importlib.util.find_spec("dagster_k8s"):  # the same, each step a Kubernetes job (deploy/k8s/)
    EXPECTED_JOBS["build_all_k8s"] = set(EXPECTED_ASSETS)
# the reports and every asset they read: what the nightly automation evaluates and may run
EVALUATION = set(EXPECTED_ASSETS) - {"model_promotions", "answers", "answer_report"}
EXPECTED_SENSORS = {"nightly_reevaluation": EVALUATION,  # sensor -> target assets
                    "mlflow_candidate_sensor": EVALUATION | {"model_promotions"},
                    "adopted_model_sensor": set()}  # it records observations of adopted_models, runs nothing
HEAVY = {key for key, (_, _, device, _) in EXPECTED_ASSETS.items() if device == GPU}


def _node(key: str):
    return defs.resolve_asset_graph().get(AssetKey(key))


def _targets(job_name: str) -> set[str]:
    return {key.to_user_string() for key in defs.resolve_job_def(job_name).asset_layer.selected_asset_keys}


def test_the_code_location_matches_its_written_out_snapshot():
    graph = defs.resolve_asset_graph()
    seen = {}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.owners == OWNERS == ["team:covlab"], key
        assert 1 <= len(node.kinds) <= 3, key  # the UI shows at most three
        seen[key.to_user_string()] = (node.group_name, node.kinds, node.tags.get(DEVICE_TAG),
                                      "dagster/column_schema" in node.metadata)
    assert seen == {**EXPECTED_ASSETS, **EXPECTED_OBSERVED}
    assert {k.to_user_string() for k in graph.get_all_asset_keys() if not graph.get(k).is_materializable} == set(
        EXPECTED_OBSERVED)
    assert {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys} == EXPECTED_CHECKS
    assert {job.name: _targets(job.name) for job in defs.resolve_all_job_defs()
            if not job.name.startswith("__")} == EXPECTED_JOBS  # "__": Dagster's implicit jobs
    assert not defs.schedules
    assert {s.name: {k.to_user_string() for k in s.asset_selection.resolve(graph)}
            if isinstance(s, AutomationConditionSensorDefinition) else _targets(s.job_name) if s.targets else set()
            for s in defs.sensors} == EXPECTED_SENSORS


def test_the_demo_job_launches_with_the_demos_config():
    """The Launchpad of the `demo` job opens on what `make demo` runs (DEMO_CONFIG), not on each asset's default."""
    from covlab.orchestration.definitions import DEMO_CONFIG

    assert defs.resolve_job_def("demo").get_run_config_for_partition_key("demo")["ops"] == DEMO_CONFIG["ops"]


def test_a_column_schema_is_its_tables_declaration():
    """Definition metadata `dagster/column_schema` lists the declared columns, dtypes and key (models/)."""
    from covlab.models.schemas import NUGGET_LINKS, QUERIES

    queries = _node("queries").metadata["dagster/column_schema"]
    assert [(c.name, c.type) for c in queries.columns] == list(QUERIES.columns.items())
    assert [c.name for c in queries.columns if c.constraints.unique] == ["query_id"]  # a one-column key
    assert queries.columns[3].description == "when absent: a copy of query_id"  # topic's default
    links = _node("nugget_links").metadata["dagster/column_schema"]
    assert [(c.name, c.type) for c in links.columns] == list(NUGGET_LINKS.columns.items())
    assert links.constraints.other == ["unique key (query_id, doc_id, nugget_id)"]
    assert not any(c.constraints.nullable for c in links.columns)  # string and int64: conform rejects missing
    scores = _node("relevance_scores").metadata["dagster/column_schema"]
    assert {c.name: c.constraints.nullable for c in scores.columns}["relevance"]  # float64 may be NaN


def test_every_heavy_asset_is_a_gpu_step_with_pool_device_tag_and_k8s_request():
    tagged = set()
    for assets_def in ASSETS:
        for key in assets_def.keys:
            op = assets_def.node_def
            if op.pool == GPU_POOL:
                tagged.add(key.to_user_string())
                assert op.tags["covlab/device"] == "gpu"
                assert assets_def.specs_by_key[key].tags[DEVICE_TAG] == "gpu"  # the UI's asset tag filter
                k8s = op.tags["dagster-k8s/config"]  # dict-valued op tags are stored as JSON
                limits = json.loads(k8s)["container_config"]["resources"]["limits"]
                assert limits["nvidia.com/gpu"] == "1"
    assert tagged == HEAVY
    assert gpu_step()["pool"] == GPU_POOL


def test_every_asset_has_a_code_version_and_the_datasets_partitions():
    for key in defs.resolve_asset_graph().materializable_asset_keys:
        node = _node(key.to_user_string())
        assert node.code_version, key
        assert node.partitions_def is not None and node.partitions_def.name == "datasets", key


def test_nightly_automation_and_candidate_sensor_are_defined():
    from covlab.orchestration.automation import nightly_condition

    nightly = defs.resolve_sensor_def("nightly_reevaluation")
    assert isinstance(nightly, AutomationConditionSensorDefinition)
    assert nightly.default_status == DefaultSensorStatus.STOPPED and not nightly.emit_backfills  # a run per dataset
    assert nightly.run_tags == {"covlab/trigger": "nightly"}
    graph = defs.resolve_asset_graph()
    conditioned = {k.to_user_string(): graph.get(k).automation_condition for k in graph.get_all_asset_keys()
                   if graph.get(k).automation_condition is not None}
    assert set(conditioned) == EVALUATION
    assert all(condition == nightly_condition() for condition in conditioned.values())
    sensor = defs.resolve_sensor_def("mlflow_candidate_sensor")
    assert sensor.minimum_interval_seconds == 300 and sensor.default_status == DefaultSensorStatus.STOPPED
    assert sensor.required_resource_keys == {"tracking"}


def test_the_gpu_pool_is_limited_in_the_generated_dagster_yaml(covlab_home):
    from covlab.orchestration.instance import dagster_home

    config = yaml.safe_load((dagster_home() / "dagster.yaml").read_text())
    assert config["concurrency"]["pools"]["default_limit"] == 1
    assert config["telemetry"]["enabled"] is False


def test_shipped_run_configs_are_valid_for_the_asset_job():
    """The documented configs name real assets and fields, with values of the right types; the untrained
    profile (a first verdict without training) sets the profile resource alone."""
    job = defs.resolve_implicit_global_asset_job_def()
    configs = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
    assert [p.name for p in configs] == ["argkp_bm25.yaml", "argkp_budgeted.yaml", "argkp_given.yaml",
                                      "argkp_matcher.yaml", "argkp_mcompass.yaml", "longdoc.yaml",
                                      "perspectrum_budgeted.yaml", "perspectrum_mcompass.yaml", "untrained.yaml"]
    assets = {key.to_python_identifier() for assets_def in ASSETS for key in assets_def.keys}
    for path in configs:
        config = yaml.safe_load(path.read_text())
        assert set(config.get("resources", {})) <= set(defs.resources), path.name
        validated = validate_run_config(job, config)
        if path.name == "untrained.yaml":
            assert config == {"resources": {"profile": {"config": {"untrained": True}}}}
            assert validated["resources"]["profile"]["config"] == {"untrained": True}
            continue
        assert set(config["ops"]) <= assets, path.name  # Dagster ignores config of an unknown op
        assert validated["ops"]["coverage_estimator"]["config"]["epochs"] >= 1
    with pytest.raises(DagsterInvalidConfigError, match="epochs"):
        validate_run_config(job, {"ops": {"coverage_estimator": {"config": {"epochs": "three"}}}})


def test_every_asset_links_to_the_code_that_computes_it():
    """The UI's code reference of each asset names a file of this checkout and the decorator or `def` of the
    function behind it; for a compute function that reports_peak_rss wraps, its own file (not device.py)."""
    import linecache
    import re

    graph = defs.resolve_asset_graph()
    root = Path(__file__).resolve().parents[1]
    for key in graph.materializable_asset_keys:
        (reference,) = graph.get(key).metadata["dagster/code_references"].code_references
        path = Path(reference.file_path)
        assert path.is_relative_to(root / "assets"), (key, path)
        assert re.match(r"\s*(@|def )", linecache.getline(str(path), reference.line_number)), (key, reference)
    (wrapped,) = graph.get(AssetKey("coverage_biencoder")).metadata["dagster/code_references"].code_references
    lines = Path(wrapped.file_path).read_text().splitlines()[wrapped.line_number - 1:]
    assert Path(wrapped.file_path).name == "coverage.py"
    assert next(line for line in lines if line.startswith("def ")).startswith("def coverage_biencoder(")


def test_asset_descriptions_render_as_written():
    """The UI renders descriptions as Markdown, where a bare `<dataset>` is an HTML tag and vanishes: placeholders
    in angle brackets sit in backticks."""
    import re

    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        prose = re.sub(r"`[^`]*`", "", graph.get(key).description or "")
        assert not re.search(r"<[A-Za-z_][^>\s]*>", prose), (key, prose)
