"""Where large binary artifacts (Lucene indexes, model weights) live: one folder per asset and version."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from dagster import ConfigurableResource, DagsterInstance, DagsterRunStatus, RunsFilter
from pydantic import Field

from covlab.resources.io_manager import is_object_store, local_root, store_path

# A version folder named by a Dagster run id (a report's CSVs: `directory(report, partition, context.run_id)`).
RUN_ID_FOLDER = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
UNSUCCESSFUL = (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)


class ArtifactStore(ConfigurableResource):
    """A folder of versioned artifact directories; a new version never overwrites an old one, so
    earlier materializations stay readable. Beyond one machine it is a folder every worker mounts (NFS, a
    ReadWriteMany volume, a bucket mounted with s3fs/gcsfuse): Lucene and torch write these directories
    through POSIX paths, so an object-store URL is refused here (tables take one: the IO manager)."""

    root: str = Field(description="root folder for artifact directories: a local or shared (mounted) path, "
                                  "or file:///path")

    def directory(self, asset: str, partition: str, version: str) -> Path:
        """`<root>/<asset>/<partition>/<version>`; each part must be a single path segment."""
        if is_object_store(self.root):
            raise ValueError(f"artifacts root {self.root!r}: artifact directories (Lucene indexes, model weights) "
                             "are written through a filesystem path; mount the bucket on every worker (s3fs, "
                             "gcsfuse, a shared volume) and give its mount path, or file:///mount/path")
        return store_path(local_root(self.root), asset, partition, version, what="artifact path part")

    def discard_failed_runs(self, instance: DagsterInstance, run_ids: Iterable[str] | None = None) -> list[Path]:
        """Remove the version folders named by a run id (`<root>/<asset>/<partition>/<run_id>`, a report's CSV
        folder) whose run ended without success, failed or canceled: a report killed or failing between its
        files leaves no half-written folder behind. Only the folders of `run_ids` when given. Folders of runs in
        progress, succeeded or unknown to `instance` are kept. Returns the removed folders."""
        if is_object_store(self.root) or not Path(local_root(self.root)).is_dir():
            return []
        wanted = None if run_ids is None else set(run_ids)
        folders: dict[str, list[Path]] = {}
        for folder in Path(local_root(self.root)).glob("*/*/*"):
            if folder.is_dir() and RUN_ID_FOLDER.fullmatch(folder.name) and (wanted is None or folder.name in wanted):
                folders.setdefault(folder.name, []).append(folder)
        if not folders:
            return []
        ended = {record.dagster_run.run_id for record in instance.get_run_records(
            RunsFilter(run_ids=sorted(folders), statuses=list(UNSUCCESSFUL)))}
        removed = [folder for run_id in sorted(ended) for folder in folders[run_id]]
        for folder in removed:
            shutil.rmtree(folder, ignore_errors=True)
        return removed

def write_directory(target: Path, write: Callable[[Path], None], replace: bool = False) -> Path:
    """`target` filled by `write(folder)`: built in a temporary sibling folder and renamed into place whole, so a
    reader never sees part of it. A content-addressed `target` that exists already holds the same content and is
    kept as it is (also when another process renamed its copy there first), unless `replace` (its content is
    known to be damaged), when the new copy takes its place."""
    target = Path(target)
    if target.exists() and not replace:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as work:
        built = Path(work) / "built"
        built.mkdir()
        write(built)
        if replace and target.exists():
            os.replace(target, Path(work) / "replaced")  # removed with the temporary folder
        try:
            os.replace(built, target)
        except OSError:
            if not target.is_dir():  # else another process renamed the same content there first
                raise
    return target
