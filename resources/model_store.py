"""Reading the MLflow model registry, without Dagster: the registered versions of covlab's trained selectors,
their aliases and figures, and their weights downloaded and verified against the content hash recorded at
registration. The pipeline's TrackingResource (resources/tracking.py) and the serving path (serving/) read the
registry through `ModelStore`, and a trained asset's value is a `TrainedModel` around its `RegisteredModel`.

Every call goes through an MlflowClient with explicit tracking and registry URIs; no mlflow global is read or
changed. MLflow creates and migrates a SQLite store on first use without a lock between processes, so that
first use holds a file lock beside each SQLite database. Under that lock a SQLite store opened at another path
than before (a copied or moved home) first has its absolute artifact locations follow it
(resources/store_location.py), so that a copy never writes into, nor reads from, its original.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from covlab.models.adoption import ModelAdoption
from covlab.models.replay import RecordedDecisions
from covlab.models.selectors import BUDGET_UNITS
from covlab.models.versions import directory_hash, file_hashes, files_hash
from covlab.resources.sqlite import ensure_sqlite_folder, sqlite_file
from covlab.resources.store_location import follow_moved_store
from covlab.resources.tracking_server import (call_redacted, check_reachable, opening, redacting,
                                            uri_secrets)

# Tag of every registered version: the weights' directory_hash, which `download` verifies, and which a trained
# asset's value, the lineage audit and `covlab reproduce` record.
CONTENT_HASH_TAG = "covlab.content_hash"
# Tag of a version registered since covlab hashes every file of it: the directory_hash of the version's files as
# logged, the weights and MLflow's metadata beside them (MLMODEL_FILE, which names the code that
# `mlflow.pyfunc.load_model` imports, and the input example), all but the note MLflow adds later (LOAD_NOTE);
# `download` verifies it before keeping anything.
VERSION_HASH_TAG = "covlab.version_hash"
# Version tags the serving path reads: the figure that decided the version's promotion (model_promotions writes
# it: {report, results_store_report_id, dataset, method, metric, split, value}), and, on a version whose output
# the selections read (TrainedSelector.records_decisions), per selection method and budget unit what each budget
# decided (the selection assets write them: `decisions_tag`, models/replay.py's record).
PROMOTED_BY_TAG = "covlab.promoted_by"
SELECTION_TAG_PREFIX = "covlab.selection."
# Tags of every version a trained asset registers: its value's record (TrainedModel.to_record: the figures its
# gate reads, its settings and protocol), which a dataset adopting the version reads back; and, on a version
# adopted from another dataset (models/adoption.py), the dataset it was trained on and the version it is.
TRAINED_VALUE_TAG = "covlab.trained_value"
TRAINED_ON_TAG = "covlab.trained_on"
ADOPTED_FROM_TAG = "covlab.adopted_from"
# A registered version serves as an MLflow pyfunc through this loader module (serving/pyfunc.py); a request's
# columns are the signature's inputs, an answer's its outputs (`serving_signature`).
SERVING_LOADER = "covlab.serving.pyfunc"
REQUEST_COLUMNS = ("query", "candidates", "budget_tokens", "k")
ANSWER_COLUMNS = ("ids", "tokens", "selection")
# Tag of a version that carries a folder beside its weights, as a run artifact of its run (`ModelStore.attach`):
# the prefix, then the folder's artifact path; the value is the folder's directory_hash, which
# `download_attached` verifies.
ATTACHED_TAG_PREFIX = "covlab.attached."
# The alias every newly registered version takes (TrackingResource.candidate_alias's default): the newest version.
CANDIDATE_ALIAS = "candidate"
# Key of a registered model's asset value (assets/model_registry.py) holding that hash, and the metadata entry
# of a trained asset that records its local weights folder ({"path": ..., WEIGHTS_HASH: ...}).
WEIGHTS_HASH, WEIGHTS_METADATA = "content_hash", "weights"
# What `TrainingRun.register` writes beside the weights (MLflow's model metadata and input example).
MLMODEL_FILE, INPUT_EXAMPLE_FILE = "MLmodel", "input_example.json"
# The registered-model note (name and version) MLflow's pyfunc loader writes into the folder it loads
# (`mlflow.pyfunc.load_model("models:/...")`): of a local artifact store, the version's own folder. Data that
# MLflow reads, never code; not part of the version's hash, which it would change after registration.
LOAD_NOTE = "registered_model_meta"
# What MLflow itself writes beside a version's weights: MLMODEL_FILE, INPUT_EXAMPLE_FILE and LOAD_NOTE. None of it
# is weights.
MLFLOW_FILES = (MLMODEL_FILE, INPUT_EXAMPLE_FILE, LOAD_NOTE)


class WeightsChanged(RuntimeError):
    """A registered model's weights are not the bytes registered: their content hash differs from the recorded one."""


