"""The results store against SQLite (a temporary file) and PostgreSQL (127.0.0.1:5432, a fresh schema per
test): migrations agree with the ORM and run once under concurrency, writes are all-or-nothing, reads
return exactly what was written."""

import multiprocessing
import uuid

import pandas as pd
import pytest
from sqlalchemy import Column, Engine, Integer, create_engine, event, text

from covlab.models.schemas import DatasetError
from covlab.resources.results_store import STORED_FIGURES, Base, ReportRecord, ResultsStore

POSTGRES_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"


def _postgres_problem() -> str | None:
    import psycopg2

    try:
        psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="test", connect_timeout=3).close()
    except psycopg2.OperationalError as exc:
        return f"PostgreSQL at 127.0.0.1:5432 (database test) does not answer: {exc}".strip()
    return None


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.services)])
def store_settings(request, tmp_path):
    """Settings of a store that has never been used: a new SQLite file, or a new PostgreSQL schema."""
    if request.param == "sqlite":
        yield {"url": f"sqlite:///{tmp_path / 'results' / 'results.db'}"}
        return
    problem = _postgres_problem()
    if problem:
        pytest.skip(problem)
    schema = f"covlab_test_{uuid.uuid4().hex[:12]}"
    yield {"url": POSTGRES_URL, "db_schema": schema}
    admin = create_engine(POSTGRES_URL)
    with admin.begin() as connection:
        connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture
def store(store_settings):
    results = ResultsStore(**store_settings)
    yield results
    results.dispose()


def record(**changes) -> ReportRecord:
    fields = {"dataset": "demo", "report_asset": "evaluation_report", "partition": "demo", "run_id": "run-1",
              "code_version": "3", "data_version": "dv-abc", "config": {"budgets": [128, 256], "seed": 7}}
    return ReportRecord(**{**fields, **changes})


def figures(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["dataset", "method", "budget", "k", "metric", "query_id", "value"])


REPORT = figures([
    ("demo", "mmr", 128, None, "alpha_ndcg", None, 0.702),
    ("demo", "mmr", 128, None, "alpha_ndcg", "q1", 0.5),
    ("demo", "facloc", 128, None, "alpha_ndcg", None, 0.65),
    ("demo", "facloc", None, 10, "strecall", None, 0.8),
    ("demo", "mmr", None, 10, "strecall", "q2", 0.25),
])


def test_migrated_schema_matches_the_orm(store):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import MetaData

    with store.engine().connect() as connection:
        context = MigrationContext.configure(connection)
        assert context.get_current_revision() == "0002"
        assert compare_metadata(context, Base.metadata) == []
        # The comparison sees differences: the same tables plus one column do not match.
        altered = MetaData()
        for table in Base.metadata.sorted_tables:
            table.to_metadata(altered)
        altered.tables["report_figures"].append_column(Column("extra", Integer))
        assert [d[0] for d in compare_metadata(context, altered)] == ["add_column"]


def _write_one(settings: dict, run_id: str, start) -> None:
    start.wait()
    ResultsStore(**settings).write_report(record(run_id=run_id), REPORT)


def test_concurrent_first_use_migrates_once(store_settings):
    """Four processes use a store that was never migrated, all at once: each write lands, one version row."""
    processes = 4
    fork = multiprocessing.get_context("fork")
    start = fork.Barrier(processes)
    workers = [fork.Process(target=_write_one, args=(store_settings, f"run-{i}", start)) for i in range(processes)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0] * processes
    results = ResultsStore(**store_settings)
    stored = results.figures()
    assert len(stored) == processes * len(REPORT)
    assert sorted(stored["run_id"].unique()) == [f"run-{i}" for i in range(processes)]
    assert stored.groupby("run_id")["materialization_id"].nunique().eq(1).all()
    with results.engine().connect() as connection:
        assert connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == ["0002"]
    results.dispose()


def test_reopening_keeps_schema_and_rows(store_settings):
    first = ResultsStore(**store_settings)
    materialization_id = first.write_report(record(), REPORT)
    first.dispose()
    second = ResultsStore(**store_settings)
    assert second.report(materialization_id).figures["value"].tolist() == REPORT["value"].tolist()
    second.dispose()


