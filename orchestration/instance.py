"""The Dagster instance of a covlab home: its folder (`<COVLAB_HOME>/dagster` unless DAGSTER_HOME says otherwise)
and the dagster.yaml covlab writes there, and how the instance is opened.

The Dagster instance is opened through `dagster_instance`: on first use Dagster creates and migrates its
SQLite databases (runs, schedules, event log index) without any lock between processes, and several
covlab commands starting at once on a fresh home then stamp two schema revisions into one database, after
which no command can open the instance. `dagster_instance` opens it while holding a file lock in the
Dagster home, so exactly one process creates and migrates it, and repairs a home an unlocked first use broke.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile
from contextlib import closing, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from covlab.resources.home import covlab_home

if TYPE_CHECKING:
    from dagster import DagsterInstance

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


# In the Dagster home: held while the instance is opened (and, on first use, created and migrated).
INSTANCE_LOCK = ".covlab-instance.lock"
INSTANCE_LOCK_TIMEOUT_S = 300.0


class InstanceBroken(RuntimeError):
    """The Dagster instance cannot be opened and covlab cannot repair it safely; the message says what to do."""


def dagster_home() -> Path:
    """DAGSTER_HOME if set, else `<COVLAB_HOME>/dagster`; created with a dagster.yaml (telemetry off,
    SQLite storage, the default) when missing or as an earlier version generated it. The file is replaced
    atomically, so a process starting at the same time never reads half of it."""
    from covlab.resources.io_manager import atomic_write

    home = Path(os.environ.get("DAGSTER_HOME") or covlab_home() / "dagster").resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists() or config.read_text() in EARLIER_DAGSTER_YAMLS:
        atomic_write(config, lambda tmp: tmp.write_text(DAGSTER_YAML))
    os.environ["DAGSTER_HOME"] = str(home)
    return home


@contextmanager
def instance_lock() -> Iterator[Path]:
    """Holds `<dagster home>/.covlab-instance.lock` (yielding the home): one process at a time opens, creates
    or changes the instance's databases under it. Not reentrant: never taken twice by one process."""
    from filelock import FileLock, Timeout

    home = dagster_home()
    lock = FileLock(home / INSTANCE_LOCK, timeout=INSTANCE_LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except Timeout:
        raise InstanceBroken(f"{home / INSTANCE_LOCK}: another running process has held this lock on the Dagster "
                             f"instance for {INSTANCE_LOCK_TIMEOUT_S:g} s (a lock dies with its process, so one is "
                             "alive); wait for that covlab command to finish, or stop it, and run the command again"
                             ) from None
    try:
        yield home
    finally:
        lock.release()


def dagster_instance() -> "DagsterInstance":
    """The Dagster instance of `dagster_home()`, opened under `instance_lock` (`open_instance`)."""
    with instance_lock() as home:
        return open_instance(home)


def open_instance(home: Path) -> "DagsterInstance":
    """The Dagster instance in `home`; the caller holds `instance_lock`. The first process creates and
    migrates its databases, every later one opens them as they are. A home whose databases an unlocked
    concurrent first use left with two schema revisions is repaired when its tables are exactly Dagster's
    current ones (`repair_schema_revisions`), else InstanceBroken says what to do."""
    from dagster import DagsterInstance

    try:
        return DagsterInstance.get()
    except Exception:
        if not repair_schema_revisions(home):
            raise
    return DagsterInstance.get()


def repair_schema_revisions(home: Path) -> list[Path]:
    """Repairs the SQLite databases of the instance in `home` that record more than one alembic schema
    revision, and returns them ([] when none does). A database is repaired (its other revisions dropped)
    only when one of its revisions is Dagster's newest and it holds every table and index of a newly created
    instance with the same definition, i.e. it was fully created at that revision; otherwise InstanceBroken
    says how to start over. Run while holding the instance lock."""
    import dagster

    repaired = []
    with tempfile.TemporaryDirectory(prefix="covlab-instance-reference-") as scratch:
        Path(scratch, "dagster.yaml").write_text(EARLIER_DAGSTER_YAMLS[0])  # telemetry off, default storage
        with dagster.DagsterInstance.local_temp(scratch):  # Dagster's own layout and schema at its newest revision
            pass
        for reference in sorted(Path(scratch).rglob("*.db")):
            database = home / reference.relative_to(scratch)
            revisions = _schema_revisions(database)
            if len(revisions) < 2:
                continue
            (newest,) = _schema_revisions(reference)
            missing = _schema(reference) - _schema(database)
            if newest not in revisions or missing:
                why = (f"none of them is Dagster {dagster.__version__}'s newest ({newest})" if newest not in revisions
                       else f"{len(missing)} of Dagster {dagster.__version__}'s tables and indexes are missing or "
                            f"differ (e.g. {sorted(missing)[0][1]})")
                raise InstanceBroken(
                    f"{database}: the Dagster instance records {len(revisions)} schema revisions "
                    f"({', '.join(revisions)}), left by processes that created it at the same time, and {why}, so "
                    f"covlab cannot repair it safely; move {home} aside (its run history stays there) and run the "
                    "command again: a new instance is created and the datasets in datasets.json are added back")
            with closing(sqlite3.connect(database)) as connection, connection:
                connection.execute("DELETE FROM alembic_version WHERE version_num != ?", (newest,))
            print(f"covlab: repaired {database}: it recorded schema revisions {', '.join(revisions)} (processes that "
                  f"created it at the same time); its tables are Dagster {dagster.__version__}'s at {newest}, which it "
                  "now records alone", file=sys.stderr)
            repaired.append(database)
    return repaired


def _schema_revisions(database: Path) -> list[str]:
    """The alembic revisions a SQLite database records (normally one); [] when it has no version table."""
    if not database.is_file():
        return []
    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as connection:
        try:
            return sorted(row[0] for row in connection.execute("SELECT version_num FROM alembic_version"))
        except sqlite3.OperationalError:
            return []


def _schema(database: Path) -> set[tuple[str, str, str]]:
    """(type, name, CREATE statement) of every table and index of a SQLite database, SQLite's own left out."""
    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as connection:
        return {(kind, name, " ".join((sql or "").split())) for kind, name, sql in connection.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")}