def weights_change(path: str | Path, content_hash: str) -> str | None:
    """Why the weights folder at `path` is not the one registered with `content_hash` (its `directory_hash`
    differs); None when it is, or when the folder is absent (a load downloads it again, verified)."""
    if not Path(path).is_dir():
        return None
    found = directory_hash(path)
    if found == content_hash:
        return None
    return f"the weights at {path} have content hash {found}, not the {content_hash} recorded at registration"


def decisions_tag(method: str, unit: str) -> str:
    """The version tag of what `method`'s selections at budgets of `unit` ("k", "tokens") decided on this
    version's output; one tag per unit, so that the k and the token selections record theirs independently."""
    return f"{SELECTION_TAG_PREFIX}{method}.{unit}"


def recorded_decisions(ref: ModelVersionRef, method: str) -> RecordedDecisions:
    """What `method`'s selections decided on `ref`'s output, k and token budgets together (empty: none)."""
    found = RecordedDecisions({})
    for unit in BUDGET_UNITS:
        found = found.merged(RecordedDecisions.from_json(ref.tags.get(decisions_tag(method, unit))).of_unit(unit))
    return found


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


@dataclass(frozen=True)
class RegisteredModel:
    """A trained selector's registered MLflow version and the local copy of its files, as a trained asset's
    value names it: `content_hash` is the files' directory_hash (models/versions.py), what the value's data
    version stands for."""
    name: str
    version: int
    uri: str
    mlflow_run_id: str
    source: str
    path: str
    content_hash: str

    def ref(self) -> ModelVersionRef:
        return ModelVersionRef(name=self.name, version=int(self.version), uri=self.uri, run_id=self.mlflow_run_id,
                               source=self.source)


MODEL_FIELDS = tuple(f.name for f in fields(RegisteredModel))
# The record key that marks a stored JSON record as a TrainedModel (resources/io_manager.py reads it back as one),
# and a trained value's other keys beside the model's fields and its figures.
RECORD_TYPE, TRAINED_MODEL = "record_type", "trained_model"
TRAINED_MODEL_KEYS = (RECORD_TYPE, "settings", "protocol", "adoption")


