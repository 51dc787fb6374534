"""Where large binary artifacts (Lucene indexes, model weights) live: one folder per asset and version."""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field

from covlab.resources.io_manager import store_path


class ArtifactStore(ConfigurableResource):
    """A local folder of versioned artifact directories; a new version never overwrites an old one, so
    earlier materializations stay readable."""

    root: str = Field(description="root folder for artifact directories")

    def directory(self, asset: str, partition: str, version: str) -> Path:
        """`<root>/<asset>/<partition>/<version>`; each part must be a single path segment."""
        return store_path(self.root, asset, partition, version, what="artifact path part")
