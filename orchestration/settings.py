"""Where covlab keeps its state: everything lives under COVLAB_HOME (default `./.covlab`)."""

from __future__ import annotations

import os
from pathlib import Path

DAGSTER_YAML = """\
telemetry:
  enabled: false
# GPU steps carry pool "gpu" (resources/device.py: gpu_step); one at a time unless raised here.
concurrency:
  pools:
    default_limit: 1
"""


def covlab_home() -> Path:
    return Path(os.environ.get("COVLAB_HOME") or Path.cwd() / ".covlab").resolve()


def dagster_home() -> Path:
    """DAGSTER_HOME if set, else `<COVLAB_HOME>/dagster`; created with a dagster.yaml (telemetry off,
    SQLite storage, the default) when missing."""
    home = Path(os.environ.get("DAGSTER_HOME") or covlab_home() / "dagster").resolve()
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        (home / "dagster.yaml").write_text(DAGSTER_YAML)
    os.environ["DAGSTER_HOME"] = str(home)
    return home
