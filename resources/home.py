"""Where covlab keeps its state: everything lives under COVLAB_HOME (default `./.covlab`): the registered datasets
(`datasets.json`), stored tables, artifacts, the MLflow store, the results store and the Dagster instance
(orchestration/instance.py). Read by the pipeline and by the serving path alike, so nothing here imports Dagster
at module import time (serving/ runs without it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from covlab.resources.datasets import DatasetRegistry


def covlab_home() -> Path:
    return Path(os.environ.get("COVLAB_HOME") or Path.cwd() / ".covlab").resolve()


def mlflow_tracking_uri(home: Path | None = None) -> str:
    """Where covlab's MLflow tracking and registry store is: COVLAB_MLFLOW_TRACKING_URI, else the embedded
    SQLite store `<home>/mlflow/mlflow.db` (the one `make mlflow-ui` serves)."""
    return os.environ.get("COVLAB_MLFLOW_TRACKING_URI") or f"sqlite:///{home or covlab_home()}/mlflow/mlflow.db"


def dataset_registry(home: Path | None = None) -> DatasetRegistry:
    """The registered datasets of `home` (default COVLAB_HOME): `<home>/datasets.json`. The registry is a Dagster
    resource, imported here on first call so that the serving path's use of this module imports no Dagster."""
    from covlab.resources.datasets import DatasetRegistry

    return DatasetRegistry(registry_path=str((home or covlab_home()) / "datasets.json"))
