"""SQLite URLs of the embedded stores (results store, MLflow): the database file a URL names, and its folder."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import make_url


def sqlite_file(url: str) -> Path | None:
    """The database file a SQLite URL names; None for other backends, in-memory databases and file: URIs."""
    if not url.startswith("sqlite"):
        return None
    database = make_url(url).database
    if database and database != ":memory:" and not database.startswith("file:"):
        return Path(database)
    return None


def ensure_sqlite_folder(url: str) -> None:
    """Create the folder of a SQLite database file (SQLite creates the file, not its folder); other URLs
    are left alone."""
    database = sqlite_file(url)
    if database is not None:
        database.parent.mkdir(parents=True, exist_ok=True)