def test_written_figures_read_back_with_provenance(store):
    first = store.write_report(record(), REPORT)
    second = store.write_report(record(run_id="run-2", data_version=None),
                                figures([("demo", "mmr", 256, None, "alpha_ndcg", None, 0.75)]))
    assert second != first
    stored = store.figures()
    assert list(stored.columns) == list(STORED_FIGURES.columns)
    assert stored["materialization_id"].tolist() == [first] * 5 + [second]
    assert stored["method"].tolist() == ["mmr", "mmr", "facloc", "facloc", "mmr", "mmr"]
    assert stored["budget"].tolist() == [128, 128, 128, pd.NA, pd.NA, 256]
    assert stored["k"].tolist() == [pd.NA, pd.NA, pd.NA, 10, 10, pd.NA]
    assert stored["query_id"].tolist() == [pd.NA, "q1", pd.NA, pd.NA, "q2", pd.NA]
    assert stored["value"].tolist() == [0.702, 0.5, 0.65, 0.8, 0.25, 0.75]
    assert stored["run_id"].tolist() == ["run-1"] * 5 + ["run-2"]
    assert stored["data_version"].tolist() == ["dv-abc"] * 5 + [pd.NA]
    assert set(stored["report_asset"]) == {"evaluation_report"} and set(stored["code_version"]) == {"3"}
    assert str(stored["created_at"].dt.tz) == "UTC"
    now = pd.Timestamp.now(tz="UTC")
    assert ((now - stored["created_at"]) < pd.Timedelta(minutes=5)).all()


def test_figure_filters(store):
    store.write_report(record(), REPORT)
    store.write_report(record(dataset="other", partition="other"),
                       figures([("other", "mmr", 128, None, "alpha_ndcg", None, 0.1)]))
    assert store.figures(dataset="other")["value"].tolist() == [0.1]
    assert store.figures(dataset="demo", method="mmr")["value"].tolist() == [0.702, 0.5, 0.25]
    assert store.figures(method="mmr", metric="alpha_ndcg")["value"].tolist() == [0.702, 0.5, 0.1]
    assert store.figures(dataset="demo", budget=128)["value"].tolist() == [0.702, 0.5, 0.65]
    assert store.figures(k=10)["value"].tolist() == [0.8, 0.25]
    assert store.figures(dataset="demo", aggregate_only=True)["value"].tolist() == [0.702, 0.65, 0.8]
    assert store.figures(method="absent").empty
    store.write_report(record(run_id="run-3"), REPORT.head(2).assign(split=["test", "dev"]))
    assert store.figures(split="dev")["value"].tolist() == [0.5]
    assert store.figures(split="test")["value"].tolist() == [0.702]
    assert list(store.figures(method="absent").columns) == list(STORED_FIGURES.columns)


def test_find_value_returns_the_closest_figures_within_tolerance(store):
    store.write_report(record(), figures([
        ("demo", "a", 128, None, "alpha_ndcg", None, value) for value in (0.7013, 0.7016, 0.702, 0.7023, 0.7026)]))
    store.write_report(record(run_id="run-2"), figures([("demo", "b", 128, None, "alpha_ndcg", None, 0.70195)]))
    found = store.find_value(0.702)
    assert found["value"].tolist() == [0.702, 0.70195, 0.7023, 0.7016]
    assert found["run_id"].tolist() == ["run-1", "run-2", "run-1", "run-1"]
    assert store.find_value(0.702, tolerance=0)["value"].tolist() == [0.702]
    assert store.find_value(0.3).empty
    with pytest.raises(ValueError, match="tolerance >= 0"):
        store.find_value(0.702, tolerance=-1)


def test_latest_report_and_report_by_id(store):
    assert store.latest_report("demo", "evaluation_report") is None
    store.write_report(record(), REPORT)
    newest = store.write_report(record(run_id="run-2", config={"budgets": [64], "seed": 8}), REPORT.head(2))
    store.write_report(record(report_asset="ablation_table"), REPORT.head(1))
    latest = store.latest_report("demo", "evaluation_report")
    assert latest.materialization_id == newest
    assert latest.record == record(run_id="run-2", config={"budgets": [64], "seed": 8})
    assert latest.figures["value"].tolist() == [0.702, 0.5]
    assert latest.created_at.tzinfo is not None
    assert store.report(newest).record == latest.record
    with pytest.raises(KeyError, match="no report materialization 999"):
        store.report(999)


