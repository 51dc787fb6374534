"""One helper that every trained-selector asset trains inside, so each gets the same MLflow run (spanning
the training, one metric step per epoch), model version with signature, tags, local copy and metadata
(version link, training curve) for free.

    with training_run(context, tracking, "coverage_estimator", params) as training:
        trained = train_cross_encoder(..., on_epoch=training.on_epoch)
        model = training.register(artifacts, weights_dir, metrics, example=pairs.head(3), output="probability")
    return Output(model, metadata={..., **training.metadata()})
"""

import json
import shutil
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Mapping

from dagster import AssetExecutionContext, AssetRecordsFilter, Failure, MetadataValue, Output

from covlab.assets.outputs import content_output
from covlab.models.adoption import ModelAdoption, ModelSource
from covlab.models.plots import markdown_image, training_curve
from covlab.models.registry import trained_selector
from covlab.models.replay import RecordedDecisions
from covlab.models.versions import directory_hash
from covlab.resources.artifacts import ArtifactStore, write_directory
from covlab.resources.lineage import ADOPTED
from covlab.resources.materializations import TRAINING, TrainingSummary
from covlab.resources.source import source_state
from covlab.resources.model_store import (ADOPTED_FROM_TAG, TRAINED_ON_TAG, TRAINED_VALUE_TAG, WEIGHTS_HASH,
                                         WEIGHTS_METADATA, ModelVersionRef, RegisteredModel, TrainedModel,
                                         WeightsChanged, decisions_tag, recorded_decisions, weights_change)
from covlab.resources.tracking import Serving, TrackingResource, TrainingRun


def weights_folder(version: int, content_hash: str) -> str:
    """The folder of a version's local weights copy under `<artifacts>/<selector>/<dataset>/`: `v<N>-<hash>`,
    named by content as well as version, so that a version number a new MLflow registry hands out again never
    lands on an earlier registry's copy."""
    return f"v{version}-{content_hash[:16]}"


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


INPUT_VERSION_TAG = "input_data_version."


def step_tags(context: AssetExecutionContext) -> dict[str, str]:
    """The Dagster run, asset, partition, code version and git commit of this step."""
    asset_key = context.asset_key
    return {"dagster.run_id": context.run_id, "dagster.asset_key": asset_key.to_user_string(),
            "dagster.partition": context.partition_key,
            "dagster.code_version": context.assets_def.code_versions_by_key.get(asset_key) or "",
            "git.commit": source_state().commit or "unknown", "git.dirty": str(source_state().dirty).lower()}


def registration_tags(context: AssetExecutionContext) -> dict[str, str]:
    """`step_tags` and the data version of each input the training read."""
    return {**step_tags(context), **{f"{INPUT_VERSION_TAG}{k}": v for k, v in input_data_versions(context).items()}}


class Training:
    """A selector's training in progress: its MLflow run (open), the epochs seen so far, and once
    registered, its model version."""

    def __init__(self, context: AssetExecutionContext, tracking: TrackingResource, selector: str, run: TrainingRun):
        self.context, self.tracking, self.selector, self.run = context, tracking, selector, run
        self.history: list[dict] = []
        self.ref: ModelVersionRef | None = None
        self.model: RegisteredModel | None = None

    def on_epoch(self, epoch: int, metrics: Mapping[str, Any]) -> None:
        """The trainers' per-epoch callback: the figures become metric steps of the run, now."""
        self.history.append({"epoch": int(epoch), **{k: v for k, v in metrics.items() if v is not None}})
        self.run.log_epoch(epoch, metrics)

    def register(self, artifacts: ArtifactStore, weights_dir: str | Path, metrics: dict, example: Any = None,
                 output: str = "score", serving: Serving | None = None) -> RegisteredModel:
        """Register `weights_dir` as a new version of `covlab.<dataset>.<selector>` (alias `candidate`) with
        the run's tags and a signature (`example`'s columns in, `output` out; TrackingResource), ending the
        run; keep a local copy under the artifact store, named by version and content (never replacing another
        registry's). Returns the RegisteredModel: name, version, uri, MLflow run id, local path, and the weights'
        `directory_hash` as `content_hash` (what the data version stands for, and what every load verifies:
        load_registered_model); the asset's value is a TrainedModel around it."""
        ref = self.ref = self.run.register(weights_dir, metrics, example=example, output=output, serving=serving)
        digest = directory_hash(weights_dir)
        local = artifacts.directory(self.selector, self.context.partition_key, weights_folder(ref.version, digest))
        write_directory(local, lambda folder: shutil.copytree(weights_dir, folder, dirs_exist_ok=True),
                        replace=weights_change(local, digest) is not None)
        self.context.log.info(f"registered {ref.uri} (MLflow run {ref.run_id}): {self.tracking.version_url(ref)}")
        self.model = RegisteredModel(name=ref.name, version=ref.version, uri=ref.uri, mlflow_run_id=ref.run_id,
                                     source=ref.source, path=str(local), content_hash=digest)
        return self.model

    def metadata(self, summary: TrainingSummary, history: list[dict] | None = None, x: str = "epoch") -> dict:
        """The asset metadata that shows the training: what it took (`summary`, which a lineage's cost sums), a
        link to the model version in the MLflow UI, the local weights folder with its content hash (`weights`:
        what `covlab audit` checks on disk) and the curve of `history` (default: the epochs seen) as an inline
        PNG."""
        history = self.history if history is None else history
        found = {TRAINING: MetadataValue.json(summary.to_dict())}
        if self.ref is not None:
            found["mlflow_model_version"] = MetadataValue.url(self.tracking.version_url(self.ref))
        if self.model is not None:
            found[WEIGHTS_METADATA] = MetadataValue.json({"path": self.model.path,
                                                          WEIGHTS_HASH: self.model.content_hash})
        if history:
            png = training_curve(history, f"{self.ref.name if self.ref else self.selector} training", x=x)
            found["training_curve"] = MetadataValue.md(markdown_image(png, f"{self.selector} training curve"))
        return found


