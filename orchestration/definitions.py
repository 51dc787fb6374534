"""The Dagster code location: every asset, check, job and resource of covlab."""

from __future__ import annotations

from dagster import AssetSelection, Definitions, define_asset_job

from covlab.assets.ingest import dataset_tables
from covlab.assets.partitions import DATASETS
from covlab.assets.pools import bm25_index, bm25_pools
from covlab.orchestration.settings import covlab_home
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.datasets import DatasetRegistry
from covlab.resources.io_manager import LocalTableIOManager
from covlab.resources.lucene import LuceneResource

ASSETS = [dataset_tables, bm25_index, bm25_pools]

build_all = define_asset_job("build_all", selection=AssetSelection.all(), partitions_def=DATASETS,
                             description="Every asset of one dataset partition (what `make demo` runs on demo).")


def default_resources(home=None) -> dict:
    """Embedded defaults: everything under COVLAB_HOME on the local filesystem."""
    home = home or covlab_home()
    return {
        "datasets": DatasetRegistry(registry_path=str(home / "datasets.json")),
        "lucene": LuceneResource(log_dir=str(home / "logs")),
        "artifacts": ArtifactStore(root=str(home / "artifacts")),
        "io_manager": LocalTableIOManager(base_dir=str(home / "storage")),
    }


defs = Definitions(assets=ASSETS, jobs=[build_all], resources=default_resources())
