"""Trained selectors as MLflow registered model versions.

A training opens its MLflow run before it starts (`training_run`), so the run's start and duration are the
training's; the trainer logs each epoch's figures as metric steps while it runs (named `epoch/<figure>`, one
curve each, apart from the run's final figures of the same name, which are those of the epoch kept), and a
failure ends the run as FAILED. The weights directory a model's `save_pretrained` wrote (safetensors, config,
tokenizer files) is logged as run artifacts, byte for byte, so it reloads with any batch size (not torch.export, which fixes the batch
size in MLflow 3.17). The run's parameters, metrics and tags go with it; the version is
registered under a model name with the same tags and a description saying what trained it and its final
figures, and gets the alias `candidate`, which an evaluation may
promote to `champion`. Beside the weights goes an MLmodel file with the model's signature (what it reads,
what number it returns) and an input example, so the version page shows them and
`mlflow.models.get_model_info` reloads them; `download` leaves those two files out.

Every call goes through an MlflowClient with explicit tracking and registry URIs; no mlflow global
(tracking URI, active run) is read or changed. Nothing secret is logged: parameters and tags whose name
looks like a secret, or whose value contains the value of an environment variable whose name looks like a
secret (in any common encoding: resources/secrets.py), are redacted, and a weights directory holding such a
value is refused.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from dagster import ConfigurableResource
from pydantic import Field, PrivateAttr

from covlab.models.versions import file_hashes, files_hash
from covlab.resources.model_store import (CANDIDATE_ALIAS, CONTENT_HASH_TAG, INPUT_EXAMPLE_FILE, MLFLOW_FILES,
                                         MLMODEL_FILE, SERVING_LOADER, VERSION_HASH_TAG, ModelStore,
                                         ModelVersionRef, serving_signature, version_ref)
from covlab.resources.secrets import SECRET_ENV_PATTERN, contains_secret, environment_secrets, redacted_uri

# Parameter and tag names that hold secrets: llm.api_key, apiKey, db.password, hf_token, llm.token (not
# token_budget, max_tokens or tokenizer.pad_token, which this project logs).
SECRET_NAME_PATTERN = (r"(?i)(api_?key|secret|passw(or)?d|credential|(^|[.\-])token$"
                       r"|(access|auth|bearer|api|hf|refresh)[_\-]?token$)")
REDACTED = "[redacted]"
# The port `make mlflow-ui` serves the MLflow UI on (the Makefile exports MLFLOW_PORT) and its default: links to
# a version point there when the tracking URI is not an MLflow server and no ui_url is set.
MLFLOW_PORT_ENV, DEFAULT_MLFLOW_PORT = "MLFLOW_PORT", "5000"
# The tag of a training run naming the Dagster run that trained it (assets/model_registry.py: registration_tags).
DAGSTER_RUN_TAG = "dagster.run_id"
# Per-epoch figures are logged as `epoch/<name>` at step = epoch; the final figures keep the bare name.
EPOCH_METRIC_PREFIX = "epoch/"
# The MLflow 3 UI opens every page in its GenAI workflow (traces, sessions, judges) unless the URL's query asks
# for the model-training one, where an experiment opens on its runs: every link covlab gives carries it.
UI_WORKFLOW_QUERY = "?workflowType=machine_learning"

_LOG = logging.getLogger("covlab.tracking")


class TrackingResource(ConfigurableResource):
    """MLflow tracking and model registry for trained selectors: log a weights directory as a registered
    model version, move aliases, download a version's weights."""

    tracking_uri: str = Field(description="MLflow tracking URI, e.g. sqlite:////path/mlflow.db, "
                                          "postgresql://user@host/db or http://host:5000")
    registry_uri: str | None = Field(None, description="MLflow model registry URI; None: the tracking URI")
    artifact_root: str | None = Field(None, description="where a newly created experiment keeps run artifacts "
                                                        "(a local folder or an artifact URI such as s3://...); "
                                                        "None: the tracking server's default")
    experiment: str = Field("covlab", description="MLflow experiment of the training runs")
    candidate_alias: str = Field(CANDIDATE_ALIAS, description="alias given to every newly registered version")
    weights_artifact_path: str = Field("weights", description="run artifact folder holding the weights files")
    secret_name_pattern: str = Field(SECRET_NAME_PATTERN, description="regular expression for names of "
                                     "parameters and tags whose values are secrets (logged as redacted)")
    secret_env_pattern: str = Field(SECRET_ENV_PATTERN, description="regular expression for names of "
                                    "environment variables whose values must appear in no parameter, tag "
                                    "or logged file")
    min_secret_length: int = Field(8, description="environment values shorter than this are not treated as "
                                                  "secrets when searching values and files")
    lock_timeout_s: float = Field(300.0, gt=0, description="how long a first use waits for another process "
                                                         "creating or migrating the same SQLite database")
    ui_url: str | None = Field(None, description="MLflow UI address for links to model versions; None: the "
                                                 "tracking URI when it is an http(s) server, else "
                                                 f"http://127.0.0.1:${MLFLOW_PORT_ENV} (make mlflow-ui; "
                                                 f"{DEFAULT_MLFLOW_PORT} when unset)")

    _store: Any = PrivateAttr(default=None)

    def store(self) -> ModelStore:
        """The registry these settings name (resources/model_store.py), opened on first use."""
        if self._store is None:
            self._store = ModelStore(self.tracking_uri, self.registry_uri, self.lock_timeout_s)
        return self._store

    def _client(self):
        return self.store().client()

    def version_for_alias(self, name: str, alias: str) -> ModelVersionRef | None:
        """The version `alias` points at, or None when the model or the alias does not exist."""
        return self.store().version_for_alias(name, alias)

    def versions(self, name: str) -> list[ModelVersionRef]:
        """Every version of `name` with its tags and aliases, oldest first; [] when it is not registered."""
        return self.store().versions(name)

    def version(self, name: str, number: int) -> ModelVersionRef | None:
        """Version `number` of `name` with its tags and aliases; None when there is no such version."""
        return self.store().version(name, number)

    def download(self, ref: ModelVersionRef, dst: Path | None = None, content_hash: str | None = None) -> Path:
        """The version's weights, verified (ModelStore.download) under this resource's artifact folder name."""
        return self.store().download(ref, dst, content_hash, self.weights_artifact_path)

    def metric(self, ref: ModelVersionRef, key: str) -> float:
        """The last logged value of metric `key` of the run that produced `ref` (ModelStore.metric)."""
        return self.store().metric(ref, key)

    @contextmanager
    def training_run(self, name: str, params: dict, tags: dict[str, str]) -> Iterator["TrainingRun"]:
        """An MLflow run of the experiment, opened now with `params` and `tags` (redacted as secrets need),
        for the training of model `name` inside the block: log each epoch with `log_epoch`, then
        `register` the weights. The run ends FINISHED when `register` has logged them (or the block ends),
        FAILED when the block raises."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

        secrets = self._secret_values()
        safe_params = self._redacted(_flattened(params), secrets)
        safe_tags = self._redacted(tags, secrets)
        client = self._client()
        run = client.create_run(self._experiment_id(), tags=safe_tags, run_name=name)
        training = TrainingRun(self, name, run.info.run_id, run.info.artifact_uri, safe_tags)
        try:
            param_list = [Param(key, value) for key, value in safe_params.items()]
            for start in range(0, len(param_list), MAX_PARAMS_TAGS_PER_BATCH):
                client.log_batch(training.run_id, params=param_list[start:start + MAX_PARAMS_TAGS_PER_BATCH])
            yield training
        except BaseException:
            if not training.ended:
                training.fail()
            raise
        if not training.ended:
            training.end("FINISHED")

    def end_orphaned_runs(self, name: str, over: Callable[[str], bool]) -> list[str]:
        """Ends FAILED the training runs of model `name` still RUNNING although the Dagster run that trained them
        (tag dagster.run_id) is `over` (ended, or gone): a process killed, or a full disk that let no end be
        recorded, leaves them RUNNING for good otherwise. Returns the MLflow run ids ended."""
        client = self._client()
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            return []
        ended = []
        for run in client.search_runs([experiment.experiment_id], "attributes.status = 'RUNNING'"):
            dagster_run = run.data.tags.get(DAGSTER_RUN_TAG)
            if run.info.run_name == name and dagster_run and over(dagster_run):
                client.set_terminated(run.info.run_id, "FAILED")
                ended.append(run.info.run_id)
        return ended

    def ui_base_url(self) -> str:
        """Where the MLflow UI of this tracking store is served (`ui_url`'s description says how it is found)."""
        if self.ui_url:  # links go into metadata and logs: never with credentials (user:password@)
            return redacted_uri(self.ui_url.rstrip("/"))
        if self.tracking_uri.startswith(("http://", "https://")):
            return redacted_uri(self.tracking_uri.rstrip("/"))
        return f"http://127.0.0.1:{os.environ.get(MLFLOW_PORT_ENV) or DEFAULT_MLFLOW_PORT}"

    def version_url(self, ref: ModelVersionRef) -> str:
        """The MLflow UI page of a model version (`ui_base_url`), in the UI's model-training workflow."""
        from urllib.parse import quote

        return f"{self.ui_base_url()}/#/models/{quote(ref.name, safe='')}/versions/{ref.version}{UI_WORKFLOW_QUERY}"

    def register_adopted(self, source: ModelVersionRef, name: str, tags: dict[str, str]) -> ModelVersionRef:
        """Register `source`'s files (not copied: the same artifact location and run) as a new version of `name`
        with `tags` beside the source's content and version hashes, and point the candidate alias at it: a model
        adopted from another dataset (models/adoption.py) is then a version of the adopting dataset's model."""
        client = self._client()
        self._ensure_registered_model(name)
        tags = {**self._redacted(tags, self._secret_values()),
                **{key: source.tags[key] for key in (CONTENT_HASH_TAG, VERSION_HASH_TAG) if key in source.tags}}
        version = client.create_model_version(name, source.source, run_id=source.run_id, tags=tags,
                                              description=f"adopted: the files of {source.uri}")
        client.set_registered_model_alias(name, self.candidate_alias, str(version.version))
        return version_ref(version, (self.candidate_alias,))

    def set_alias(self, name: str, alias: str, version: int) -> None:
        """Point `alias` (e.g. champion) at `version` of `name`, moving it from any other version."""
        self._client().set_registered_model_alias(name, alias, str(version))

    def set_version_tag(self, ref: ModelVersionRef, key: str, value: str) -> None:
        """Tag a model version (e.g. the figure that promoted it), redacted as every tag is."""
        (safe,) = self._redacted({key: value}, self._secret_values()).values()
        self._client().set_model_version_tag(ref.name, str(ref.version), key, safe)

    def log_metric(self, ref: ModelVersionRef, key: str, value: float) -> None:
        """Record a figure measured after training (e.g. the dev score an evaluation gave this version) on
        the version's run, where `metric` finds it."""
        if ref.run_id is None:
            raise KeyError(f"{ref.uri} has no MLflow run to log {key!r} on")
        self._client().log_metric(ref.run_id, key, float(value))

    def _weights_files(self, weights_dir: Path, secrets: dict[str, str]) -> list[Path]:
        files = sorted(p for p in weights_dir.rglob("*") if p.is_file()) if weights_dir.is_dir() else []
        if not files:
            raise FileNotFoundError(f"{weights_dir}: no files to log; expected the folder that "
                                    "save_pretrained wrote (safetensors, config, tokenizer files)")
        clashing = [f.name for f in files if f.parent == weights_dir and f.name in MLFLOW_FILES]
        if clashing:
            raise ValueError(f"{weights_dir} holds {clashing}; those names are MLflow's model metadata, written "
                             "beside the weights at registration")
        _refuse_secrets_in(files, secrets)
        return files

    def _registry_uri(self) -> str:
        # Explicit, so that MLFLOW_REGISTRY_URI or mlflow.set_registry_uri elsewhere cannot redirect us.
        return self.registry_uri or self.tracking_uri

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        client = self._client()
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            location = None
            if self.artifact_root is not None:
                root = self.artifact_root
                location = root if "://" in root else Path(root).resolve().as_uri()
            try:
                return client.create_experiment(self.experiment, artifact_location=location)
            except MlflowException as exc:  # another process created it first
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                experiment = client.get_experiment_by_name(self.experiment)
        if experiment.lifecycle_stage != "active":
            raise RuntimeError(f"MLflow experiment {self.experiment!r} at {redacted_uri(self.tracking_uri)} is "
                               "deleted; restore it (mlflow experiments restore) or configure another experiment")
        return experiment.experiment_id

    def _ensure_registered_model(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self._client().create_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise

    def _secret_values(self) -> dict[str, str]:
        """Environment variables whose name looks like a secret: name -> value."""
        return environment_secrets(pattern=self.secret_env_pattern, min_length=self.min_secret_length)

    def _redacted(self, mapping: Mapping[str, Any], secrets: dict[str, str]) -> dict[str, str]:
        safe = {}
        for key, value in mapping.items():
            text = str(value)
            hides_secret = re.search(self.secret_name_pattern, key) or contains_secret(text, secrets.values())
            safe[key] = REDACTED if hides_secret else text
        return safe


class TrainingRun:
    """The MLflow run of one training while it runs (`TrackingResource.training_run`)."""

    def __init__(self, tracking: TrackingResource, name: str, run_id: str, artifact_uri: str,
                 tags: dict[str, str]):
        self.tracking, self.name, self.run_id, self.artifact_uri, self.tags = tracking, name, run_id, artifact_uri, tags
        self.ended = False

    def log_epoch(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Each of `metrics` (name -> number; None skipped) as `epoch/<name>` at `step` (the epoch), timestamped
        now: the curves of the run page."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(EPOCH_METRIC_PREFIX + key, value, now, int(step))
                 for key, value in _numbers(self.name, metrics, True).items()]
        if batch:
            self.tracking._client().log_batch(self.run_id, metrics=batch)

    def register(self, weights_dir: str | Path, metrics: Mapping[str, Any], example: Any = None,
                 output: str = "score", serving: Serving | None = None) -> ModelVersionRef:
        """Log the final `metrics` and the weights, with an MLmodel: with `serving`, an MLflow pyfunc that
        selects contexts (serving/pyfunc.py: the request signature, the serving config, a real request as the
        input example); else a signature reading the columns of `example` (a small DataFrame of real inputs,
        also saved as the input example) and returning one number named `output`. End the run FINISHED;
        register the weights as a new version of the model with the run's tags and a description (what trained
        it, its final figures), tagged with the weights' content hash and that of every file logged (the MLmodel
        too), and point the candidate alias at it."""
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        tracking, client = self.tracking, self.tracking._client()
        weights_dir = Path(weights_dir)
        tracking._weights_files(weights_dir, tracking._secret_values())
        now = int(time.time() * 1000)
        figures = _numbers(self.name, metrics)
        metric_list = [Metric(key, value, now, 0) for key, value in figures.items()]
        for start in range(0, len(metric_list), MAX_METRICS_PER_BATCH):
            client.log_batch(self.run_id, metrics=metric_list[start:start + MAX_METRICS_PER_BATCH])
        weights = file_hashes(weights_dir)
        content_hash = files_hash(weights)  # the weights' directory_hash
        client.log_artifacts(self.run_id, str(weights_dir), tracking.weights_artifact_path)
        with tempfile.TemporaryDirectory() as folder:
            if example is not None or serving is not None:
                _write_model_metadata(Path(folder), self.run_id, tracking.weights_artifact_path, example, output,
                                      serving, content_hash)
                client.log_artifacts(self.run_id, folder, tracking.weights_artifact_path)
            version_hash = files_hash({**weights, **file_hashes(folder)})
        self.end("FINISHED")
        tracking._ensure_registered_model(self.name)
        version = client.create_model_version(self.name, f"{self.artifact_uri}/{tracking.weights_artifact_path}",
                                              run_id=self.run_id, tags=self.tags,
                                              description=version_description(self.tags, figures))
        client.set_model_version_tag(self.name, str(version.version), CONTENT_HASH_TAG, content_hash)
        client.set_model_version_tag(self.name, str(version.version), VERSION_HASH_TAG, version_hash)
        client.set_registered_model_alias(self.name, tracking.candidate_alias, str(version.version))
        return version_ref(version, (tracking.candidate_alias,))

    def end(self, status: str) -> None:
        self.tracking._client().set_terminated(self.run_id, status)
        self.ended = True

    def fail(self) -> None:
        """Ends the run FAILED once what it logged of the weights is removed: a failed training registers no
        version, and a copy cut short by a full disk must not stay, nor hold the space that recording the end
        needs. If the end cannot be recorded either, that is logged and the training's own error stands
        (`TrackingResource.end_orphaned_runs` ends the run later)."""
        from mlflow.store.artifact.artifact_repository_registry import (
            get_artifact_repository,
        )

        try:
            get_artifact_repository(self.artifact_uri).delete_artifacts(self.tracking.weights_artifact_path)
        except Exception as exc:  # nothing logged yet, or a store that cannot delete: the run's end matters more
            _LOG.debug("could not remove the weights logged by MLflow run %s: %s", self.run_id, exc)
        try:
            self.end("FAILED")
        except Exception as exc:
            _LOG.warning("MLflow run %s of %s could not be marked FAILED (%s: %s); the next training of %s does",
                         self.run_id, self.name, type(exc).__name__, str(exc).splitlines()[0], self.name)


@dataclass(frozen=True)
class Serving:
    """How a registered version serves as an MLflow pyfunc (serving/pyfunc.py): the registry method it runs and a
    real request as the input example ({query, candidates, budget_tokens | k})."""
    method: str
    example: Mapping[str, Any]


def _write_model_metadata(folder: Path, run_id: str, artifact_path: str, example, output: str,
                          serving: Serving | None = None, content_hash: str | None = None) -> None:
    """MLmodel and its input example in MLflow's pandas "split" layout, as `mlflow.models.Model
    .load_input_example` reads it: a pyfunc flavor with the serving signature (`serving`), else a signature
    of the example's columns in and one double `output` out. The pyfunc's model config holds every key a
    caller's `model_config` may set (MLflow drops any other: `covlab.serving.pyfunc_model_config`'s decisions
    and other models' folders) and the weights' `content_hash`, which the pyfunc verifies its files against."""
    import pandas as pd
    from mlflow.models import Model, ModelSignature, infer_signature
    from mlflow.pyfunc import add_to_model
    from mlflow.types import ColSpec, DataType, Schema

    model = Model(artifact_path=artifact_path, run_id=run_id)
    if serving is not None:
        example = pd.DataFrame([dict(serving.example)])
        model.signature = serving_signature()
        add_to_model(model, loader_module=SERVING_LOADER, data=".",
                     model_config={"method": serving.method, "content_hash": content_hash, "decisions": None,
                                   "models": {}})
    else:
        example = pd.DataFrame(example).reset_index(drop=True)
        model.signature = ModelSignature(inputs=infer_signature(example).inputs,
                                         outputs=Schema([ColSpec(DataType.double, output)]))
    (folder / INPUT_EXAMPLE_FILE).write_text(example.to_json(orient="split", index=False))
    model.saved_input_example_info = {"artifact_path": INPUT_EXAMPLE_FILE, "type": "dataframe",
                                      "pandas_orient": "split"}
    model.save(str(folder / MLMODEL_FILE))


def version_description(tags: Mapping[str, str], figures: Mapping[str, float]) -> str:
    """A model version's description on its MLflow page: the Dagster asset, partition and run that trained it
    (from the run's tags) and its final figures."""
    made = (f"Trained by the Dagster asset {tags.get('dagster.asset_key', '?')} for dataset "
            f"{tags.get('dagster.partition', '?')} in run {tags.get(DAGSTER_RUN_TAG, '?')}")
    if "git.commit" in tags:
        made += f" at commit {tags['git.commit'][:12]}"
    numbers = ", ".join(f"{key} {value:.4g}" for key, value in sorted(figures.items()))
    return f"{made}. Final figures: {numbers}." if numbers else f"{made}."


def _numbers(name: str, metrics: Mapping[str, Any], skip_none: bool = False) -> dict[str, float]:
    numbers = {}
    for key, value in metrics.items():
        if value is None and skip_none:
            continue
        try:
            numbers[key] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {key!r} of {name}: expected a number, got {value!r}") from None
    return numbers


def _flattened(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config as flat `outer.inner` parameters (MLflow parameters are flat; a nested secret key
    such as llm.api_key is then recognised by name)."""
    flat = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat.update(_flattened(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _refuse_secrets_in(files: list[Path], secrets: dict[str, str]) -> None:
    for file in files:
        if not secrets or file.stat().st_size == 0:
            continue
        with open(file, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as content:
            for name, value in secrets.items():
                if content.find(value.encode()) != -1:
                    raise ValueError(f"{file} contains the value of the environment variable {name}; "
                                     "refusing to log it to MLflow")
