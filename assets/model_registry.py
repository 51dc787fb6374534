"""One helper that every trained-selector asset trains inside, so each gets the same MLflow run (spanning
the training, one metric step per epoch), model version with signature, tags, local copy and metadata
(version link, training curve) for free (DESIGN.md "Conventions").

    with training_run(context, tracking, "coverage_estimator", params) as training:
        trained = train_cross_encoder(..., on_epoch=training.on_epoch)
        model = training.register(artifacts, weights_dir, metrics, example=pairs.head(3), output="probability")
    return Output(model, metadata={..., **training.metadata()})
"""

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from dagster import AssetExecutionContext, AssetRecordsFilter, MetadataValue

from covlab.models.plots import markdown_image, training_curve
from covlab.models.versions import directory_hash
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.source import source_state
from covlab.resources.tracking import ModelVersionRef, TrackingResource, TrainingRun


def registered_model_name(dataset: str, selector: str) -> str:
    """The MLflow registered model of a trained selector on one dataset partition: covlab.<dataset>.<selector>."""
    return f"covlab.{dataset}.{selector}"


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


def registration_tags(context: AssetExecutionContext) -> dict[str, str]:
    """The Dagster run, asset, partition, code version, input data versions and git commit of this step."""
    asset_key = context.asset_key
    tags = {"dagster.run_id": context.run_id, "dagster.asset_key": asset_key.to_user_string(),
            "dagster.partition": context.partition_key,
            "dagster.code_version": context.assets_def.code_versions_by_key.get(asset_key) or "",
            "git.commit": source_state().commit or "unknown", "git.dirty": str(source_state().dirty).lower()}
    tags.update({f"input_data_version.{k}": v for k, v in input_data_versions(context).items()})
    return tags


class Training:
    """A selector's training in progress: its MLflow run (open), the epochs seen so far, and once
    registered, its model version."""

    def __init__(self, context: AssetExecutionContext, tracking: TrackingResource, selector: str, run: TrainingRun):
        self.context, self.tracking, self.selector, self.run = context, tracking, selector, run
        self.history: list[dict] = []
        self.ref: ModelVersionRef | None = None

    def on_epoch(self, epoch: int, metrics: Mapping[str, Any]) -> None:
        """The trainers' per-epoch callback: the figures become metric steps of the run, now."""
        self.history.append({"epoch": int(epoch), **{k: v for k, v in metrics.items() if v is not None}})
        self.run.log_epoch(epoch, metrics)

    def register(self, artifacts: ArtifactStore, weights_dir: str | Path, metrics: dict, example: Any = None,
                 output: str = "score") -> dict:
        """Register `weights_dir` as a new version of `covlab.<dataset>.<selector>` (alias `candidate`) with
        the run's tags and a signature (`example`'s columns in, `output` out; TrackingResource), ending the
        run; keep a local copy under the artifact store. Returns the asset's value: name, version, uri, MLflow
        run id, path, and the weights' `directory_hash` as `content_hash` (what the data version stands for)."""
        ref = self.ref = self.run.register(weights_dir, metrics, example=example, output=output)
        local = artifacts.directory(self.selector, self.context.partition_key, f"v{ref.version}")
        local.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=local.parent, prefix=".copy-") as work:
            shutil.copytree(weights_dir, Path(work) / "weights")
            if local.exists():
                shutil.rmtree(local)
            (Path(work) / "weights").rename(local)
        self.context.log.info(f"registered {ref.uri} (MLflow run {ref.run_id}): {self.tracking.version_url(ref)}")
        return {"name": ref.name, "version": ref.version, "uri": ref.uri, "mlflow_run_id": ref.run_id,
                "source": ref.source, "path": str(local), "content_hash": directory_hash(weights_dir)}

    def metadata(self, history: list[dict] | None = None, x: str = "epoch") -> dict:
        """The asset metadata that shows the training: a link to the model version in the MLflow UI and the
        curve of `history` (default: the epochs seen) as an inline PNG."""
        history = self.history if history is None else history
        found = {}
        if self.ref is not None:
            found["mlflow_model_version"] = MetadataValue.url(self.tracking.version_url(self.ref))
        if history:
            png = training_curve(history, f"{self.ref.name if self.ref else self.selector} training", x=x)
            found["training_curve"] = MetadataValue.md(markdown_image(png, f"{self.selector} training curve"))
        return found


@contextmanager
def training_run(context: AssetExecutionContext, tracking: TrackingResource, selector: str,
                 params: dict) -> Iterator[Training]:
    """The MLflow run of `covlab.<dataset>.<selector>`'s training, open for the block (its start and duration
    are the training's), tagged with `registration_tags`; FAILED if the block raises."""
    name = registered_model_name(context.partition_key, selector)
    with tracking.training_run(name, params, registration_tags(context)) as run:
        yield Training(context, tracking, selector, run)


def register_trained_model(context: AssetExecutionContext, tracking: TrackingResource, artifacts: ArtifactStore,
                           selector: str, weights_dir: str | Path, params: dict, metrics: dict) -> dict:
    """`Training.register` for weights trained outside a `training_run` (the run then spans only the upload)."""
    with training_run(context, tracking, selector, params) as training:
        return training.register(artifacts, weights_dir, metrics)


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
    name = registered_model_name(partition, selector)
    ref = tracking.version_for_alias(name, alias)
    if ref is None:
        raise ValueError(f"{name} has no version with alias {alias!r}; materialize {selector} for {partition!r} "
                         "first")
    local = artifacts.directory(selector, partition, f"v{ref.version}")
    return load_registered_model({"name": ref.name, "version": ref.version, "uri": ref.uri, "mlflow_run_id": ref.run_id,
                                  "source": ref.source, "path": str(local)}, tracking, artifacts), ref.uri
