"""Where large binary artifacts (Lucene indexes, model weights) live: one folder per asset and version."""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field

from covlab.resources.io_manager import is_object_store, local_root, store_path


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
