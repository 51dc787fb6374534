"""The Dagster code location: every asset, check, job, schedule, sensor and resource of covlab."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path

from dagster import (AssetSelection, AssetSpec, BetaWarning, CodeReferencesMetadataValue, ConfigurableIOManagerFactory,
                     ConfigurableResource, Definitions, EnvVar, LocalFileCodeReference, define_asset_job,
                     map_asset_specs, with_source_code_references)

from covlab.assets.adoption import adopted_models
from covlab.assets.answers import answer_report, answers
from covlab.assets.budgeted import (BUDGETED_SELECTION_ASSETS, comparison_report, item_embeddings, lmvu_ranker,
                                    token_counts)
from covlab.assets.checks import ESTIMATOR_CHECKS
from covlab.assets.coverage import (coverage_biencoder, coverage_estimator, coverage_judgments,
                                    estimated_coverage_matrix, estimated_gold_coverage_matrix, pool_scores,
                                    relevance_scores, subquestions)
from covlab.assets.ingest import dataset_tables
from covlab.assets.mcompass import MCOMPASS_ASSETS, MCOMPASS_CHECKS
from covlab.assets.partitions import DATASETS
from covlab.assets.pools import bm25_index, bm25_pools
from covlab.assets.promotions import PROMOTION_CHECKS, model_promotions
from covlab.assets.report import coverage_report
from covlab.assets.selections import SELECTION_ASSETS
from covlab.assets.transfer import transfer_report
from covlab.orchestration.automation import (adopted_model_sensor, mlflow_candidate_sensor, nightly_reevaluation,
                                             with_nightly_condition)
from covlab.orchestration.distributed import distributed_jobs
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.device import MEASURED_SOURCES, DeviceResource
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.home import covlab_home, dataset_registry, mlflow_tracking_uri
from covlab.resources.io_manager import LocalTableIOManager
from covlab.resources.llm import LLMResource
from covlab.resources.lucene import LuceneResource
from covlab.resources.profile import PROFILE_RESOURCE, RunProfile
from covlab.resources.results_store import ResultsStore
from covlab.resources.scoring import EstimatorScoring
from covlab.resources.tracking import TrackingResource

# The metadata entry of an asset's links to its source code (the UI's "Code references").
CODE_REFERENCES = "dagster/code_references"


def with_code_references(assets: list) -> list:
    """Each asset with a link to the function that computes it: Dagster's `with_source_code_references`, except
    for compute functions `reports_peak_rss` wraps, whose link names the function's own file and line (Dagster's
    pairs the wrapper's file, resources/device.py, with the wrapped function's line)."""
    def own_source(spec: AssetSpec) -> AssetSpec:
        if spec.key.to_user_string() not in MEASURED_SOURCES:
            return spec
        path, line = MEASURED_SOURCES[spec.key.to_user_string()]
        return spec.replace_attributes(metadata={**spec.metadata, CODE_REFERENCES: CodeReferencesMetadataValue(
            code_references=[LocalFileCodeReference(file_path=path, line_number=line)])})

    with warnings.catch_warnings():  # code references are beta in Dagster 1.13: that warning, here only
        warnings.simplefilter("ignore", BetaWarning)
        return map_asset_specs(own_source, with_source_code_references(assets))


# The evaluation assets (the reports and what they read) carry the nightly's automation condition.
ASSETS = with_code_references(with_nightly_condition([
    dataset_tables, bm25_index, bm25_pools, subquestions, coverage_judgments, coverage_estimator,
    coverage_biencoder, relevance_scores, pool_scores, estimated_coverage_matrix, estimated_gold_coverage_matrix,
    *SELECTION_ASSETS, coverage_report, model_promotions, item_embeddings, token_counts, lmvu_ranker,
    *BUDGETED_SELECTION_ASSETS, comparison_report, *MCOMPASS_ASSETS, answers, answer_report,
    transfer_report,
    # checks ride along: every materialization of their asset runs them
    *ESTIMATOR_CHECKS, *PROMOTION_CHECKS, *MCOMPASS_CHECKS]))

# Assets covlab observes but never materializes (adopted_model_sensor records their observations).
OBSERVED_ASSETS = [adopted_models]

build_all = define_asset_job("build_all", selection=AssetSelection.all(), partitions_def=DATASETS,
                             description="Every asset of one dataset partition, at each asset's config defaults.")

# `covlab demo` runs the real pipeline at a size 2 CPU cores finish in a few minutes: each query's own
# candidate pool instead of the BM25 top-100 (and MCompass pools of the same size), one estimator epoch at a
# higher learning rate, 8 evidence chunks per query for MCompassRAG's teacher to rate.
DEMO_CONFIG = {"ops": {
    "bm25_pools": {"config": {"mode": "given"}},
    "mcompass_pools": {"config": {"n": 0}},
    "coverage_estimator": {"config": {"epochs": 1, "learning_rate": 1e-4, "max_length": 128}},
    "coverage_biencoder": {"config": {"max_length": 128}},
    "mcompass_teacher": {"config": {"positives": 8}},
}}
# The same assets with the config `make demo` runs (DEMO_CONFIG) as the Launchpad's defaults, so that a run
# launched from the UI on demo is the demo's run.
demo = define_asset_job("demo", selection=AssetSelection.all(), config=DEMO_CONFIG,
                        description="Every asset of one dataset partition with the demo's settings (what `make demo` "
                                    "runs on demo): each query's given pool, one estimator epoch at lr 1e-4, "
                                    "128-token pairs.")


def default_resources(home: Path | None = None) -> dict:
    """Embedded defaults: SQLite and local folders under COVLAB_HOME. Each is a URL or path in config
    (run config `resources:` or the Launchpad) that also takes PostgreSQL, a tracking server or object storage;
    a deployment sets them for every process (webserver, daemon, workers) with the COVLAB_* variables below."""
    home = home or covlab_home()
    env = os.environ.get
    return {
        "datasets": dataset_registry(home),
        "lucene": LuceneResource(log_dir=str(home / "logs")),
        "artifacts": ArtifactStore(root=env("COVLAB_ARTIFACTS_ROOT") or str(home / "artifacts")),
        "io_manager": LocalTableIOManager(base_dir=env("COVLAB_STORAGE_URL") or str(home / "storage")),
        "llm": LLMResource(cache_url=f"sqlite:///{home}/llm/cache.sqlite",
                           backend=os.environ.get("COVLAB_LLM_BACKEND", "none"),
                           base_url=os.environ.get("COVLAB_LLM_BASE_URL", "http://127.0.0.1:8000/v1"),
                           model=os.environ.get("COVLAB_LLM_MODEL", ""),
                           # read at run time, never stored in config; absent means no key is sent
                           api_key=EnvVar("COVLAB_LLM_API_KEY") if os.environ.get("COVLAB_LLM_API_KEY") else None),
        "device": DeviceResource(),
        "tracking": TrackingResource(
            tracking_uri=mlflow_tracking_uri(home),
            artifact_root=env("COVLAB_MLFLOW_ARTIFACT_ROOT") or str(home / "mlflow" / "artifacts")),
        "results": ResultsStore(url=env("COVLAB_RESULTS_URL") or f"sqlite:///{home}/results/results.db"),
        "evaluation": EvaluationResource(),
        "estimator_scoring": EstimatorScoring(),
        PROFILE_RESOURCE: RunProfile(),
    }


def with_resource_settings(resources: Mapping[str, object], run_config: Mapping) -> dict:
    """`run_config` with the settings it gives a resource (`resources: <key>: config: {...}`) laid over the
    settings that resource already has in `resources` (default_resources: the COVLAB_* environment, then the
    defaults), so that `llm: {config: {timeout_s: 5}}` changes timeout_s alone. Dagster itself takes the given
    settings as the resource's whole config ("Missing required config entry cache_url"). An entry Dagster will
    refuse (an unknown resource, a config that is not a mapping) is passed on unchanged for it to refuse."""
    given = run_config.get("resources")
    if not isinstance(given, Mapping):
        return dict(run_config)
    merged = {}
    for key, entry in given.items():
        resource = resources.get(key)
        if isinstance(resource, (ConfigurableResource, ConfigurableIOManagerFactory)) and isinstance(entry, Mapping) \
                and isinstance(entry.get("config"), Mapping):
            current = resource.get_resource_definition().config_schema.as_field()
            settings = current.default_value if current.default_provided else {}
            entry = {**entry, "config": {**settings, **entry["config"]}}
        merged[key] = entry
    return {**run_config, "resources": merged}


defs = Definitions(assets=[*ASSETS, *OBSERVED_ASSETS], jobs=[build_all, demo, *distributed_jobs()],
                   sensors=[nightly_reevaluation, mlflow_candidate_sensor, adopted_model_sensor],
                   resources=default_resources())