@dataclass(frozen=True)
class TrainedModel:
    """The value of a trained-selector asset: its registered model, the figures its training measured on
    held-out data (what its gate and its promotion read: `figure`), the settings it was trained with and the
    evaluation protocol it was trained under; `adoption` when it was not trained for this dataset but adopted from
    another one (models/adoption.py). Stored as one flat JSON record (`to_record`: the model's fields beside the
    figures), so that its content version leaves out where the model lives (models/versions.py)."""
    model: RegisteredModel
    figures: Mapping[str, float] = field(default_factory=dict)
    settings: Mapping[str, Any] = field(default_factory=dict)
    protocol: str = "split"
    adoption: ModelAdoption | None = None

    @property
    def trained_on(self) -> str | None:
        """The dataset an adopted model was trained on; None for one trained on the dataset it serves."""
        return self.adoption.trained_on if self.adoption else None

    def figure(self, name: str) -> float:
        """A figure the training recorded; a KeyError saying to re-materialize a value stored before it did."""
        if name not in self.figures:
            raise KeyError(f"{self.model.name} v{self.model.version} recorded no {name!r} (it records "
                           f"{sorted(self.figures)}): it was stored before its asset recorded that figure; "
                           "re-materialize it")
        return float(self.figures[name])

    def to_record(self) -> dict:
        return {RECORD_TYPE: TRAINED_MODEL, **asdict(self.model), **self.figures, "settings": dict(self.settings),
                "protocol": self.protocol, **({"adoption": self.adoption.to_record()} if self.adoption else {})}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "TrainedModel":
        """The value `to_record` wrote; a ValueError naming the fields a record lacks."""
        missing = [name for name in MODEL_FIELDS if name not in record]
        if missing:
            raise ValueError(f"not a trained model record: missing {missing} (has {sorted(record)})")
        figures = {k: v for k, v in record.items() if k not in MODEL_FIELDS and k not in TRAINED_MODEL_KEYS}
        adoption = record.get("adoption")
        return cls(RegisteredModel(**{name: record[name] for name in MODEL_FIELDS}), figures,
                   dict(record.get("settings") or {}), str(record.get("protocol") or "split"),
                   ModelAdoption.from_record(adoption) if adoption else None)


