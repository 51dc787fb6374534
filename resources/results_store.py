"""The results store: every figure a report asset computes, next to the materialization that produced it
(Dagster run id, code and data versions, config), in a SQL database: SQLite under COVLAB_HOME by default,
PostgreSQL when several machines share one. The lineage audit
(`covlab audit --value 0.702`) starts here: a printed number leads to the run that computed it.

The tables are declared once below (SQLAlchemy ORM); their history is the alembic migrations in
resources/migrations, applied on first use under a database lock, so that several processes starting at
once migrate exactly once. A test keeps the two in agreement.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
from dagster import ConfigurableResource, InitResourceContext
from pydantic import Field, PrivateAttr
from sqlalchemy import (
    DateTime, Double, Engine, ForeignKey, Index, Integer, MetaData, Select, String, Text, create_engine, event,
    func, insert, select, text,
)
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.pool import NullPool

from covlab.models.schemas import FIGURES, STORED_FIGURES
from covlab.resources.sqlite import ensure_sqlite_folder, sqlite_file

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# Identifier columns: bounded so that the composite indexes fit every backend's key-length limit.
NAME_LENGTH = 255
SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention={
        "pk": "pk_%(table_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    })


class ReportMaterialization(Base):
    """One materialization of a report asset for one dataset partition."""

    __tablename__ = "report_materializations"
    __table_args__ = (Index("ix_report_materializations_dataset_report_asset", "dataset", "report_asset"),
                      Index("ix_report_materializations_run_id", "run_id"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    dataset: Mapped[str] = mapped_column(String(NAME_LENGTH))
    report_asset: Mapped[str] = mapped_column(String(NAME_LENGTH))
    partition: Mapped[str] = mapped_column(String(NAME_LENGTH))
    run_id: Mapped[str] = mapped_column(String(NAME_LENGTH))
    code_version: Mapped[str] = mapped_column(String(NAME_LENGTH))
    data_version: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    config: Mapped[str] = mapped_column(Text, doc="the config that shaped the report, as JSON")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    confirmed_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), doc="when Dagster's materialization of this report was seen; null while the "
                                     "run that wrote it has recorded none (killed in between: an orphan)")


class ReportFigure(Base):
    """One number of a report: a metric of a method at a budget or k, per query or aggregated (query_id null)."""

    __tablename__ = "report_figures"
    __table_args__ = (Index("ix_report_figures_dataset_method_metric", "dataset", "method", "metric"),
                      Index("ix_report_figures_value", "value"),
                      Index("ix_report_figures_materialization_id", "materialization_id"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    materialization_id: Mapped[int] = mapped_column(ForeignKey("report_materializations.id"))
    dataset: Mapped[str] = mapped_column(String(NAME_LENGTH))
    method: Mapped[str] = mapped_column(String(NAME_LENGTH))
    budget: Mapped[int | None] = mapped_column(Integer)
    k: Mapped[int | None] = mapped_column(Integer)
    split: Mapped[str | None] = mapped_column(String(NAME_LENGTH), doc="query split the figure is over")
    metric: Mapped[str] = mapped_column(String(NAME_LENGTH))
    query_id: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    value: Mapped[float] = mapped_column(Double)


@dataclass(frozen=True)
class ReportRecord:
    """Where a report came from: the materialization whose figures are stored with it."""

    dataset: str
    report_asset: str
    partition: str
    run_id: str
    code_version: str
    data_version: str | None
    config: dict[str, Any]


@dataclass(frozen=True)
class StoredReport:
    """A report as stored: its id, provenance and config, when it was written, and its figures."""

    materialization_id: int
    record: ReportRecord
    created_at: datetime
    figures: pd.DataFrame


class ResultsStore(ConfigurableResource):
    """Report figures and their provenance in a SQL database (any SQLAlchemy URL); the schema is migrated
    with alembic on first use."""

    url: str = Field(description="SQLAlchemy URL of the database, e.g. sqlite:////path/results.db or "
                                 "postgresql+psycopg2://user@host:5432/db")
    db_schema: str | None = Field(None, description="PostgreSQL schema holding the tables (created if "
                                                    "missing); None: the connection's default schema")
    busy_timeout_s: float = Field(60.0, description="SQLite: how long a writer waits for another "
                                                    "process's write lock before failing")
    insert_batch_rows: int = Field(5000, gt=0, description="figures sent per INSERT statement")

    _engine: Engine | None = PrivateAttr(default=None)

    def write_report(self, record: ReportRecord, figures: pd.DataFrame) -> int:
        """Store a report's figures with their materialization in one transaction (nothing is kept if any
        part fails); returns the materialization id. The figures are validated before anything is sent."""
        rows = _figure_rows(record, figures)
        config = _config_json(record)
        with Session(self.engine()) as session, session.begin():
            materialization = ReportMaterialization(
                dataset=record.dataset, report_asset=record.report_asset, partition=record.partition,
                run_id=record.run_id, code_version=record.code_version, data_version=record.data_version,
                config=config, created_at=datetime.now(timezone.utc))
            session.add(materialization)
            session.flush()
            materialization_id = materialization.id
            for start in range(0, len(rows), self.insert_batch_rows):
                batch = rows[start:start + self.insert_batch_rows]
                session.execute(insert(ReportFigure), [{**row, "materialization_id": materialization_id}
                                                       for row in batch])
        return materialization_id

    def figures(self, dataset: str | None = None, method: str | None = None, metric: str | None = None,
                budget: int | None = None, k: int | None = None, split: str | None = None,
                aggregate_only: bool = False, confirmed_only: bool = False,
                materialization_id: int | None = None) -> pd.DataFrame:
        """Stored figures matching every given filter (None: any), oldest materialization first;
        `aggregate_only` keeps the rows over all queries (query_id null), `confirmed_only` those of
        confirmed report materializations, `materialization_id` those of one report materialization."""
        query = _figures_query(confirmed_only)
        for column, wanted in ((ReportFigure.dataset, dataset), (ReportFigure.method, method),
                               (ReportFigure.metric, metric), (ReportFigure.budget, budget),
                               (ReportFigure.k, k), (ReportFigure.split, split),
                               (ReportFigure.materialization_id, materialization_id)):
            if wanted is not None:
                query = query.where(column == wanted)
        if aggregate_only:
            query = query.where(ReportFigure.query_id.is_(None))
        return self._read(query.order_by(ReportFigure.materialization_id, ReportFigure.id))

    def find_value(self, value: float, tolerance: float = 5e-4, confirmed_only: bool = False) -> pd.DataFrame:
        """Figures within `tolerance` of `value` (a number as printed, e.g. 0.702 to three decimals),
        closest first: where a reported number came from."""
        if not math.isfinite(value) or not tolerance >= 0:
            raise ValueError(f"find_value: expected a finite value and a tolerance >= 0, "
                             f"got value={value!r}, tolerance={tolerance!r}")
        query = (_figures_query(confirmed_only).where(ReportFigure.value.between(value - tolerance, value + tolerance))
                 .order_by(func.abs(ReportFigure.value - value), ReportFigure.materialization_id, ReportFigure.id))
        return self._read(query)

    def catalog(self) -> dict[str, list[str]]:
        """The distinct datasets, methods, metrics and splits of the stored figures, sorted (what `covlab audit
        --help` lists); all empty when nothing is stored. A SQLite file that does not exist is not created."""
        columns = {"datasets": ReportFigure.dataset, "methods": ReportFigure.method, "metrics": ReportFigure.metric,
                   "splits": ReportFigure.split}
        database = sqlite_file(self.url)
        if database is not None and not database.exists():
            return {name: [] for name in columns}
        with self.engine().connect() as connection:
            return {name: list(connection.execute(select(column).distinct().where(column.is_not(None))
                                                  .order_by(column)).scalars())
                    for name, column in columns.items()}

    def pending(self) -> list[tuple[int, ReportRecord]]:
        """Report materializations not confirmed yet: (id, record), oldest first."""
        query = (select(ReportMaterialization).where(ReportMaterialization.confirmed_at.is_(None))
                 .order_by(ReportMaterialization.id))
        with Session(self.engine()) as session:
            return [(row.id, _record(row)) for row in session.scalars(query)]

    def confirm(self, materialization_id: int) -> None:
        """Mark a report materialization confirmed: its Dagster materialization exists."""
        with Session(self.engine()) as session, session.begin():
            row = session.get(ReportMaterialization, materialization_id)
            if row is None:
                raise KeyError(f"results store {self._safe_url()}: no report materialization {materialization_id}")
            row.confirmed_at = row.confirmed_at or datetime.now(timezone.utc)

    def report(self, materialization_id: int) -> StoredReport:
        """One stored report with its provenance and config; KeyError when there is no such id."""
        with Session(self.engine()) as session:
            materialization = session.get(ReportMaterialization, materialization_id)
            if materialization is None:
                raise KeyError(f"results store {self._safe_url()}: no report materialization "
                               f"{materialization_id}")
        record = _record(materialization)
        figures = self._read(_figures_query().where(ReportFigure.materialization_id == materialization_id)
                             .order_by(ReportFigure.id))
        return StoredReport(materialization_id=materialization_id, record=record,
                            created_at=_as_utc(materialization.created_at), figures=figures)

    def latest_report(self, dataset: str, report_asset: str, confirmed_only: bool = False) -> StoredReport | None:
        """The newest stored materialization of `report_asset` for `dataset` (`confirmed_only`: of those whose
        Dagster materialization was seen), or None."""
        query = (select(ReportMaterialization.id)
                 .where(ReportMaterialization.dataset == dataset, ReportMaterialization.report_asset == report_asset))
        if confirmed_only:
            query = query.where(ReportMaterialization.confirmed_at.is_not(None))
        query = (query.order_by(ReportMaterialization.created_at.desc(), ReportMaterialization.id.desc()).limit(1))
        with self.engine().connect() as connection:
            newest = connection.execute(query).scalar()
        return None if newest is None else self.report(newest)

    def engine(self) -> Engine:
        """The engine of this store, created and migrated to the newest schema on first call."""
        if self._engine is None:
            engine = self._create_engine()
            self._upgrade(engine)
            self._engine = engine
        return self._engine

    def dispose(self) -> None:
        """Close pooled connections (the store reconnects on next use)."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        self.dispose()

    def _read(self, query: Select) -> pd.DataFrame:
        with self.engine().connect() as connection:
            frame = pd.DataFrame(connection.execute(query).all(), columns=list(STORED_FIGURES.columns))
        for column in ("created_at", "confirmed_at"):
            frame[column] = pd.to_datetime(frame[column], utc=True)
        return STORED_FIGURES.conform(frame, source=f"results store {self._safe_url()}")

    def _create_engine(self) -> Engine:
        url = make_url(self.url)
        backend = url.get_backend_name()
        if self.db_schema is not None:
            if backend != "postgresql":
                raise ValueError(f"results store: db_schema={self.db_schema!r} names a PostgreSQL schema, "
                                 f"but the url is a {backend} database; leave db_schema unset")
            if not SCHEMA_NAME.fullmatch(self.db_schema):
                raise ValueError(f"results store: db_schema={self.db_schema!r} is not a plain identifier; "
                                 "expected letters, digits and underscores, starting with a letter or _")
            self._create_schema()
        if backend == "sqlite":
            ensure_sqlite_folder(self.url)
            engine = create_engine(url, connect_args={"timeout": self.busy_timeout_s})
            event.listen(engine, "connect", _enforce_sqlite_foreign_keys)
            return engine
        engine = create_engine(url)
        if self.db_schema is not None:
            # Before the dialect's first-connect initialisation, so that its default schema is this one.
            event.listen(engine, "connect", _search_path_setter(self.db_schema), insert=True)
        return engine

    def _create_schema(self) -> None:
        bootstrap = create_engine(self.url, poolclass=NullPool)
        try:
            with bootstrap.begin() as connection:
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": self._lock_key()})
                connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{self.db_schema}"'))
        finally:
            bootstrap.dispose()

    def _upgrade(self, engine: Engine) -> None:
        """Migrate to the newest revision while holding the database's write lock (SQLite) or an advisory
        lock (PostgreSQL), so that concurrent first uses see either no tables or all of them."""
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS).replace("%", "%%"))
        with engine.connect() as connection:
            backend = engine.dialect.name
            if backend == "sqlite":
                connection.exec_driver_sql("BEGIN IMMEDIATE")
            elif backend == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": self._lock_key()})
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
            connection.commit()

    def _lock_key(self) -> int:
        digest = hashlib.sha256(f"covlab.results_store:{self.db_schema or ''}".encode()).digest()
        return int.from_bytes(digest[:8], "big", signed=True)

    def _safe_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)