@pytest.mark.parametrize("frame, bad_record, message", [
    (REPORT.drop(columns=["metric"]), {}, r"missing column\(s\) \['metric'\]"),
    (REPORT.assign(budget=[128, 2.5, None, None, None]), {}, r"report_figures.budget must be Int64; record 1 has 2.5"),
    (REPORT.assign(value=[0.1, 0.2, float("nan"), 0.4, 0.5]), {}, r"value must be a finite number; record 2"),
    (REPORT.assign(value=[0.1, "high", 0.3, 0.4, 0.5]), {}, r"value must be float64; record 1 has 'high'"),
    (REPORT.assign(method=["mmr", None, "x", "x", "x"]), {}, r"report_figures.method must be string; record 1"),
    (REPORT.assign(dataset=["demo", "demo", "demo", "beir", "demo"]), {}, r"dataset 'demo'; record 3 has 'beir'"),
    (REPORT, {"config": {"path": object()}}, r"config must be JSON-serialisable"),
    (REPORT, {"run_id": ""}, r"ReportRecord.run_id must be a non-empty string"),
])
def test_bad_input_is_rejected_before_writing(store, frame, bad_record, message):
    with pytest.raises((DatasetError, ValueError), match=message):
        store.write_report(record(**bad_record), frame)
    assert store.figures().empty
    assert store.latest_report("demo", "evaluation_report") is None


def test_failure_mid_insert_leaves_no_rows(store_settings):
    """The materialization row and the first batch of figures are sent, the second batch fails: the
    transaction leaves nothing behind, and the store keeps working."""
    store = ResultsStore(**store_settings, insert_batch_rows=2)
    figure_inserts = []

    def fail_second_figure_batch(connection, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("INSERT INTO REPORT_FIGURES"):
            figure_inserts.append(statement)
            if len(figure_inserts) == 2:
                raise RuntimeError("injected failure in the second batch of figures")

    event.listen(Engine, "before_cursor_execute", fail_second_figure_batch)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            store.write_report(record(), REPORT)
    finally:
        event.remove(Engine, "before_cursor_execute", fail_second_figure_batch)
    assert len(figure_inserts) == 2
    assert store.figures().empty
    assert store.latest_report("demo", "evaluation_report") is None
    materialization_id = store.write_report(record(), REPORT)
    assert store.report(materialization_id).figures["value"].tolist() == REPORT["value"].tolist()
    store.dispose()


def test_db_schema_needs_postgresql_and_a_plain_name(tmp_path):
    with pytest.raises(ValueError, match="names a PostgreSQL schema, but the url is a sqlite database"):
        ResultsStore(url=f"sqlite:///{tmp_path / 'r.db'}", db_schema="reports").engine()
    with pytest.raises(ValueError, match="not a plain identifier"):
        ResultsStore(url=POSTGRES_URL, db_schema='x"; DROP TABLE y; --').engine()


def test_reports_are_pending_until_confirmed(store):
    orphan = store.write_report(record(run_id="killed"), figures([("demo", "mmr", 128, None, "alpha_ndcg", None, 0.3)]))
    kept = store.write_report(record(run_id="done"), figures([("demo", "mmr", 128, None, "alpha_ndcg", None, 0.3)]))
    assert [m for m, _ in store.pending()] == [orphan, kept]
    store.confirm(kept)
    store.confirm(kept)  # idempotent
    assert [m for m, _ in store.pending()] == [orphan]
    assert store.find_value(0.3)["materialization_id"].tolist() == [orphan, kept]
    confirmed = store.find_value(0.3, confirmed_only=True)
    assert confirmed["materialization_id"].tolist() == [kept] and confirmed["confirmed_at"].notna().all()
    assert store.figures(confirmed_only=True)["run_id"].tolist() == ["done"]
    with pytest.raises(KeyError, match="no report materialization 999"):
        store.confirm(999)
