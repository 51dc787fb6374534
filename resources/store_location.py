"""An embedded MLflow store (a SQLite database in a covlab home) that was moved or copied follows its new place.

MLflow keeps absolute artifact locations in its database: each experiment's artifact location, each run's
artifact URI, each model version's source and storage location. In a home copied with `cp -a` those still name
the original, so the copy's new runs were written into the original's folders and its versions read from there
(and failed once the original was gone). `follow_moved_store` makes a home self-contained again when a store is
opened: the database records the path it was last opened at (the `covlab_store_location` table); when it is
opened at another path, every location under the old home is rewritten to the same place under the new one, in
one transaction, before anything is written.

The old and the new home are what the two database paths do not share at their end: /a/.covlab/mlflow/mlflow.db
opened as /b/copy/mlflow/mlflow.db moved /a/.covlab to /b/copy. A location outside the old home (an artifact root
configured elsewhere, shared by both) is left alone, and so is one whose counterpart is missing in the new home
while the old one is still there (a copy that left that folder behind). A store recorded before this table
existed has no recorded path: its old place is inferred from a run whose artifact folder appears at the same
place relative to the database in the new home as its recorded location has relative to some folder in the old.
"""

from __future__ import annotations

import logging
import sqlite3
from contextlib import closing
from pathlib import Path
from urllib.parse import unquote, urlsplit

LOCATION_TABLE = "covlab_store_location"
# Every column in which MLflow 3 stores an absolute artifact location (those absent in a schema are skipped).
LOCATION_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"), ("model_versions", "source"),
                    ("model_versions", "storage_location"), ("logged_models", "artifact_location"))

_LOG = logging.getLogger("covlab.tracking")


def local_path(location: str) -> Path | None:
    """The local path a stored location names (a file: URI or a plain absolute path); None for other schemes."""
    if location.startswith("file:"):
        return Path(unquote(urlsplit(location).path))
    return Path(location) if location.startswith("/") else None


def _rebased(location: str, old: Path, new: Path) -> str | None:
    """`location` with the folder `old` replaced by `new`, in the same form (URI or path); None when it is not
    under `old`."""
    for old_form, new_form in ((old.as_uri(), new.as_uri()), (str(old), str(new))):
        if location == old_form or location.startswith(old_form.rstrip("/") + "/"):
            return new_form + location[len(old_form):]
    return None


def moved_homes(old_database: Path, new_database: Path) -> tuple[Path, Path]:
    """(old home, new home): the two database paths without the trailing parts they share."""
    old_parts, new_parts = old_database.parts, new_database.parts
    shared = 0
    while (shared < min(len(old_parts), len(new_parts)) - 1
           and old_parts[len(old_parts) - 1 - shared] == new_parts[len(new_parts) - 1 - shared]):
        shared += 1
    return Path(*old_parts[:len(old_parts) - shared]), Path(*new_parts[:len(new_parts) - shared])


def _columns(connection: sqlite3.Connection) -> list[tuple[str, str]]:
    present = []
    for table, column in LOCATION_COLUMNS:
        if column in {row[1] for row in connection.execute(f"PRAGMA table_info({table})")}:
            present.append((table, column))
    return present


def _recorded(connection: sqlite3.Connection) -> str | None:
    connection.execute(f"CREATE TABLE IF NOT EXISTS {LOCATION_TABLE} (database TEXT NOT NULL)")
    row = connection.execute(f"SELECT database FROM {LOCATION_TABLE}").fetchone()
    return row[0] if row else None


def _inferred_old_database(connection: sqlite3.Connection, database: Path) -> Path | None:
    """For a store without a recorded path: the database path it had when a run's artifact folder, still recorded
    under another folder, was copied or moved along with it (module docstring); None when no run shows that."""
    runs = [(path, local_path(uri)) for path, uri in
            connection.execute("SELECT experiments.artifact_location, runs.artifact_uri FROM runs JOIN experiments "
                               "ON runs.experiment_id = experiments.experiment_id")]
    for location, run in ((local_path(e), r) for e, r in runs):
        if location is None or run is None or not run.is_relative_to(location) or not run.exists():
            continue
        inside = run.relative_to(location)
        for new_home in list(database.parents)[:-1]:
            for old_home in list(location.parents)[:-1]:
                counterpart = new_home / location.relative_to(old_home)
                if counterpart != location and (counterpart / inside).is_dir():
                    return old_home / database.relative_to(new_home)
    return None


def follow_moved_store(database: Path) -> list[str]:
    """Rewrite the artifact locations of the SQLite MLflow store `database` when it was opened at another path
    before (module docstring) and record its path; returns one line per rewritten location (what it was, what it
    is). Called by ModelStore when it opens the store, under the store's file lock."""
    database = database.resolve()
    with closing(sqlite3.connect(database, timeout=60)) as connection, connection:
        if not connection.execute("SELECT 1 FROM sqlite_master WHERE name = 'experiments'").fetchone():
            return []  # not (yet) an MLflow store
        recorded = _recorded(connection)
        if recorded == str(database):
            return []
        old_database = Path(recorded) if recorded else _inferred_old_database(connection, database)
        changes = []
        if old_database is not None and old_database != database:
            old_home, new_home = moved_homes(old_database, database)
            for table, column in _columns(connection):
                for rowid, location in connection.execute(f"SELECT rowid, {column} FROM {table} "
                                                          f"WHERE {column} IS NOT NULL").fetchall():
                    moved = _rebased(location, old_home, new_home)
                    if moved is None or moved == location:
                        continue
                    before, after = local_path(location), local_path(moved)
                    if before.exists() and not after.exists():
                        continue  # left behind by the copy: still read where it is
                    connection.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", (moved, rowid))
                    changes.append(f"{table}.{column}: {location} -> {moved}")
            if changes:
                _LOG.info("the MLflow store %s was at %s: %d artifact locations now point into %s", database,
                          old_database, len(changes), new_home)
        connection.execute(f"DELETE FROM {LOCATION_TABLE}")
        connection.execute(f"INSERT INTO {LOCATION_TABLE} (database) VALUES (?)", (str(database),))
    return changes
