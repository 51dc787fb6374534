"""Storage of asset values on a filesystem: tables as Parquet, small records as JSON.

Every write goes to a temporary file in the target directory and is renamed into place, so a failed
step never leaves a half-written artifact and never damages the previous materialization.

Beside each stored value a sidecar (`<partition>.parquet.written.json`) says which run and step wrote it
and the SHA-256 of its bytes; the materialization carries the same hash as `content_sha256`. A load whose
bytes do not have that hash (the file was rewritten or edited after its run wrote it) fails the loading
step, naming the file, both hashes and the writer run, unless `accept_modified` is set. Every load
records what it read — asset key, partition, the run that wrote it and the SHA-256 of the bytes read — with
the content version of the value read (`LOADED_VERSION`), and the step's materializations carry the records
of all its loads (`LOAD_RECORD` metadata). The lineage audit resolves each input of a materialization from
these records, never from Dagster's input-event pointer, which names the latest materialization of the
upstream key in any partition. The records ride on the materialization rather than being asset observations
of the inputs: one observation per load would bury each upstream asset's materializations in the UI.

An input with nothing stored for its partition fails the loading step ("materialize it first"), except an input
its asset declares optional (OPTIONAL_INPUT), which loads as None for the asset to judge.

The root is a local or shared (mounted) folder, or an fsspec URL of object storage (`s3://bucket/covlab`,
`gs://...`; the filesystem's package must be installed): every worker of a distributed deployment then
reads and writes the same store. On object storage a value is one object put (readers see the whole old
or the whole new object), the store's own atomic write; on a filesystem it is write-then-rename as above.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
from dagster import ConfigurableIOManager, InputContext, MetadataValue, OutputContext
from pydantic import Field

from covlab.models.versions import content_version
from covlab.resources.model_store import RECORD_TYPE, TRAINED_MODEL, TrainedModel

# Metadata key, on a materialization, of the load records of the step that made it: what it read, per input.
LOAD_RECORD = "covlab/loaded"
# Metadata key of the stored bytes' hash on every materialization this IO manager stores.
CONTENT_HASH = "content_sha256"
# Load-record entry: the content version (models/versions.py) of the value read, comparable with the data
# version of the materialization that wrote it and with a rebuilt value's (`covlab reproduce`).
LOADED_VERSION = "data_version"
SIDECAR_SUFFIX = ".written.json"
# Metadata key of an asset input (AssetIn metadata) that is optional: when nothing is stored for the upstream's
# partition it loads as None and the reading asset decides (a report leaves the method out under the untrained
# profile, resources/profile.py, and fails otherwise). Its value says why the input may be absent.
OPTIONAL_INPUT = "covlab/optional_input"
SUFFIXES = (".parquet", ".json")  # how tables and records are stored, in lookup order


def atomic_write(target: Path, write) -> None:
    """Call `write(tmp_path)`, then rename the file onto `target`; the temporary file is removed on error. An
    OSError that names no file (a write that found the disk full) is raised naming `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(tmp))
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, str(target)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def path_segment(value: str, what: str) -> str:
    """`value` if it can be one folder or file name under a store root, else ValueError: no separators,
    no `.`/`..`, nothing empty, no NUL, at most 255 bytes. Every store path is joined from such segments."""
    if (not isinstance(value, str) or value in ("", ".", "..") or "/" in value or "\\" in value or "\0" in value
            or len(value.encode("utf-8")) > 255):
        raise ValueError(f"{what} {value!r} cannot be a path segment; expected a non-empty name without '/', "
                         "'\\', NUL, '.' or '..' of at most 255 bytes")
    return value


def store_path(root: str | Path, *segments: str, what: str = "path segment") -> Path:
    """`root / segment / ...` after checking every segment with `path_segment`."""
    return Path(root).joinpath(*(path_segment(s, what) for s in segments))


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stored_file(folder: Path, partition: str) -> Path | None:
    """The file holding a partition's value in an asset's folder (`<partition>.parquet` or `.json`), or None."""
    return next((p for p in (folder / f"{partition}{suffix}" for suffix in SUFFIXES) if p.exists()), None)


def decode(path: Path, data: bytes):
    """The value stored in `path` from its bytes: a DataFrame from Parquet, else a JSON record, a trained
    model's as its TrainedModel (resources/tracking.py)."""
    if path.suffix == ".parquet":
        return pd.read_parquet(io.BytesIO(data))
    record = json.loads(data)
    if isinstance(record, dict) and record.get(RECORD_TYPE) == TRAINED_MODEL:
        return TrainedModel.from_record(record)
    return record


def read_stored(base_dir: str | Path, asset_key: str, partition: str | None):
    """The value stored for `asset_key` (user string, e.g. "selection_mmr") and `partition` under `base_dir`,
    or None when nothing is stored: what `covlab reproduce` compares outside of a run."""
    folder = store_path(base_dir, *asset_key.split("/"), what="asset key part")
    path = stored_file(folder, path_segment(partition or "__all__", "partition key"))
    return None if path is None else decode(path, path.read_bytes())


def is_object_store(root: str) -> bool:
    """Whether a store root is an fsspec URL of a non-local filesystem (`file://` and plain paths are local)."""
    return "://" in str(root) and not str(root).startswith("file://")


