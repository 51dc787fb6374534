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
# A run that dies keeps its pool slots. For runs launched from the UI, a schedule or a sensor, the daemon
# (`dagster dev`) looks every poll_interval_seconds and frees them free_slots_after_run_end_seconds after the
# run is marked ended; `covlab` CLI runs are freed by `covlab slots free`, which every `covlab materialize`
# and `covlab demo` runs first.
run_monitoring:
  enabled: true
  poll_interval_seconds: 30
  free_slots_after_run_end_seconds: 60
"""

# dagster.yaml texts that earlier versions generated: dagster_home() replaces them by DAGSTER_YAML, and leaves
# a file edited by hand alone.
EARLIER_DAGSTER_YAMLS = (
    "telemetry:\n  enabled: false\n",
    "telemetry:\n  enabled: false\n"
    "# GPU steps carry pool \"gpu\" (resources/device.py: gpu_step); one at a time unless raised here.\n"
    "concurrency:\n  pools:\n    default_limit: 1\n",
)


def covlab_home() -> Path:
    return Path(os.environ.get("COVLAB_HOME") or Path.cwd() / ".covlab").resolve()


def dagster_home() -> Path:
    """DAGSTER_HOME if set, else `<COVLAB_HOME>/dagster`; created with a dagster.yaml (telemetry off,
    SQLite storage, the default) when missing or as an earlier version generated it."""
    home = Path(os.environ.get("DAGSTER_HOME") or covlab_home() / "dagster").resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists() or config.read_text() in EARLIER_DAGSTER_YAMLS:
        config.write_text(DAGSTER_YAML)
    os.environ["DAGSTER_HOME"] = str(home)
    return home