def _record(row: ReportMaterialization) -> ReportRecord:
    return ReportRecord(dataset=row.dataset, report_asset=row.report_asset, partition=row.partition,
                        run_id=row.run_id, code_version=row.code_version, data_version=row.data_version,
                        config=json.loads(row.config))


def _figures_query(confirmed_only: bool = False) -> Select:
    query = (select(ReportFigure.materialization_id, ReportFigure.dataset, ReportFigure.method, ReportFigure.budget,
                   ReportFigure.k, ReportFigure.split, ReportFigure.metric, ReportFigure.query_id, ReportFigure.value,
                   ReportMaterialization.run_id, ReportMaterialization.report_asset, ReportMaterialization.partition,
                   ReportMaterialization.code_version, ReportMaterialization.data_version,
                   ReportMaterialization.created_at, ReportMaterialization.confirmed_at)
             .join(ReportMaterialization, ReportFigure.materialization_id == ReportMaterialization.id))
    return query.where(ReportMaterialization.confirmed_at.is_not(None)) if confirmed_only else query


def _figure_rows(record: ReportRecord, figures: pd.DataFrame) -> list[dict[str, Any]]:
    """The figures as plain Python rows, after checking every column, type and value (DatasetError names
    the column and the record that is off)."""
    source = f"report {record.report_asset} [{record.partition}]"
    for field_name in ("dataset", "report_asset", "partition", "run_id", "code_version"):
        if not isinstance(getattr(record, field_name), str) or not getattr(record, field_name):
            raise ValueError(f"{source}: ReportRecord.{field_name} must be a non-empty string, "
                             f"got {getattr(record, field_name)!r}")
    if record.data_version is not None and not isinstance(record.data_version, str):
        raise ValueError(f"{source}: ReportRecord.data_version must be a string or None, "
                         f"got {record.data_version!r}")
    if "split" not in figures.columns:  # optional: figures not tied to one query split
        figures = figures.assign(split=pd.Series([None] * len(figures), dtype="string[python]", index=figures.index))
    table = FIGURES.conform(figures, source=source)
    not_finite = ~table["value"].map(math.isfinite)
    if not_finite.any():
        position = int(not_finite.to_numpy().argmax())
        raise ValueError(f"{source}: report_figures.value must be a finite number; "
                         f"record {position} has {table['value'].iloc[position]!r}")
    other_dataset = table["dataset"] != record.dataset
    if other_dataset.any():
        position = int(other_dataset.to_numpy().argmax())
        raise ValueError(f"{source}: report_figures.dataset must be the report's dataset {record.dataset!r}; "
                         f"record {position} has {table['dataset'].iloc[position]!r}")
    # Missing values as None and numbers as Python scalars: what every DB-API driver accepts.
    return table.astype(object).where(table.notna(), None).to_dict("records")


def _config_json(record: ReportRecord) -> str:
    try:
        return json.dumps(record.config, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"report {record.report_asset} [{record.partition}]: ReportRecord.config must be "
                         f"JSON-serialisable (strings, numbers, lists, dicts): {exc}") from None


def _as_utc(moment: datetime) -> datetime:
    """SQLite hands back naive datetimes; they were written in UTC."""
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def _enforce_sqlite_foreign_keys(dbapi_connection, connection_record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _search_path_setter(schema: str):
    """A connect hook that puts every new PostgreSQL session into `schema` (SQLAlchemy's recipe for
    alternate search paths): ORM, alembic and its version table then all live there."""

    def set_search_path(dbapi_connection, connection_record) -> None:
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        cursor = dbapi_connection.cursor()
        cursor.execute(f'SET SESSION search_path TO "{schema}"')
        cursor.close()
        dbapi_connection.autocommit = autocommit

    return set_search_path