class ModelStore:
    """The model registry at `tracking_uri` (and `registry_uri`, default the same): versions, aliases, run
    metrics, verified downloads. The client and its stores open on first use."""

    def __init__(self, tracking_uri: str, registry_uri: str | None = None, lock_timeout_s: float = 300.0):
        self.tracking_uri, self.registry_uri = tracking_uri, registry_uri or tracking_uri
        self.lock_timeout_s = lock_timeout_s
        self._mlflow_client = None

    def client(self):
        """The MlflowClient, its stores opened on first call. MLflow creates and migrates a SQLite database
        on first use without a lock between processes (several at once leave it half-migrated), so that
        first use holds a file lock beside each SQLite database."""
        if self._mlflow_client is None:
            from filelock import FileLock
            from mlflow import MlflowClient

            uris = (self.tracking_uri, self.registry_uri)
            secrets = uri_secrets(*uris)  # every error of the client is redacted (resources/tracking_server.py)
            for uri in uris:
                ensure_sqlite_folder(uri)
                check_reachable(uri)  # a server that does not answer fails in seconds, not after MLflow's retries
            with ExitStack() as locks:
                for database in sorted({sqlite_file(uri) for uri in uris} - {None}):
                    locks.enter_context(FileLock(f"{database}.lock", timeout=self.lock_timeout_s))
                client = redacting(opening(self.tracking_uri, secrets, MlflowClient, tracking_uri=self.tracking_uri,
                                           registry_uri=self.registry_uri), secrets)
                # opens (creates, migrates) the tracking store, and the registry store
                opening(self.tracking_uri, secrets, client.search_experiments, max_results=1)
                opening(self.registry_uri, secrets, client.search_registered_models, max_results=1)
                for database in sorted({sqlite_file(uri) for uri in uris} - {None}):
                    follow_moved_store(database)  # a copied or moved home: its locations follow it
            self._mlflow_client = client
        return self._mlflow_client

    def aliases(self, name: str) -> dict[str, int] | None:
        """alias -> version of a registered model; None when `name` is not registered."""
        from mlflow.exceptions import MlflowException

        try:
            model = self.client().get_registered_model(name)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        return {alias: int(version) for alias, version in model.aliases.items()}

    def version_for_alias(self, name: str, alias: str) -> ModelVersionRef | None:
        """The version `alias` points at, or None when the model or the alias does not exist."""
        aliases = self.aliases(name)
        if aliases is None or alias not in aliases:
            return None
        version = self.client().get_model_version(name, str(aliases[alias]))
        return version_ref(version, aliases_of(aliases, int(version.version)))

    def version(self, name: str, number: int) -> ModelVersionRef | None:
        """Version `number` of `name`, or None when the model or that version does not exist."""
        from mlflow.exceptions import MlflowException

        aliases = self.aliases(name)
        try:
            version = self.client().get_model_version(name, str(number)) if aliases is not None else None
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            version = None
        return None if version is None else version_ref(version, aliases_of(aliases, int(version.version)))

    def registered(self, like: str) -> list[str]:
        """The registered model names matching SQL LIKE pattern `like` (e.g. covlab.%.mcompass_student), sorted."""
        client, found, token = self.client(), [], None
        while True:
            page = client.search_registered_models(f"name LIKE '{like}'", page_token=token)
            found.extend(model.name for model in page)
            token = page.token
            if not token:
                break
        return sorted(found)

    def versions(self, name: str) -> list[ModelVersionRef]:
        """Every version of `name` with its tags and aliases, oldest first; [] when it is not registered."""
        aliases = self.aliases(name)
        if aliases is None:
            return []
        client, found, token = self.client(), [], None
        while True:
            page = client.search_model_versions(f"name = '{name}'", page_token=token)
            found.extend(page)
            token = page.token
            if not token:
                break
        return sorted((version_ref(v, aliases_of(aliases, int(v.version))) for v in found), key=lambda r: r.version)

    def download(self, ref: ModelVersionRef, dst: Path | None = None, content_hash: str | None = None,
                 artifact_path: str = "weights") -> Path:
        """The version's weights directory, files byte-identical to those logged, at `dst` (absent or empty)
        or in a new temporary folder. Downloaded beside the target, verified as a whole against the version's
        VERSION_HASH_TAG (when it has one: MLflow's metadata included), its weights against `content_hash`
        (default: the version's CONTENT_HASH_TAG, when it has one), and only then renamed into place: files that
        differ raise WeightsChanged naming both hashes and are not kept."""
        return self._verified_download(ref, ref.source, "weights", dst, artifact_path,
                                       content_hash or ref.tags.get(CONTENT_HASH_TAG), ref.tags.get(VERSION_HASH_TAG))

    def changed_files(self, ref: ModelVersionRef, local: str | Path) -> list[str]:
        """The files of `local`, a copy of the version's weights, that are not the registered ones, one line each
        ("<path> (changed)", "(added)", "(missing)"), by their hashes against a fresh verified `download` into a
        temporary folder; empty: the same files."""
        with tempfile.TemporaryDirectory(prefix=f"covlab-{ref.name}-v{ref.version}-") as folder:
            registered = file_hashes(self.download(ref, Path(folder) / "weights"))
        found = file_hashes(local)
        return ([f"{path} (changed)" for path in sorted(found.keys() & registered.keys())
                 if found[path] != registered[path]]
                + [f"{path} (added)" for path in sorted(found.keys() - registered.keys())]
                + [f"{path} (missing)" for path in sorted(registered.keys() - found.keys())])

    def attach(self, ref: ModelVersionRef, folder: str | Path, artifact_path: str) -> str:
        """Log `folder` as run artifact `artifact_path` of the version's run, beside its weights (which keep their
        content hash), and tag the version with the folder's directory_hash under ATTACHED_TAG_PREFIX; returns
        that hash, which `download_attached` verifies."""
        if ref.run_id is None:
            raise KeyError(f"{ref.uri} has no MLflow run to attach {artifact_path!r} to")
        digest = directory_hash(folder)
        client = self.client()
        client.log_artifacts(ref.run_id, str(folder), artifact_path)
        client.set_model_version_tag(ref.name, str(ref.version), ATTACHED_TAG_PREFIX + artifact_path, digest)
        return digest

    def download_attached(self, ref: ModelVersionRef, artifact_path: str, dst: Path | None = None) -> Path:
        """The folder `attach` logged beside the version's weights, verified against the hash its tag records
        and downloaded as `download` downloads the weights; a KeyError when the version carries none."""
        digest = ref.tags.get(ATTACHED_TAG_PREFIX + artifact_path)
        if digest is None or ref.run_id is None:
            raise KeyError(f"{ref.uri} carries no {artifact_path!r} folder beside its weights")
        return self._verified_download(ref, f"runs:/{ref.run_id}/{artifact_path}", artifact_path, dst, artifact_path,
                                       digest)

    def _verified_download(self, ref: ModelVersionRef, source: str, what: str, dst: Path | None, name: str,
                           expected: str | None, version_hash: str | None = None) -> Path:
        import mlflow.artifacts

        if dst is None:
            dst = Path(tempfile.mkdtemp(prefix=f"covlab-{ref.name}-v{ref.version}-")) / name
        target = Path(dst)
        if target.exists() and any(target.iterdir()):
            raise FileExistsError(f"{target}: not empty; expected an absent or empty folder for the {what} "
                                  f"of {ref.uri}")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as work:
            local = call_redacted(uri_secrets(self.tracking_uri, self.registry_uri),
                                  mlflow.artifacts.download_artifacts, artifact_uri=source, dst_path=work,
                                  tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)
            if version_hash is not None:
                found = files_hash({path: digest for path, digest in file_hashes(local).items() if path != LOAD_NOTE})
                if found != version_hash:
                    raise WeightsChanged(f"{ref.uri}: the files downloaded from {source} ({what} and MLflow's "
                                         f"{MLMODEL_FILE} with them) have content hash {found}, not the "
                                         f"{version_hash} recorded at registration; the MLflow artifacts were "
                                         "changed after registration, so they were not kept")
            for added in MLFLOW_FILES:  # MLflow's metadata, not the weights
                Path(local, added).unlink(missing_ok=True)
            if expected is not None and directory_hash(local) != expected:
                raise WeightsChanged(f"{ref.uri}: the {what} downloaded from {source} have content hash "
                                 f"{directory_hash(local)}, not the {expected} recorded at registration; the "
                                 "MLflow artifacts were changed after registration, so they were not kept")
            _put_in_place(local, target, expected)
        return target

    def metric(self, ref: ModelVersionRef, key: str) -> float:
        """The last logged value of metric `key` of the run that produced `ref` (champion/candidate
        comparison); KeyError naming the logged metrics when it is absent."""
        if ref.run_id is None:
            raise KeyError(f"{ref.uri} has no MLflow run, so no metric {key!r}")
        logged = self.client().get_run(ref.run_id).data.metrics
        if key not in logged:
            raise KeyError(f"{ref.uri} (run {ref.run_id}) has no metric {key!r}; logged: {sorted(logged)}")
        return float(logged[key])