@contextmanager
def training_run(context: AssetExecutionContext, tracking: TrackingResource, selector: str,
                 params: dict) -> Iterator[Training]:
    """The MLflow run of `covlab.<dataset>.<selector>`'s training, open for the block (its start and duration
    are the training's), tagged with `registration_tags`; FAILED if the block raises. Earlier training runs of
    the model left RUNNING by a Dagster run that is over are ended FAILED first."""
    name = registered_model_name(context.partition_key, selector)

    def over(run_id: str) -> bool:
        run = context.instance.get_run_by_id(run_id)
        return run_id != context.run_id and (run is None or run.is_finished)

    tracking.end_orphaned_runs(name, over)
    with tracking.training_run(name, params, registration_tags(context)) as run:
        yield Training(context, tracking, selector, run)


def trained_output(tracking: TrackingResource, value: TrainedModel, metadata: dict) -> Output[TrainedModel]:
    """A trained asset's Output (versioned by content), its value's record also kept on its registered version
    (TRAINED_VALUE_TAG): what a dataset that adopts the version reads back (`adopt_model`)."""
    tracking.set_version_tag(value.model.ref(), TRAINED_VALUE_TAG, json.dumps(_portable(value), sort_keys=True))
    return content_output(value, metadata=metadata)


def _portable(value: TrainedModel) -> dict:
    """A trained value's record without where its files lie on this machine."""
    return {k: v for k, v in value.to_record().items() if k != "path"}


def source_version(tracking: TrackingResource, source: ModelSource, selector: str) -> ModelVersionRef | None:
    """The registered version of trained selector `selector` that `source` names (its alias or its number); None
    when the source has no such version."""
    name = registered_model_name(source.dataset, selector)
    return (tracking.version(name, source.version) if source.version is not None
            else tracking.version_for_alias(name, source.alias))


