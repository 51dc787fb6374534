"""One helper that every trained-selector asset uses to register its weights, so each gets the same
MLflow model version, tags and local copy for free (DESIGN.md "Conventions")."""

import shutil
import tempfile
from pathlib import Path

from dagster import AssetExecutionContext, AssetRecordsFilter

from covlab.models.versions import directory_hash
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.source import source_state
from covlab.resources.tracking import ModelVersionRef, TrackingResource


def input_data_versions(context: AssetExecutionContext) -> dict[str, str]:
    """Data version of each upstream asset's latest materialization of this partition: what was read."""
    versions = {}
    for key in sorted(context.assets_def.dependency_keys, key=lambda k: k.to_user_string()):
        records = context.instance.fetch_materializations(
            AssetRecordsFilter(asset_key=key, asset_partitions=[context.partition_key]), limit=1).records
        if records:
            version = records[0].asset_materialization.tags.get("dagster/data_version")
            versions[key.to_user_string()] = version or "unknown"
    return versions


def register_trained_model(context: AssetExecutionContext, tracking: TrackingResource, artifacts: ArtifactStore,
                           selector: str, weights_dir: str | Path, params: dict, metrics: dict) -> dict:
    """Register `weights_dir` as a new version of `covlab.<dataset>.<selector>` (alias `candidate`), tagged
    with the Dagster run, asset, partition, code version, input data versions and git commit; keep a local
    copy under the artifact store. Returns the asset's value: name, version, uri, MLflow run id, path, and
    the weights' `directory_hash` as `content_hash` (the content the asset's data version stands for)."""
    asset_key = context.asset_key
    tags = {"dagster.run_id": context.run_id, "dagster.asset_key": asset_key.to_user_string(),
            "dagster.partition": context.partition_key,
            "dagster.code_version": context.assets_def.code_versions_by_key.get(asset_key) or "",
            "git.commit": source_state().commit or "unknown", "git.dirty": str(source_state().dirty).lower()}
    tags.update({f"input_data_version.{k}": v for k, v in input_data_versions(context).items()})
    ref = tracking.log_model_version(f"covlab.{context.partition_key}.{selector}", Path(weights_dir),
                                     params=params, metrics=metrics, tags=tags)
    local = artifacts.directory(selector, context.partition_key, f"v{ref.version}")
    local.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=local.parent, prefix=".copy-") as work:
        shutil.copytree(weights_dir, Path(work) / "weights")
        if local.exists():
            shutil.rmtree(local)
        (Path(work) / "weights").rename(local)
    context.log.info(f"registered {ref.uri} (MLflow run {ref.run_id})")
    return {"name": ref.name, "version": ref.version, "uri": ref.uri, "mlflow_run_id": ref.run_id,
            "source": ref.source, "path": str(local), "content_hash": directory_hash(weights_dir)}


def load_registered_model(value: dict, tracking: TrackingResource, artifacts: ArtifactStore) -> str:
    """A local weights directory for a registered model value: the local copy, else downloaded from MLflow."""
    if Path(value["path"]).is_dir():
        return value["path"]
    ref = ModelVersionRef(name=value["name"], version=int(value["version"]), uri=value["uri"],
                          run_id=value["mlflow_run_id"], source=value["source"])
    return str(tracking.download(ref, Path(value["path"])))


def load_model_by_alias(tracking: TrackingResource, artifacts: ArtifactStore, partition: str, selector: str,
                        alias: str) -> tuple[str, str]:
    """A local weights directory and the model URI of the version of `covlab.<partition>.<selector>` that
    carries `alias` (the local copy the registration kept, else downloaded); a clear error when none does."""
    name = f"covlab.{partition}.{selector}"
    ref = tracking.version_for_alias(name, alias)
    if ref is None:
        raise ValueError(f"{name} has no version with alias {alias!r}; materialize {selector} for {partition!r} "
                         "first")
    local = artifacts.directory(selector, partition, f"v{ref.version}")
    return load_registered_model({"name": ref.name, "version": ref.version, "uri": ref.uri, "mlflow_run_id": ref.run_id,
                                  "source": ref.source, "path": str(local)}, tracking, artifacts), ref.uri
