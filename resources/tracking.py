"""Trained selectors as MLflow registered model versions (DESIGN.md "Conventions").

A training opens its MLflow run before it starts (`training_run`), so the run's start and duration are the
training's; the trainer logs each epoch's figures as metric steps while it runs, and a failure ends the run
as FAILED. The weights directory a model's `save_pretrained` wrote (safetensors, config, tokenizer files) is
logged as run artifacts, byte for byte, so it reloads with any batch size (not torch.export, which fixes the batch
size: ENVIRONMENT.md "MLflow 3.17"). The run's parameters, metrics and tags go with it; the version is
registered under a model name with the same tags and gets the alias `candidate`, which an evaluation may
promote to `champion`. Beside the weights goes an MLmodel file with the model's signature (what it reads,
what number it returns) and an input example, so the version page shows them and
`mlflow.models.get_model_info` reloads them; `download` leaves those two files out.

Every call goes through an MlflowClient with explicit tracking and registry URIs; no mlflow global
(tracking URI, active run) is read or changed. Nothing secret is logged: parameters and tags whose name
looks like a secret, or whose value contains the value of an environment variable whose name looks like a
secret, are redacted, and a weights directory holding such a value is refused.
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from dagster import ConfigurableResource
from pydantic import Field, PrivateAttr

from covlab.resources.results_store import ensure_sqlite_folder

# Parameter and tag names that hold secrets: llm.api_key, apiKey, db.password, hf_token, llm.token (not
# token_budget, max_tokens or tokenizer.pad_token, which this project logs).
SECRET_NAME_PATTERN = (r"(?i)(api_?key|secret|passw(or)?d|credential|(^|[.\-])token$"
                       r"|(access|auth|bearer|api|hf|refresh)[_\-]?token$)")
# Environment variables whose values are secrets: COVLAB_LLM_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY (not
# TOKENIZERS_PARALLELISM).
SECRET_ENV_PATTERN = r"(?i)(^|_)(api_?key|key|token|secret|password|passwd|credentials?)(_|$)"
REDACTED = "[redacted]"
# What `TrainingRun.register` writes beside the weights (MLflow's model metadata and input example).
MLMODEL_FILE, INPUT_EXAMPLE_FILE = "MLmodel", "input_example.json"
# The address `make mlflow-ui` serves: links to a version when the tracking URI is not an MLflow server.
LOCAL_MLFLOW_UI = "http://127.0.0.1:5000"


@dataclass(frozen=True)
class ModelVersionRef:
    """One registered model version; `uri` is what mlflow loaders and the asset metadata use."""

    name: str
    version: int
    uri: str
    run_id: str | None
    source: str
    tags: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    aliases: tuple[str, ...] = field(default=(), compare=False)


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
    candidate_alias: str = Field("candidate", description="alias given to every newly registered version")
    weights_artifact_path: str = Field("weights", description="run artifact folder holding the weights files")
    secret_name_pattern: str = Field(SECRET_NAME_PATTERN, description="regular expression for names of "
                                     "parameters and tags whose values are secrets (logged as redacted)")
    secret_env_pattern: str = Field(SECRET_ENV_PATTERN, description="regular expression for names of "
                                    "environment variables whose values must appear in no parameter, tag "
                                    "or logged file")
    min_secret_length: int = Field(8, description="environment values shorter than this are not treated as "
                                                  "secrets when searching values and files")
    ui_url: str | None = Field(None, description="MLflow UI address for links to model versions; None: the "
                                                 "tracking URI when it is an http(s) server, else "
                                                 f"{LOCAL_MLFLOW_UI} (make mlflow-ui)")

    _mlflow_client: Any = PrivateAttr(default=None)

    def log_model_version(self, name: str, weights_dir: Path, params: dict, metrics: dict,
                          tags: dict[str, str], example: Any = None, output: str = "score") -> ModelVersionRef:
        """Log `weights_dir` with params, metrics and tags as one MLflow run, register it as a new version
        of `name` carrying the same tags, and point the candidate alias at it (a model trained elsewhere; a
        training in this process uses `training_run`, whose run spans it)."""
        self._weights_files(Path(weights_dir), self._secret_values())  # refused before a run exists
        _numbers(name, metrics)
        with self.training_run(name, params, tags) as run:
            return run.register(weights_dir, metrics, example=example, output=output)

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
                training.end("FAILED")
            raise
        if not training.ended:
            training.end("FINISHED")

    def version_url(self, ref: ModelVersionRef) -> str:
        """The MLflow UI page of a model version (`ui_url`)."""
        from urllib.parse import quote

        base = self.ui_url or (self.tracking_uri if self.tracking_uri.startswith(("http://", "https://"))
                               else LOCAL_MLFLOW_UI)
        return f"{base.rstrip('/')}/#/models/{quote(ref.name, safe='')}/versions/{ref.version}"

    def version_for_alias(self, name: str, alias: str) -> ModelVersionRef | None:
        """The version `alias` points at, or None when the model or the alias does not exist."""
        aliases = self._aliases(name)
        if aliases is None or alias not in aliases:
            return None
        version = self._client().get_model_version(name, str(aliases[alias]))
        return _ref(version, _aliases_of(aliases, int(version.version)))

    def set_alias(self, name: str, alias: str, version: int) -> None:
        """Point `alias` (e.g. champion) at `version` of `name`, moving it from any other version."""
        self._client().set_registered_model_alias(name, alias, str(version))

    def versions(self, name: str) -> list[ModelVersionRef]:
        """Every version of `name` with its tags and aliases, oldest first; [] when it is not registered."""
        aliases = self._aliases(name)
        if aliases is None:
            return []
        client, found, token = self._client(), [], None
        while True:
            page = client.search_model_versions(f"name = '{name}'", page_token=token)
            found.extend(page)
            token = page.token
            if not token:
                break
        return sorted((_ref(v, _aliases_of(aliases, int(v.version))) for v in found), key=lambda r: r.version)

    def download(self, ref: ModelVersionRef, dst: Path | None = None) -> Path:
        """The version's weights directory, files byte-identical to those logged, at `dst` (absent or empty)
        or in a new temporary folder. Downloaded beside the target and renamed into place."""
        import mlflow.artifacts

        if dst is None:
            dst = Path(tempfile.mkdtemp(prefix=f"covlab-{ref.name}-v{ref.version}-")) / self.weights_artifact_path
        target = Path(dst)
        if target.exists() and any(target.iterdir()):
            raise FileExistsError(f"{target}: not empty; expected an absent or empty folder for the weights "
                                  f"of {ref.uri}")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as work:
            local = mlflow.artifacts.download_artifacts(artifact_uri=ref.source, dst_path=work,
                                                        tracking_uri=self.tracking_uri,
                                                        registry_uri=self._registry_uri())
            if target.exists():
                target.rmdir()
            for added in (MLMODEL_FILE, INPUT_EXAMPLE_FILE):  # MLflow's metadata, not the weights
                Path(local, added).unlink(missing_ok=True)
            os.replace(local, target)
        return target

    def log_metric(self, ref: ModelVersionRef, key: str, value: float) -> None:
        """Record a figure measured after training (e.g. the dev score an evaluation gave this version) on
        the version's run, where `metric` finds it."""
        if ref.run_id is None:
            raise KeyError(f"{ref.uri} has no MLflow run to log {key!r} on")
        self._client().log_metric(ref.run_id, key, float(value))

    def metric(self, ref: ModelVersionRef, key: str) -> float:
        """The last logged value of metric `key` of the run that produced `ref` (champion/candidate
        comparison); KeyError naming the logged metrics when it is absent."""
        if ref.run_id is None:
            raise KeyError(f"{ref.uri} has no MLflow run, so no metric {key!r}")
        logged = self._client().get_run(ref.run_id).data.metrics
        if key not in logged:
            raise KeyError(f"{ref.uri} (run {ref.run_id}) has no metric {key!r}; logged: {sorted(logged)}")
        return float(logged[key])

    def _weights_files(self, weights_dir: Path, secrets: dict[str, str]) -> list[Path]:
        files = sorted(p for p in weights_dir.rglob("*") if p.is_file()) if weights_dir.is_dir() else []
        if not files:
            raise FileNotFoundError(f"{weights_dir}: no files to log; expected the folder that "
                                    "save_pretrained wrote (safetensors, config, tokenizer files)")
        clashing = [f.name for f in files if f.parent == weights_dir and f.name in (MLMODEL_FILE, INPUT_EXAMPLE_FILE)]
        if clashing:
            raise ValueError(f"{weights_dir} holds {clashing}; those names are MLflow's model metadata, written "
                             "beside the weights at registration")
        _refuse_secrets_in(files, secrets)
        return files

    def _client(self):
        if self._mlflow_client is None:
            from mlflow import MlflowClient

            for uri in (self.tracking_uri, self._registry_uri()):
                ensure_sqlite_folder(uri)
            self._mlflow_client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self._registry_uri())
        return self._mlflow_client

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
            raise RuntimeError(f"MLflow experiment {self.experiment!r} at {self.tracking_uri} is deleted; "
                               "restore it (mlflow experiments restore) or configure another experiment")
        return experiment.experiment_id

    def _ensure_registered_model(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self._client().create_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise

    def _aliases(self, name: str) -> dict[str, int] | None:
        """alias -> version of a registered model; None when `name` is not registered."""
        from mlflow.exceptions import MlflowException

        try:
            model = self._client().get_registered_model(name)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        return {alias: int(version) for alias, version in model.aliases.items()}

    def _secret_values(self) -> dict[str, str]:
        """Environment variables whose name looks like a secret: name -> value."""
        return {name: value for name, value in os.environ.items()
                if re.search(self.secret_env_pattern, name) and len(value) >= self.min_secret_length}

    def _redacted(self, mapping: Mapping[str, Any], secrets: dict[str, str]) -> dict[str, str]:
        safe = {}
        for key, value in mapping.items():
            text = str(value)
            hides_secret = re.search(self.secret_name_pattern, key) or any(s in text for s in secrets.values())
            safe[key] = REDACTED if hides_secret else text
        return safe


class TrainingRun:
    """The MLflow run of one training while it runs (`TrackingResource.training_run`)."""

    def __init__(self, tracking: TrackingResource, name: str, run_id: str, artifact_uri: str,
                 tags: dict[str, str]):
        self.tracking, self.name, self.run_id, self.artifact_uri, self.tags = tracking, name, run_id, artifact_uri, tags
        self.ended = False

    def log_epoch(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Each of `metrics` (name -> number; None skipped) at `step` (the epoch), timestamped now: the
        curves of the run page."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, int(step)) for key, value in _numbers(self.name, metrics, True).items()]
        if batch:
            self.tracking._client().log_batch(self.run_id, metrics=batch)

    def register(self, weights_dir: str | Path, metrics: Mapping[str, Any], example: Any = None,
                 output: str = "score") -> ModelVersionRef:
        """Log the final `metrics` and the weights, with an MLmodel whose signature reads the columns of
        `example` (a small DataFrame of real inputs, also saved as the input example) and returns one
        number named `output`; end the run FINISHED; register the weights as a new version of the model
        with the run's tags and point the candidate alias at it."""
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        tracking, client = self.tracking, self.tracking._client()
        weights_dir = Path(weights_dir)
        tracking._weights_files(weights_dir, tracking._secret_values())
        now = int(time.time() * 1000)
        metric_list = [Metric(key, value, now, 0) for key, value in _numbers(self.name, metrics).items()]
        for start in range(0, len(metric_list), MAX_METRICS_PER_BATCH):
            client.log_batch(self.run_id, metrics=metric_list[start:start + MAX_METRICS_PER_BATCH])
        client.log_artifacts(self.run_id, str(weights_dir), tracking.weights_artifact_path)
        if example is not None:
            with tempfile.TemporaryDirectory() as folder:
                _write_model_metadata(Path(folder), self.run_id, tracking.weights_artifact_path, example, output)
                client.log_artifacts(self.run_id, folder, tracking.weights_artifact_path)
        self.end("FINISHED")
        tracking._ensure_registered_model(self.name)
        version = client.create_model_version(self.name, f"{self.artifact_uri}/{tracking.weights_artifact_path}",
                                              run_id=self.run_id, tags=self.tags)
        client.set_registered_model_alias(self.name, tracking.candidate_alias, str(version.version))
        return _ref(version, (tracking.candidate_alias,))

    def end(self, status: str) -> None:
        self.tracking._client().set_terminated(self.run_id, status)
        self.ended = True


def _write_model_metadata(folder: Path, run_id: str, artifact_path: str, example, output: str) -> None:
    """MLmodel (signature: the example's columns in, one double `output` out) and the example in MLflow's
    pandas "split" layout, as `mlflow.models.Model.load_input_example` reads it."""
    import pandas as pd
    from mlflow.models import Model, ModelSignature, infer_signature
    from mlflow.types import ColSpec, DataType, Schema

    example = pd.DataFrame(example).reset_index(drop=True)
    model = Model(artifact_path=artifact_path, run_id=run_id)
    model.signature = ModelSignature(inputs=infer_signature(example).inputs,
                                     outputs=Schema([ColSpec(DataType.double, output)]))
    (folder / INPUT_EXAMPLE_FILE).write_text(example.to_json(orient="split", index=False))
    model.saved_input_example_info = {"artifact_path": INPUT_EXAMPLE_FILE, "type": "dataframe",
                                      "pandas_orient": "split"}
    model.save(str(folder / MLMODEL_FILE))


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


def _aliases_of(aliases: dict[str, int], version: int) -> tuple[str, ...]:
    return tuple(sorted(alias for alias, target in aliases.items() if target == version))


def _ref(version, aliases: tuple[str, ...]) -> ModelVersionRef:
    return ModelVersionRef(name=version.name, version=int(version.version),
                           uri=f"models:/{version.name}/{version.version}", run_id=version.run_id or None,
                           source=version.source, tags=dict(version.tags), aliases=aliases)