def adopt_model(context: AssetExecutionContext, tracking: TrackingResource, artifacts: ArtifactStore,
                selector: str, source: ModelSource) -> TrainedModel:
    """The registered version of `selector` that `source` names (another dataset's, by alias or version), taken
    instead of training: registered as a new version of this dataset's model (the same files, tagged with the
    dataset it was trained on), its files copied to this dataset's artifacts and verified, its value the source's
    record (figures, settings, protocol) with the adoption beside it (models/adoption.py). Failure naming what to
    materialize when the source has no such version, or registered it before versions recorded their value."""
    name = registered_model_name(source.dataset, selector)
    ref = source_version(tracking, source, selector)
    if ref is None:
        asked = f"version {source.version}" if source.version is not None else f"a version aliased {source.alias!r}"
        raise Failure(f"{context.partition_key} adopts {selector} from {source.spec()}, but {name} has no {asked}: "
                      f"materialize {selector} for {source.dataset} (and promote it) first, or name another version "
                      f"(`covlab dataset add {context.partition_key} ... --models-from {source.dataset}@v<N>`)")
    if TRAINED_VALUE_TAG not in ref.tags:
        raise Failure(f"{ref.uri} was registered before versions recorded their trained value "
                      f"({TRAINED_VALUE_TAG}); re-materialize {selector} for {source.dataset}, then adopt it")
    trained = TrainedModel.from_record({**json.loads(ref.tags[TRAINED_VALUE_TAG]), "path": ""})
    # a version the source itself adopted names the dataset that trained it, and what that training read
    adoption = ModelAdoption(
        trained_on=trained.trained_on or ref.tags.get("dagster.partition", source.dataset), source_uri=ref.uri,
        source_version=ref.version,
        training_data_versions=(trained.adoption.training_data_versions if trained.adoption else
                                {k.removeprefix(INPUT_VERSION_TAG): v for k, v in ref.tags.items()
                                 if k.startswith(INPUT_VERSION_TAG)}),
        training_run_id=trained.adoption.training_run_id if trained.adoption else ref.tags.get("dagster.run_id", ""))
    own = tracking.register_adopted(ref, registered_model_name(context.partition_key, selector), {
        **step_tags(context), TRAINED_ON_TAG: adoption.trained_on, ADOPTED_FROM_TAG: ref.uri})
    digest = trained.model.content_hash
    local = artifacts.directory(selector, context.partition_key, weights_folder(own.version, digest))
    write_directory(local, lambda folder: tracking.download(ref, folder, digest),
                    replace=weights_change(local, digest) is not None)
    context.log.info(f"adopted {ref.uri} (trained on {adoption.trained_on}) as {own.uri}")
    model = RegisteredModel(name=own.name, version=own.version, uri=own.uri, mlflow_run_id=ref.run_id or "",
                            source=ref.source, path=str(local), content_hash=digest)
    return replace(trained, model=model, adoption=adoption)


def adoption_metadata(value: TrainedModel, source: ModelSource) -> dict:
    """The metadata of an adopting materialization: what it took, from where and as named (`models_from`), and
    what that was trained on."""
    return {ADOPTED: MetadataValue.json(value.adoption.to_record()), "models_from": source.spec(),
            "trained_on": value.adoption.trained_on, "model_uri": value.model.uri,
            WEIGHTS_METADATA: MetadataValue.json({"path": value.model.path, WEIGHTS_HASH: value.model.content_hash})}


def source_replay(tracking: TrackingResource, value: TrainedModel, method: str):
    """For an estimator adopted from another dataset, the decisions `method`'s selections took on its source
    version, as a replay (models/replay.py RecordedDecisions.replay) that a dataset without a tune split applies;
    None for an estimator trained here."""
    if value.adoption is None:
        return None
    ref = tracking.version(value.adoption.source_model, value.adoption.source_version)
    return None if ref is None else recorded_decisions(ref, method).replay(value.adoption.trained_on)


def serving_of(selector: str, query: str, candidates: list[str], budget: dict) -> Serving | None:
    """How the version of trained selector `selector` serves as an MLflow pyfunc: the registry method its
    promotion is decided by (models/registry.py TRAINED_SELECTORS; None for a selector never promoted, which
    registers no pyfunc), with one real request (`query`, `candidates`, `budget`: {"k": n} or
    {"budget_tokens": B}) as the input example."""
    trained = trained_selector(selector)
    if trained.promotion is None:
        return None
    return Serving(trained.promotion.method, {"query": query, "candidates": list(candidates), **budget})


def record_decisions(tracking: TrackingResource, model: TrainedModel, method: str, unit: str,
                     decisions: RecordedDecisions) -> None:
    """Tag `model`'s version with what `method`'s selections on its output decided at the budgets of `unit` and
    the settings they ran under (models/replay.py): what a caller served by that version replays."""
    if decisions.budgets:
        tracking.set_version_tag(model.model.ref(), decisions_tag(method, unit), decisions.to_json())


def load_registered_model(value: TrainedModel | RegisteredModel, tracking: TrackingResource,
                          artifacts: ArtifactStore) -> str:
    """A local weights directory for a registered model value: the local copy, else downloaded from MLflow;
    either way verified against the value's `content_hash` (WeightsChanged naming both hashes when it differs;
    a download that differs is removed again)."""
    model = value.model if isinstance(value, TrainedModel) else value
    if not Path(model.path).is_dir():
        return str(tracking.download(model.ref(), Path(model.path), content_hash=model.content_hash))
    problem = weights_change(model.path, model.content_hash)
    if problem:
        raise WeightsChanged(f"{model.uri}: {problem} (changed after registration); remove {model.path} to load "
                             f"version {model.version} again from MLflow (verified), or re-materialize the model")
    return model.path