def local_root(root: str) -> str:
    """A local store root without its `file://` prefix."""
    return str(root).removeprefix("file://")


class ObjectStorePath:
    """A stored file on an fsspec filesystem, with the few Path methods the IO manager uses."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path

    def __truediv__(self, name: str) -> "ObjectStorePath":
        return ObjectStorePath(self.fs, f"{self.path.rstrip('/')}/{name}")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    def with_name(self, name: str) -> "ObjectStorePath":
        return ObjectStorePath(self.fs, f"{self.path.rsplit('/', 1)[0]}/{name}")

    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.path)

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def write_bytes(self, data: bytes) -> None:
        """One object put: the object store's atomic write (no temporary object, no rename)."""
        self.fs.pipe_file(self.path, data)

    def __str__(self) -> str:
        return self.fs.unstrip_protocol(self.path)


class StoredValueModified(RuntimeError):
    """A stored value's bytes differ from what the run that wrote it recorded."""


class StepLoads:
    """The load records of the step running in this process, from its input loads to its outputs.

    A step loads all its inputs before its compute function runs and stores its outputs after, in one process:
    the multiprocess executor gives each step a process of its own, the in-process executor runs steps one at
    a time. So the records of the step now running are the only ones needed; a load by another op starts
    afresh, and an output of an op that loaded nothing here gets none."""

    def __init__(self):
        self._op: str | None = None
        self._records: dict[str, dict] = {}

    def add(self, op: str, record: dict) -> None:
        if op != self._op:
            self._op, self._records = op, {}
        self._records[record["asset_key"]] = record

    def of(self, op: str) -> list[dict]:
        return [self._records[key] for key in sorted(self._records)] if op == self._op else []


STEP_LOADS = StepLoads()