def aliases_of(aliases: dict[str, int], version: int) -> tuple[str, ...]:
    return tuple(sorted(alias for alias, target in aliases.items() if target == version))


def version_ref(version, aliases: tuple[str, ...]) -> ModelVersionRef:
    return ModelVersionRef(name=version.name, version=int(version.version),
                           uri=f"models:/{version.name}/{version.version}", run_id=version.run_id or None,
                           source=version.source, tags=dict(version.tags), aliases=aliases)


def serving_signature():
    """The model signature of every serving version: a request (query, candidates, budget_tokens or k) in, the
    answer (chosen ids, their tokens, the whole selection as JSON) out, the blend weight an optional parameter."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, DataType, ParamSchema, ParamSpec, Schema

    inputs = Schema([ColSpec(DataType.string, "query"), ColSpec(Array(DataType.string), "candidates"),
                     ColSpec(DataType.long, "budget_tokens", required=False),
                     ColSpec(DataType.long, "k", required=False)])
    outputs = Schema([ColSpec(Array(DataType.string), "ids"), ColSpec(DataType.long, "tokens"),
                      ColSpec(DataType.string, "selection")])
    return ModelSignature(inputs=inputs, outputs=outputs,
                          params=ParamSchema([ParamSpec("blend_weight", DataType.double, None)]))


def _put_in_place(local: str | Path, target: Path, expected: str | None) -> None:
    """Rename the verified download `local` to `target` (absent, or the empty folder the caller named). Two
    processes may download the same version into one home at once (two services starting): when the other one's
    copy took `target` first and has the same content hash, it is kept and this download is dropped."""
    try:
        if target.exists():
            target.rmdir()
        os.replace(local, target)
    except OSError:
        if expected is None or not target.is_dir() or directory_hash(target) != expected:
            raise
