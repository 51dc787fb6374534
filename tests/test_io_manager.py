"""The IO manager reads back only what its writer stored: a value whose bytes no longer have the SHA-256 in
its sidecar fails the loading step, naming the file, both hashes and the writer run, unless the
documented `accept_modified` override is set."""

import hashlib
import json

import pandas as pd
import pytest
from dagster import DagsterInstance, asset, materialize

from covlab.resources.io_manager import LOAD_RECORD, SIDECAR_SUFFIX, LocalTableIOManager


@asset
def retrieval() -> pd.DataFrame:
    return pd.DataFrame({"query_id": ["q1", "q2"], "hit": [1, 0]})


@asset
def report(retrieval: pd.DataFrame) -> dict:
    return {"precision": float(retrieval["hit"].mean())}


@pytest.fixture
def stored(tmp_path):
    """`retrieval` materialized, then its Parquet file rewritten with other (valid) rows: what a hand edit or
    another writer leaves behind."""
    instance = DagsterInstance.ephemeral()
    io_manager = LocalTableIOManager(base_dir=str(tmp_path / "storage"))
    first = materialize([retrieval], instance=instance, resources={"io_manager": io_manager})
    path = tmp_path / "storage" / "retrieval" / "__all__.parquet"
    recorded = json.loads(path.with_name(path.name + SIDECAR_SUFFIX).read_text())["content_sha256"]
    pd.DataFrame({"query_id": ["q1", "q2"], "hit": [1, 1]}).to_parquet(path, index=False)
    return instance, tmp_path / "storage", path, first.run_id, recorded


def test_a_value_changed_after_it_was_written_fails_the_loading_step(stored):
    instance, storage, path, writer_run, recorded = stored
    result = materialize([retrieval, report], selection=[report], instance=instance, raise_on_error=False,
                         resources={"io_manager": LocalTableIOManager(base_dir=str(storage))})
    assert not result.success
    message = str(result.failure_data_for_node("report").error)
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    for expected in (str(path), actual, recorded, f"run {writer_run}", "accept_modified"):
        assert expected in message
    assert not (storage / "report").exists()  # nothing was computed from the changed value


def test_accept_modified_reads_it_with_a_warning_and_says_so_in_the_load_record(stored):
    instance, storage, path, writer_run, recorded = stored
    result = materialize([retrieval, report], selection=[report], instance=instance,
                         resources={"io_manager": LocalTableIOManager(base_dir=str(storage), accept_modified=True)})
    assert result.output_for_node("report") == {"precision": 1.0}
    warnings = [e.message for e in instance.all_logs(result.run_id) if e.level >= 30]
    assert any(str(path) in w and recorded in w and "read anyway" in w for w in warnings)
    (materialization,) = result.asset_materializations_for_node("report")
    (load,) = materialization.metadata[LOAD_RECORD].value
    assert load["asset_key"] == "retrieval" and load["modified"] is True and load["written_by_run"] == writer_run


def test_load_records_ride_on_the_materialization_not_on_observations_of_the_inputs(tmp_path):
    """Each load is recorded once, on what the loading step made: an asset observation per load would list
    more observations than materializations on every upstream asset's page."""
    instance = DagsterInstance.ephemeral()
    io_manager = LocalTableIOManager(base_dir=str(tmp_path / "storage"))
    first = materialize([retrieval], instance=instance, resources={"io_manager": io_manager})
    second = materialize([retrieval, report], selection=[report], instance=instance,
                         resources={"io_manager": io_manager})
    assert not [e for e in second.all_events if e.event_type_value == "ASSET_OBSERVATION"]
    (materialization,) = second.asset_materializations_for_node("report")
    (load,) = materialization.metadata[LOAD_RECORD].value
    stored = tmp_path / "storage" / "retrieval" / "__all__.parquet"
    assert load == {"asset_key": "retrieval", "partition": None, "written_by_run": first.run_id,
                    "content_sha256": hashlib.sha256(stored.read_bytes()).hexdigest(),
                    "data_version": load["data_version"], "path": str(stored)}
    assert load["data_version"]
    (root,) = first.asset_materializations_for_node("retrieval")
    assert LOAD_RECORD not in root.metadata  # it read nothing


def test_an_unchanged_value_loads(tmp_path):
    io_manager = LocalTableIOManager(base_dir=str(tmp_path / "storage"))
    result = materialize([retrieval, report], resources={"io_manager": io_manager})
    assert result.output_for_node("report") == {"precision": 0.5}