class LocalTableIOManager(ConfigurableIOManager):
    """DataFrames -> `<base>/<asset key>/<partition>.parquet`; dicts, lists and trained models (their records)
    -> `.json` beside them."""

    base_dir: str = Field(description="root of stored asset values: a local or shared folder, or an fsspec URL of "
                                      "object storage (s3://bucket/prefix, gs://..., file:///shared/path)")
    accept_modified: bool = Field(False, description="read a stored value whose bytes differ from the SHA-256 its "
                                                     "writer recorded (changed after it was written) with a warning, "
                                                     "instead of failing the step; its load record says "
                                                     "`modified: true`")

    def _folder(self, context: InputContext | OutputContext) -> tuple[Path | ObjectStorePath, str]:
        partition = context.asset_partition_key if context.has_asset_partitions else "__all__"
        if is_object_store(self.base_dir):
            import fsspec

            fs, root = fsspec.core.url_to_fs(self.base_dir)
            folder = ObjectStorePath(fs, root)
            for part in context.asset_key.path:
                folder = folder / path_segment(part, "asset key part")
            return folder, path_segment(partition, "partition key")
        return store_path(local_root(self.base_dir), *context.asset_key.path, what="asset key part"), \
            path_segment(partition, "partition key")

    @staticmethod
    def _write(path: Path | ObjectStorePath, data: bytes) -> None:
        if isinstance(path, ObjectStorePath):
            path.write_bytes(data)
        else:
            atomic_write(path, lambda tmp: tmp.write_bytes(data))

    def handle_output(self, context: OutputContext, obj: Any) -> None:
        if obj is None:
            return
        folder, partition = self._folder(context)
        if isinstance(obj, pd.DataFrame):
            path = folder / f"{partition}.parquet"
            buffer = io.BytesIO()
            obj.to_parquet(buffer, index=False)
            data = buffer.getvalue()
        elif isinstance(obj, (dict, list, TrainedModel)):
            path = folder / f"{partition}.json"
            record = obj.to_record() if isinstance(obj, TrainedModel) else obj
            data = json.dumps(record, indent=2, sort_keys=True, default=str).encode("utf-8")
        else:
            raise TypeError(f"{context.asset_key.to_user_string()}: cannot store a {type(obj).__name__}; "
                            "expected a DataFrame, dict, list or TrainedModel")
        digest = sha256_hex(data)
        self._write(path, data)
        written = {"asset_key": context.asset_key.to_user_string(), "partition": partition,
                   "run_id": context.run_id, "step_key": context.step_key, CONTENT_HASH: digest}
        self._write(path.with_name(path.name + SIDECAR_SUFFIX),
                    json.dumps(written, indent=2, sort_keys=True).encode("utf-8"))
        loads = STEP_LOADS.of(context.op_def.name)
        context.add_output_metadata({"stored_at": str(path), CONTENT_HASH: digest,
                                     **({LOAD_RECORD: MetadataValue.json(loads)} if loads else {})})

    def load_input(self, context: InputContext) -> Any:
        folder, partition = self._folder(context)
        path = stored_file(folder, partition)
        if path is None and (context.definition_metadata or {}).get(OPTIONAL_INPUT):
            context.log.info(f"{context.asset_key.to_user_string()} partition {partition!r}: nothing stored; an "
                             f"optional input ({context.definition_metadata[OPTIONAL_INPUT]}), read as None")
            return None
        if path is None:
            raise FileNotFoundError(f"{context.asset_key.to_user_string()} partition {partition!r}: nothing "
                                    f"stored at {folder / partition}.parquet or .json; materialize it first")
        data = path.read_bytes()
        sidecar = path.with_name(path.name + SIDECAR_SUFFIX)
        written = json.loads(sidecar.read_text()) if sidecar.exists() else {}
        digest = sha256_hex(data)
        modified = CONTENT_HASH in written and written[CONTENT_HASH] != digest
        if modified:
            asset = context.asset_key.to_user_string()
            problem = (f"{asset} partition {partition!r}: {path} was changed after run {written.get('run_id')} (step "
                       f"{written.get('step_key')}) wrote it: its bytes have SHA-256 {digest}, the writer recorded "
                       f"{written[CONTENT_HASH]}")
            if not self.accept_modified:
                raise StoredValueModified(f"{problem}; re-materialize {asset} for partition {partition!r}, or set "
                                          "the IO manager's accept_modified to read it anyway")
            context.log.warning(f"{problem}; read anyway (accept_modified)")
        value = decode(path, data)
        STEP_LOADS.add(context.op_def.name, {
            "asset_key": context.asset_key.to_user_string(),
            "partition": partition if context.has_asset_partitions else None, "written_by_run": written.get("run_id"),
            CONTENT_HASH: digest, LOADED_VERSION: content_version(value), "path": str(path),
            **({"modified": True} if modified else {})})
        return value
